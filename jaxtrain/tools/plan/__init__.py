"""`jaxtrain plan`: does this fit, and how fast could it go? The train step compiled ahead of time for N devices
(shapes only, nothing allocated) and read back next to an analytic estimate (docs/planning.md).

From the top: `cli` (the command; sets XLA's flags before jax is imported), `planner` (`plan()`: compile and read
back), `report` (`format_report`), `analytic`, `collectives` and `roofline` (the figures), `replica_groups` (HLO
groups -> mesh axes), `topology` (GPUs described to XLA:GPU). Import the module you need; nothing here imports jax.
"""
