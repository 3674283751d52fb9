"""Optimizer and learning-rate schedules from `config.optim`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group

SCHEDULES = ("cosine", "linear", "wsd", "constant")
# The config's `optim` group: AdamW with linear warmup, then `schedule` down to lr * min_lr_ratio (wsd decays over
# the last `decay_fraction`); no weight decay on norm scales; global-norm clipping at `clip_norm` (0 = off).
CONFIG = dict(lr=3e-3, warmup_steps=15, schedule="cosine", min_lr_ratio=0.1, decay_fraction=0.2,
              weight_decay=0.1, clip_norm=1.0, b1=0.9, b2=0.95, eps=1e-8)


def check_config(o, *, total_steps: int) -> None:
    """ConfigError naming the first bad field of the `optim` group."""
    g = Group(o, "optim")
    g.number("lr", lo=0, lo_open=True)
    g.positive_int("warmup_steps", allow_zero=True)
    if o.warmup_steps > total_steps:
        raise ConfigError("optim.warmup_steps", f"{o.warmup_steps} exceeds train.steps={total_steps}")
    g.choice("schedule", SCHEDULES, what="schedule")
    g.number("min_lr_ratio", lo=0, hi=1)
    g.number("decay_fraction", lo=0, hi=1)
    g.number("weight_decay", lo=0)
    g.number("clip_norm", lo=0)  # 0 disables clipping
    g.number("b1", lo=0, hi=1)
    g.number("b2", lo=0, hi=1)
    g.number("eps", lo=0, lo_open=True)


def schedule(optim_cfg, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then the named decay down to `lr * min_lr_ratio` at `total_steps`.

    wsd (warmup-stable-decay) holds `lr` and decays linearly over the last `decay_fraction` of the run.
    """
    lr, warmup = optim_cfg.lr, optim_cfg.warmup_steps
    floor = lr * optim_cfg.min_lr_ratio
    rest = max(total_steps - warmup, 1)
    kind = optim_cfg.schedule
    if kind == "constant":
        after = optax.constant_schedule(lr)
    elif kind == "cosine":
        after = optax.cosine_decay_schedule(lr, rest, alpha=optim_cfg.min_lr_ratio)
    elif kind == "linear":
        after = optax.linear_schedule(lr, floor, rest)
    elif kind == "wsd":
        decay = max(int(round(rest * optim_cfg.decay_fraction)), 1)
        after = optax.join_schedules([optax.constant_schedule(lr), optax.linear_schedule(lr, floor, decay)],
                                     [rest - decay])
    else:
        raise ValueError(f"optim.schedule: unknown schedule {kind!r}")
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def decay_mask(params):
    """True where weight decay applies: every weight except norm scales and biases."""
    def decays(path, _):
        names = [str(getattr(k, "key", k)) for k in path]
        return not any("norm" in n or "bias" in n for n in names)
    return jax.tree_util.tree_map_with_path(decays, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm (the same empty state, so checkpoints are unchanged) that takes the norm the step
    already computed (`update(..., global_norm=n)`) and clips by multiplying with min(1, max_norm / n).

    optax's own form, select(n < max_norm, g, g / n * max_norm), wrote the clipped gradients out before Adam
    read them and computed the norm a second time; a plain scale fuses into Adam's moment updates: 20 bytes a
    parameter less memory traffic (bench_cpu, f32), which matters where the optimizer is memory-bound (GPU).
    Without `global_norm` it computes the norm itself.
    """
    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        scale = jnp.minimum(1.0, max_norm / norm)  # norm 0 -> inf -> 1: unclipped
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def make_optimizer(optim_cfg, total_steps: int) -> optax.GradientTransformationExtraArgs:
    """Clipping (optional) then AdamW with decoupled weight decay. `update` takes `global_norm=` (the gradients'
    global norm, when the caller has it) for the clip."""
    parts = []
    if optim_cfg.clip_norm > 0:
        parts.append(clip_by_global_norm(optim_cfg.clip_norm))
    parts.append(optax.adamw(schedule(optim_cfg, total_steps), b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                             weight_decay=optim_cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
