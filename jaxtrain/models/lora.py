"""LoRA: low-rank adapters beside frozen projections (Hu et al. 2021, in PEFT's layout).

A target projection W [in..., out...] (`model.lora_targets`: q, k, v, o, gate, up, down) gets A [in..., r] and
B [r, out...]; its output gains (lora_alpha / r) * (x A) B. B starts at zero, so step 0 is the base model, and A
as PEFT's (uniform in +-1/sqrt(fan in)). Each adapter names W's logical axes on its W side and leaves the rank
unsharded, so it shards like the weight it wraps. The adapters live in the params beside the weights, under
W's name plus `_lora_a` / `_lora_b`: `split` separates them, and the step differentiates, clips and updates the
adapters only; the base weights get no gradient and no optimizer state. `merged` folds them into the weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.config import LORA_TARGETS, ModelConfig

SUFFIXES = ("_lora_a", "_lora_b")


def targets(cfg: ModelConfig) -> set[str]:
    """The weight names (wq, ..., w_down) that carry adapters; empty without LoRA."""
    if not cfg.lora_rank:
        return set()
    return {LORA_TARGETS[t.strip()] for t in cfg.lora_targets.split(",") if t.strip()}


def add(module: nnx.Module, name: str, w_shape: tuple, w_names: tuple, contract: int, cfg: ModelConfig,
        rngs: nnx.Rngs) -> None:
    """Gives `module` the adapters of its weight `name` (shape and logical names as the weight's; its first
    `contract` dims are the input) when `name` is a target."""
    if name not in targets(cfg):
        return
    r, dtype = cfg.lora_rank, jnp.dtype(cfg.param_dtype)
    bound = 1.0 / math.sqrt(math.prod(w_shape[:contract]))
    a = jax.random.uniform(rngs.params(), (*w_shape[:contract], r), dtype, -bound, bound)
    setattr(module, name + SUFFIXES[0], nnx.Param(a, out_sharding=(*w_names[:contract], None), eager_sharding=False))
    b = jnp.zeros((r, *w_shape[contract:]), dtype)
    setattr(module, name + SUFFIXES[1], nnx.Param(b, out_sharding=(None, *w_names[contract:]), eager_sharding=False))


def delta(module: nnx.Module, name: str, x, contract: int, cfg: ModelConfig, project):
    """(alpha / r) * (x A) B for the weight `name` of `module`, in x's dtype; None where it has no adapters.
    `project` is layers.project (passed in: the layers import this module)."""
    if not hasattr(module, name + SUFFIXES[0]):
        return None
    a, b = (getattr(module, name + s)[...].astype(x.dtype) for s in SUFFIXES)
    low = project(x, a, contract=contract)  # [..., r]: named like every weight matmul, so remat keeps it
    # Not named: remat recomputes this r-deep product rather than keep a second output as wide as the weight's
    # (kept, plan_1b's LoRA step needed 27.3 GiB of temporaries on 8 H100s; recomputed, 18.0 against full
    # fine-tuning's 21.1).
    up = jnp.matmul(low.reshape(-1, low.shape[-1]), b.reshape(b.shape[0], -1)).reshape(*low.shape[:-1], *b.shape[1:])
    return up * jnp.asarray(cfg.lora_alpha / cfg.lora_rank, x.dtype)


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
                w = jnp.asarray(base_node[name])
                shared = a.ndim + b.ndim - 2 - w.ndim  # leading dims of all three: the stacked layers
                lead = "abcd"[:shared]
                ins, outs = "ijkl"[:a.ndim - 1 - shared], "stuv"[:b.ndim - 1 - shared]
                d = jnp.einsum(f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}", a, b)
                out[name] = (w.astype(jnp.float32) + scale * d).astype(w.dtype)
        return out

    return fold(base, adapters)
