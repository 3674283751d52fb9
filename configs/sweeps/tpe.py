"""Bayesian search (Optuna TPE) over the optimizer, stopping bad trials early with the median rule:

    jaxtrain sweep --config configs/tiny.py --sweep configs/sweeps/tpe.py --workers 2

The bounds suit configs/tiny.py (20 steps) and configs/default.py (150 steps): warmup stays below both.
The format of this file is documented in docs/experiments.md (Sweeps).
"""

from jaxtrain.tools.sweep import integer, loguniform, uniform


def get_sweep():
    return {
        "space": {
            "optim.lr": loguniform(3e-4, 3e-2),
            "optim.warmup_steps": integer(0, 10),
            "optim.weight_decay": uniform(0.0, 0.3),
        },
        "sampler": "tpe",
        "sampler_args": {"n_startup_trials": 5},  # random draws before TPE models the results
        "trials": 16,
        "objective": "final",
        "metric": "eval_loss",
        "direction": "minimize",
        # Prune a trial whose eval_loss is worse than the median of earlier trials at the same step, once
        # 3 trials have finished; never at step 0 (every trial starts from the same init).
        "pruner": "median",
        "pruner_args": {"n_startup_trials": 3, "n_warmup_steps": 1},
        "seed": 0,
    }
