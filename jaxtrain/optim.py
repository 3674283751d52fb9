"""Optimizers and learning-rate schedules from `config.optim`.

Every optimizer is optax's, built as one chain: clipping, the optimizer's own direction (`optim.name`: AdamW's
moments, Muon's orthogonalised momentum, Adafactor's factored second moments, Lion's sign, SGD's momentum),
decoupled weight decay, then the learning rate. `optim.groups` sets the weight decay and a learning-rate factor by
parameter path; `optim.moments_dtype` stores the optimizer's moments in bfloat16; `optim.offload` keeps them in
host memory. The default (AdamW, f32 moments, no groups) is exactly `optax.chain(clip_by_global_norm,
optax.adamw)`, so its checkpoints keep their layout.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group
from jaxtrain.models.config import GRAD_REDUCE_DTYPES

SCHEDULES = ("cosine", "linear", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon", "adafactor", "lion", "sgd")
MOMENTS_DTYPES = ("float32", "bfloat16")
MUON_NS_DTYPES = ("auto", "float32", "bfloat16")
# The config's `optim` group: `name` with linear warmup, then `schedule` down to lr * min_lr_ratio (wsd decays over
# the last `decay_fraction`); no weight decay on norm scales and biases; global-norm clipping at `clip_norm` (0 =
# off). b1, b2: Adam's and Lion's betas (and those of the AdamW that Muon runs on the non-matrix weights); eps:
# Adam's. momentum: SGD's (Nesterov) and Muon's. groups: see `parse_groups`. offload: the optimizer state lives in
# pinned host memory and visits the device for the update (jaxtrain.trainer). grad_reduce_dtype: the dtype the
# weight gradients are reduced over the batch axes in (models.layers.weight_grad_in); grad_reduce_error_feedback:
# each data-parallel replica carries its rounding error into its next step's sum (jaxtrain.step). muon_ns_dtype:
# the dtype of Muon's Newton-Schulz iterations; auto = bfloat16 where the model computes in 16 bits (as Jordan's
# reference runs it: a faster step, docs/optimizers.md), else float32.
CONFIG = dict(name="adamw", lr=3e-3, warmup_steps=15, schedule="cosine", min_lr_ratio=0.1, decay_fraction=0.2,
              weight_decay=0.1, clip_norm=1.0, b1=0.9, b2=0.95, eps=1e-8, momentum=0.95, groups="",
              moments_dtype="float32", offload=False, grad_reduce_dtype="float32", grad_reduce_error_feedback=False,
              muon_ns_dtype="auto")
# Muon's update scaled to AdamW's RMS (0.2 * sqrt(max(fan_in, fan_out)), Liu et al. 2025), so that one lr and one
# weight decay suit both the matrices and the AdamW-trained rest.
MUON_RMS = 0.2
GROUP_KEYS = {"lr": "a factor on the learning rate", "wd": "the weight decay"}


@dataclasses.dataclass(frozen=True)
class GroupRule:
    """Parameters whose path (e.g. "blocks/attn/wq") `pattern` matches (re.search) get these settings."""
    pattern: str
    lr: float | None = None  # factor on the schedule's learning rate
    wd: float | None = None  # weight decay, replacing optim.weight_decay (0: none)


def parse_groups(text: str) -> list[GroupRule]:
    """`optim.groups`: rules separated by ';', each `PATTERN: key=value, ...` with keys lr (a factor on the learning
    rate) and wd (the weight decay), e.g. "embed|unembed: lr=0.1; attn/w[qk]: wd=0". A parameter takes the first
    rule whose regex matches its path (jax key names joined by '/'); the rest keep optim.weight_decay (none on
    norm scales and biases) and the plain learning rate. ConfigError naming optim.groups for a bad rule."""
    rules = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        pattern, sep, settings = part.rpartition(":")
        if not sep or not pattern.strip():
            raise ConfigError("optim.groups", f"{part!r} is not 'PATTERN: key=value, ...'")
        try:
            re.compile(pattern.strip())
        except re.error as e:
            raise ConfigError("optim.groups", f"{pattern.strip()!r} is not a regular expression ({e})") from None
        values = {}
        for item in filter(None, (i.strip() for i in settings.split(","))):
            key, eq, value = (x.strip() for x in item.partition("="))
            if not eq or key not in GROUP_KEYS:
                raise ConfigError("optim.groups", f"{item!r} in {part!r}: set one of "
                                  f"{', '.join(f'{k} ({v})' for k, v in GROUP_KEYS.items())}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ConfigError("optim.groups", f"{key}={value!r} in {part!r} is not a number") from None
            if not values[key] >= 0 or values[key] == float("inf"):
                raise ConfigError("optim.groups", f"{key}={value} in {part!r} must be a finite number >= 0")
        if not values:
            raise ConfigError("optim.groups", f"{part!r} sets nothing (keys: {', '.join(GROUP_KEYS)})")
        rules.append(GroupRule(pattern.strip(), **values))
    return rules


def param_path(path) -> str:
    """A parameter's tree path as optim.groups matches it: "blocks/attn/wq"."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_groups(text: str, paths) -> None:
    """ConfigError naming optim.groups when a rule matches none of the model's parameter `paths` (a typo would
    otherwise change nothing, silently)."""
    for rule in parse_groups(text):
        if not any(re.search(rule.pattern, p) for p in paths):
            raise ConfigError("optim.groups", f"{rule.pattern!r} matches no parameter; the paths are "
                              f"{', '.join(sorted(paths))}")


def check_config(o, *, total_steps: int) -> None:
    """ConfigError naming the first bad field of the `optim` group."""
    g = Group(o, "optim")
    g.choice("name", OPTIMIZERS, what="optimizer")
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
    g.number("momentum", lo=0, hi=1)
    g.choice("moments_dtype", MOMENTS_DTYPES, what="dtype")
    g.choice("muon_ns_dtype", MUON_NS_DTYPES, what="dtype")
    g.choice("grad_reduce_dtype", GRAD_REDUCE_DTYPES, what="dtype")
    if o.grad_reduce_error_feedback and o.grad_reduce_dtype == "float32":
        raise ConfigError("optim.grad_reduce_error_feedback", "feeds back the rounding of a narrower reduction: "
                          "set optim.grad_reduce_dtype=bfloat16 too")
    parse_groups(g.string("groups"))


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


def _decays(path) -> bool:
    """Whether optim.weight_decay applies to the parameter at `path`: every weight but norm scales and biases."""
    names = [str(getattr(k, "key", k)) for k in path]
    return not any("norm" in n or "bias" in n for n in names)


def decay_mask(params):
    """True where weight decay applies: every weight except norm scales and biases."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _decays(path), params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm (the same empty state, so checkpoints are unchanged) that takes the norm the step
    already computed (`update(..., global_norm=n)`) and clips by multiplying with min(1, max_norm / n).

    optax's own form, select(n < max_norm, g, g / n * max_norm), wrote the clipped gradients out before Adam
    read them and computed the norm a second time; a plain scale fuses into Adam's moment updates: one pass over
    the gradients less (docs/performance.md), which matters where the optimizer is memory-bound (GPU).
    Without `global_norm` it computes the norm itself.
    """
    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        scale = jnp.minimum(1.0, max_norm / norm)  # norm 0 -> inf -> 1: unclipped
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def _is_names(x) -> bool:
    return x is None or isinstance(x, jax.sharding.PartitionSpec)


def muon_dims(param_names) -> dict:
    """{parameter path: contrib.MuonDimensionNumbers} for the layers' weight matrices, which Muon orthogonalises
    (per layer and expert: those axes are its batch axes); every other parameter (embeddings, the output head,
    norms, biases, the MoE router) is absent and trains with AdamW. `param_names`: the params' logical axis names.
    A matrix whose input is d_model ("embed" first) maps embed to the rest; the others (wo, w_down) map the rest to
    embed."""
    dims = {}
    for path, names in jax.tree_util.tree_leaves_with_path(param_names, is_leaf=_is_names):
        p, names = param_path(path), tuple(names or ())
        free = [i for i, n in enumerate(names) if n not in ("layers", "experts")]
        if not p.startswith(("blocks/", "dense_blocks/")) or "router" in p or "embed" not in names or len(free) < 2:
            continue
        e = names.index("embed")
        rest = tuple(i for i in free if i != e)
        dims[p] = (contrib.MuonDimensionNumbers(reduction_axis=(e,), output_axis=rest) if e == free[0] else
                   contrib.MuonDimensionNumbers(reduction_axis=rest, output_axis=(e,)))
    return dims


def _muon(o, param_names, ns_dtype) -> optax.GradientTransformation:
    """Muon on the layers' matrices (`muon_dims`), Adam on the rest: both directions only (decay and lr follow).
    Newton-Schulz runs in `ns_dtype`; the momentum stays float32 and the state's layout is the same either way."""
    if param_names is None:
        raise ValueError("optim.name=muon needs the params' logical names (make_optimizer's param_names)")
    dims = muon_dims(param_names)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731

    def dims_of(updates):  # the Muon branch sees the other parameters as MaskedNode
        return jax.tree_util.tree_map_with_path(lambda path, u: u if masked(u) else dims[param_path(path)],
                                                updates, is_leaf=masked)

    labels = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "muon" if param_path(path) in dims else "adam", params)

    low = jnp.dtype(ns_dtype) != jnp.float32
    # In 16 bits optax's own muon keeps the momentum (its iterations skipped: ns_steps=0 only normalises), and a
    # second one with no memory (beta 0, no Nesterov: its momentum is its input) orthogonalises that in ns_dtype.
    orthogonalise = contrib.scale_by_muon(beta=0.0, nesterov=False, weight_dimension_numbers=dims_of)

    def rms_matched(updates, state, params=None):  # MUON_RMS * sqrt(max(fan_in, fan_out)), as optax's muon's
        if low:
            wide = updates
            updates = jax.tree.map(lambda u: u.astype(ns_dtype), updates)
            updates = orthogonalise.update(updates, orthogonalise.init(updates))[0]
            updates = jax.tree.map(lambda u, w: u.astype(w.dtype), updates, wide)

        def scaled(path, u):
            if masked(u):
                return u
            d = dims[param_path(path)]
            fans = (math.prod(u.shape[i] for i in d.reduction_axis), math.prod(u.shape[i] for i in d.output_axis))
            return u * jnp.asarray(MUON_RMS * math.sqrt(max(fans)), u.dtype)
        return jax.tree_util.tree_map_with_path(scaled, updates, is_leaf=masked), state

    skip = {"ns_steps": 0} if low else {}
    momentum = contrib.scale_by_muon(beta=o.momentum, weight_dimension_numbers=dims_of, **skip)
    muon = optax.chain(momentum,
                       optax.GradientTransformation(optax.init_empty_state, rms_matched))
    return optax.partition({"muon": muon, "adam": optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)}, labels)


def _direction(o, param_names, compute_dtype) -> optax.GradientTransformation:
    """The optimizer's update direction, before weight decay and the learning rate."""
    if o.name == "adamw":
        return optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)
    if o.name == "lion":
        return optax.scale_by_lion(b1=o.b1, b2=o.b2)
    if o.name == "sgd":
        return optax.trace(decay=o.momentum, nesterov=True)
    if o.name == "adafactor":  # factored second moments, updates clipped to RMS 1; no parameter-scale factor
        return optax.chain(optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0))
    if o.name == "muon":
        ns = o.muon_ns_dtype
        if ns == "auto":
            ns = "bfloat16" if jnp.dtype(compute_dtype).itemsize == 2 else "float32"
        return _muon(o, param_names, ns)
    raise ValueError(f"optim.name: unknown optimizer {o.name!r}")


def stored_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`inner` with its per-parameter float state (moments) stored in `dtype` and computed in float32: bf16
    moments halve the optimizer state. Counters and other non-parameter state are left alone."""
    def cast(state, to):
        return optax.tree_map_params(inner, lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                     state)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def _by_path(fn: Callable) -> optax.GradientTransformation:
    """A stateless transform: update <- fn(path string, update, param) for every parameter."""
    def update(updates, state, params=None):
        return jax.tree_util.tree_map_with_path(lambda path, u, w: fn(param_path(path), u, w), updates, params), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _decay_and_lr(o, lr_schedule) -> list:
    """Decoupled weight decay, then the learning rate: optax.adamw's tail, or per optim.groups rule."""
    rules = parse_groups(o.groups)
    if not rules:
        return [optax.add_decayed_weights(o.weight_decay, decay_mask), optax.scale_by_learning_rate(lr_schedule)]

    def rule(path: str):
        return next((r for r in rules if re.search(r.pattern, path)), GroupRule(""))

    def decay(path, u, w):
        r = rule(path)
        wd = r.wd if r.wd is not None else o.weight_decay if _decays(path.split("/")) else 0.0
        return u + wd * w if wd else u

    def scale(path, u, _):
        factor = rule(path).lr
        return u if factor is None or factor == 1 else u * jnp.asarray(factor, u.dtype)

    return [_by_path(decay), _by_path(scale), optax.scale_by_learning_rate(lr_schedule)]


def make_optimizer(optim_cfg, total_steps: int, param_names=None,
                   compute_dtype="float32") -> optax.GradientTransformationExtraArgs:
    """Clipping (optional), `optim.name`'s direction (its moments in optim.moments_dtype), weight decay and the
    learning rate. `update` takes `global_norm=` (the gradients' global norm, when the caller has it) for the clip.
    `param_names`: the params' logical axis names (a tree of PartitionSpecs), which Muon needs; `compute_dtype`:
    the model's, which `optim.muon_ns_dtype=auto` follows."""
    o = optim_cfg
    parts = []
    if o.clip_norm > 0:
        parts.append(clip_by_global_norm(o.clip_norm))
    direction = _direction(o, param_names, compute_dtype)
    if o.moments_dtype != "float32":
        direction = stored_in(direction, jnp.dtype(o.moments_dtype))
    # Nested as optax.adamw's own chain is, so the default's state keeps the layout of older checkpoints.
    return optax.chain(*parts, optax.chain(direction, *_decay_and_lr(o, schedule(o, total_steps))))
