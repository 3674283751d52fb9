"""LoRA: low-rank adapters beside frozen projections (Hu et al. 2021, in PEFT's layout).

A target projection W [in..., out...] (`model.lora_targets`) gets A [in..., r] and B [r, out...]; its output
gains (lora_alpha / r) * (dropout(x) A) B. B starts at zero, so step 0 is the base model, and A as PEFT's
(uniform in +-1/sqrt(fan in)). A mixture of experts' experts get one pair per expert (a leading "experts" axis)
on their gate and up projections together (one A, B [r, 2, f]: Hugging Face's fused gate_up_proj, as PEFT
adapts it) and on down. Each adapter names W's logical axes on its W side and leaves the rank unsharded, so it
shards like the weight it wraps. The adapters live in the params beside the weights, under W's name plus
`_lora_a` / `_lora_b`: `split` separates them, and the step differentiates, clips and updates the adapters
only; the base weights get no gradient and no optimizer state. `merged` folds them into the weights. Dropout
(PEFT's lora_dropout, on A's input) draws from per-row keys (`dropout_keys`), in training steps only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.config import ModelConfig, lora_target_names

SUFFIXES = ("_lora_a", "_lora_b")
# An adapter over several weights joined along B's first output axis (the experts' gate and up, as HF fuses them).
JOINED = {"w_gate_up": ("w_gate", "w_up")}
# Each adapted weight's index in the dropout keys, so that projections of one input draw different masks. Index 7
# (None) is the next layer's keys' (_NEXT_LAYER), fixed when latent attention's streams were added after it.
_DROPOUT_STREAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", None, "wq_a", "wq_b", "wkv_a", "wkv_b")
_NEXT_LAYER = 7


def targets(cfg: ModelConfig) -> frozenset[str]:
    """The model.lora_targets names (q, ..., experts) that carry adapters; empty without LoRA."""
    return lora_target_names(cfg.lora_targets, cfg.n_experts, bool(cfg.kv_lora_rank)) if cfg.lora_rank else frozenset()


def add(module: nnx.Module, name: str, target: str, w_shape: tuple, w_names: tuple, contract: int,
        cfg: ModelConfig, rngs: nnx.Rngs, lead: int = 0) -> None:
    """Gives `module` the adapters `name` of a weight of shape `w_shape` and logical names `w_names` (its first
    `lead` dims index separate matrices, e.g. experts; the next `contract` are the input) when `target` is one of
    the run's targets."""
    if target not in targets(cfg):
        return
    r, dtype = cfg.lora_rank, jnp.dtype(cfg.param_dtype)
    ins, outs = slice(lead, lead + contract), slice(lead + contract, None)
    bound = 1.0 / math.sqrt(math.prod(w_shape[ins]))
    a = jax.random.uniform(rngs.params(), (*w_shape[:lead], *w_shape[ins], r), dtype, -bound, bound)
    setattr(module, name + SUFFIXES[0], nnx.Param(a, out_sharding=(*w_names[:lead], *w_names[ins], None),
                                                  eager_sharding=False))
    b = jnp.zeros((*w_shape[:lead], r, *w_shape[outs]), dtype)
    setattr(module, name + SUFFIXES[1], nnx.Param(b, out_sharding=(*w_names[:lead], None, *w_names[outs]),
                                                  eager_sharding=False))


def factors(module: nnx.Module, name: str, dtype):
    """(A, B times alpha / r), both in `dtype`, of the adapters `name` of `module`; None where it has none."""
    if not hasattr(module, name + SUFFIXES[0]):
        return None
    a, b = (getattr(module, name + s)[...].astype(dtype) for s in SUFFIXES)
    return a, b * jnp.asarray(module.cfg.lora_alpha / module.cfg.lora_rank, dtype)


def dropout(x, keys, name: str, rate: float):
    """x [B, ...] with each element zeroed with probability `rate` and the rest scaled by 1 / (1 - rate), from
    row b's key keys[b] (uint32 key data) and the weight `name`; x itself where keys is None or rate is 0."""
    if keys is None or not rate:
        return x
    stream = _DROPOUT_STREAMS.index(name)
    keep = jax.vmap(lambda k: jax.random.bernoulli(_fold(k, stream), 1.0 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def delta(module: nnx.Module, name: str, x, contract: int, project, keys=None):
    """(alpha / r) * (dropout(x) A) B for the weight `name` of `module`, in x's dtype; None where it has no
    adapters. `project` is layers.project (passed in: the layers import this module); `keys`: `dropout`'s."""
    if (ab := factors(module, name, x.dtype)) is None:
        return None
    a, b = ab
    x = dropout(x, keys, name, module.cfg.lora_dropout)
    low = project(x, a, contract=contract)  # [..., r]: named like every weight matmul, so remat keeps it
    # Not named: remat recomputes this r-deep product rather than keep a second output as wide as the weight's,
    # which would leave LoRA needing more memory than full fine-tuning (docs/fine-tuning.md, Memory).
    return jnp.matmul(low.reshape(-1, low.shape[-1]), b.reshape(b.shape[0], -1)).reshape(*low.shape[:-1], *b.shape[1:])


def next_keys(keys):
    """The per-row dropout keys of the next layer (each layer draws from its own); None stays None."""
    if keys is None:
        return None
    return jax.vmap(lambda k: jax.random.key_data(_fold(k, _NEXT_LAYER)))(keys)


def _fold(key_data, n: int):
    return jax.random.fold_in(jax.random.wrap_key_data(key_data), n)


def is_adapter(key: str) -> bool:
    return key.endswith(SUFFIXES)


def split(params: dict) -> tuple[dict, dict]:
    """A params tree (nested dicts) -> (the adapters, the rest), each keeping the nesting of its leaves."""
    adapters, rest = {}, {}
    for key, value in params.items():
        if isinstance(value, dict):
            a, r = split(value)
            if a:
                adapters[key] = a
            if r:
                rest[key] = r
        else:
            (adapters if is_adapter(str(key)) else rest)[key] = value
    return adapters, rest


def join(adapters: dict, rest: dict) -> dict:
    """The inverse of `split`."""
    out = dict(rest)
    for key, value in adapters.items():
        out[key] = join(value, out.get(key, {})) if isinstance(value, dict) else value
    return out


def merged(params: dict, cfg: ModelConfig) -> dict:
    """The params without adapters, each target weight W replaced by W + (alpha / r) A B (in f32, then W's
    dtype): the model the adapted one computes, as a plain one."""
    adapters, base = split(params)
    scale = cfg.lora_alpha / max(cfg.lora_rank, 1)

    def fold(base_node: dict, adapter_node: dict) -> dict:
        out = dict(base_node)
        for key, value in adapter_node.items():
            if isinstance(value, dict):
                out[key] = fold(base_node[key], value)
            elif key.endswith(SUFFIXES[0]):
                name = key[: -len(SUFFIXES[0])]
                a = jnp.asarray(value, jnp.float32)
                b = jnp.asarray(adapter_node[name + SUFFIXES[1]], jnp.float32)
                weights = JOINED.get(name, (name,))
                w0 = jnp.asarray(base_node[weights[0]])
                # Leading dims of all three: the stacked layers (and experts).
                shared = a.ndim + b.ndim - 2 - w0.ndim - (len(weights) > 1)
                lead = "abcd"[:shared]
                ins, outs = "ijkl"[:a.ndim - 1 - shared], "stuv"[:b.ndim - 1 - shared]
                d = jnp.einsum(f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}", a, b)
                parts = [d] if len(weights) == 1 else [jnp.take(d, i, axis=shared + len(ins))
                                                      for i in range(len(weights))]
                for weight_name, part in zip(weights, parts):
                    w = jnp.asarray(base_node[weight_name])
                    out[weight_name] = (w.astype(jnp.float32) + scale * part).astype(w.dtype)
        return out

    return fold(base, adapters)
