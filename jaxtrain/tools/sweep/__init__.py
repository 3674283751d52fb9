"""Hyperparameter sweeps over a config: `jaxtrain sweep --config configs/tiny.py --sweep configs/sweeps/lr_grid.py`.

Every trial is an ordinary run of the config plus the trial's values, in its own workdir under the sweep dir;
the search is Optuna's, and workers on one or many machines share its study. Sweep files import `uniform`,
`loguniform`, `integer` and `choice` from here; notebooks call `run(config, sweep_file, sweep_dir)`.
The format, workers, storage and exit codes: docs/experiments.md (Sweeps).
"""

from jaxtrain.tools.sweep.runner import run
from jaxtrain.tools.sweep.spec import choice, integer, loguniform, uniform

__all__ = ["choice", "integer", "loguniform", "run", "uniform"]
