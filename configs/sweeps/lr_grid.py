"""Grid over the peak learning rate: `jaxtrain sweep --config configs/tiny.py --sweep configs/sweeps/lr_grid.py`

Three ordinary runs in runs/sweeps/tiny_lr_grid/trial_000{0,1,2}, compared on their final eval_loss.
The format of this file is documented in docs/experiments.md (Sweeps).
"""


def get_sweep():
    return {
        "space": {"optim.lr": [1e-3, 3e-3, 1e-2]},
        "sampler": "grid",  # every value, in this order; `trials` defaults to the grid size
        "objective": "final",
        "metric": "eval_loss",
        "direction": "minimize",
    }
