"""Building blocks the model families share: weight matmuls, RMSNorm and rotary embeddings.

Every parameter names its dimensions with logical axes (`out_sharding`), which `jaxtrain.parallel.mesh`
turns into shardings; `weight` reads one in the compute dtype with the FSDP gather made explicit.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import cpu_bf16, lora, quant as quant_lib
from jaxtrain.models.config import WEIGHT_MATMUL, ModelConfig
from jaxtrain.parallel.mesh import constrain, split_ways


def project(x, w, contract: int = 1, preferred_element_type=None, quant: str = "none", grad_dtype=None):
    """x [..., K1..Kc] @ w [K1..Kc, N...] -> [..., N...] as one 2-D matmul. Same as the einsum, but XLA:CPU runs a
    dot with several free dimensions (e.g. "btd,df->btf") markedly slower than the 2-D one (docs/performance.md);
    reshapes are free. Not when the sequence is split over devices: merging batch and sequence into one dimension
    made XLA gather every projection's input whole along the sequence (each device then computed every position).
    `quant`: ModelConfig.quant, the matmul in fp8 or int8 (jaxtrain.models.quant). `grad_dtype`
    (ModelConfig.grad_reduce_dtype): w's gradient comes out of its matmul in this dtype where it is narrower than
    the matmul's own, hence is reduced over the batch axes in it (`weight_grad_in`); not for a quantized matmul,
    whose gradients are qwix's."""
    natural = jnp.dtype(preferred_element_type or jnp.result_type(x, w))
    if quant == "none" and grad_dtype is not None and jnp.dtype(grad_dtype).itemsize < natural.itemsize:
        y = weight_grad_in(functools.partial(project, contract=contract, preferred_element_type=preferred_element_type),
                           jnp.dtype(grad_dtype), x, w)
        return checkpoint_name(y, WEIGHT_MATMUL)  # remat policies see the output outside the custom gradient too
    if split_ways("seq") > 1:
        dims = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
        if quant != "none":
            y = quant_lib.dot_general(x, w, dims, quant)
        else:
            y = jax.lax.dot_general(x, w, dims, preferred_element_type=preferred_element_type)
    else:
        k = math.prod(w.shape[:contract])
        if quant != "none":
            y = quant_lib.dot_general(x.reshape(-1, k), w.reshape(k, -1), (((1,), (0,)), ((), ())), quant)
        elif preferred_element_type is None and cpu_bf16.applies(x, w):
            y = cpu_bf16.matmul(x.reshape(-1, k), w.reshape(k, -1))
        else:
            y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=preferred_element_type)
        y = y.reshape(*x.shape[:x.ndim - contract], *w.shape[contract:])
    return checkpoint_name(y, WEIGHT_MATMUL)


def adapted(module, name: str, x, y, contract: int = 1, keys=None):
    """y, the projection of x by module's weight `name`, plus its LoRA adapters' term where it has them (x
    dropped out by `keys`, lora.dropout's per-row keys, in training)."""
    d = lora.delta(module, name, x, contract, project, keys)
    return y if d is None else y + d.astype(y.dtype)


def project_fused(x, weights, name: str, act_name: str, quant: str = "none", grad_dtype=None):
    """[project(x, w) for w in weights], x [B, T, d], as one matmul where the mesh splits `name` (each w is
    [d, N_i, ...], its N_i over the axes `name` maps to; `act_name` is the outputs' twin) or the sequence. Each w is
    viewed as [d, T, N_i/T * ...] (T = those axes' size: each device's block of N_i stays whole) and the views are
    joined along the last dimension, which no device has to move. Under tensor parallelism the input's gradient is
    then one matmul and one all-reduce, not one per weight (Megatron's fused QKV and gate/up projections); under
    sequence parallelism XLA no longer recomputes the input. Elsewhere joining saves no collective and costs time:
    the backward copies the cotangents together before its matmul, in every layer (docs/performance.md, GPU)."""
    ways = split_ways(name)
    if (ways == 1 and split_ways("seq") == 1) or any(w.shape[1] % ways for w in weights):
        return [project(x, w, quant=quant, grad_dtype=grad_dtype) for w in weights]
    return project_joined(x, weights, ways, name, act_name, quant, grad_dtype)


def project_joined(x, weights, ways: int, name: str, act_name: str, quant: str = "none", grad_dtype=None):
    """project_fused's joined matmul, each weight's N_i in `ways` blocks."""
    blocks = [w.reshape(w.shape[0], ways, -1) for w in weights]
    joined = constrain(jnp.concatenate(blocks, axis=-1), (None, name, None))
    y = constrain(project(x, joined, quant=quant, grad_dtype=grad_dtype), ("batch", "seq", act_name, None))
    parts = split_last(y, tuple(int(c) for c in np.cumsum([b.shape[-1] for b in blocks])[:-1]))
    return [part.reshape(*x.shape[:-1], *w.shape[1:]) for part, w in zip(parts, weights)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def weight_grad_in(f, dtype, x, w):
    """f(x, w), a matmul contracting x's last dims with w's first, whose gradient for w is one matmul with `dtype`
    results. XLA's partitioner reduces a weight's gradient over the batch axes (reduce-scatter over fsdp,
    all-reduce over data) right at that matmul, in its output dtype; a cast after it would not move the
    reduction. So bfloat16 under f32 compute halves the gradient traffic."""
    return f(x, w)


def _weight_grad_in_fwd(f, dtype, x, w):
    return f(x, w), (x, w)


def _weight_grad_in_bwd(f, dtype, res, g):
    x, w = res
    dx = jax.vjp(lambda x_: f(x_, w), x)[1](g)[0]
    lead = x.ndim - (x.ndim + w.ndim - g.ndim) // 2  # the dims of x (and g) that are not contracted with w
    dims = ((tuple(range(lead)), tuple(range(lead))), ((), ()))
    return dx, jax.lax.dot_general(x, g, dims, preferred_element_type=dtype).astype(w.dtype)


weight_grad_in.defvjp(_weight_grad_in_fwd, _weight_grad_in_bwd)


def sum_in(x, axis: int, dtype):
    """x summed over `axis` in `dtype` (then back in x's dtype): over a sharded axis, XLA's reduction runs in
    `dtype`. jnp.sum would add 16-bit floats in f32."""
    zero = np.zeros((), jnp.dtype(dtype))
    return jax.lax.reduce(x.astype(dtype), zero, jax.lax.add, (axis,)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_last(y, cuts: tuple[int, ...]):
    """jnp.split(y, cuts, axis=-1), whose backward joins 16-bit cotangents as their raw bits. Joined as floats, XLA
    moved their narrowing converts below the concatenation: it and the fusions feeding it (RoPE's and SwiGLU's
    backward) wrote f32, twice the bytes (docs/performance.md). Same values either way."""
    return jnp.split(y, cuts, axis=-1)


def _split_last_fwd(y, cuts):
    return split_last(y, cuts), None


def _split_last_bwd(cuts, _, grads):
    dtype = grads[0].dtype
    if dtype.itemsize != 2:
        return (jnp.concatenate(grads, axis=-1),)
    bits = jnp.concatenate([jax.lax.bitcast_convert_type(g, jnp.uint16) for g in grads], axis=-1)
    return (jax.lax.bitcast_convert_type(bits, dtype),)


split_last.defvjp(_split_last_fwd, _split_last_bwd)


def activation(name: str):
    """The MLP gate's nonlinearity by `ModelConfig.mlp_activation`: silu (SwiGLU) or gelu_tanh (GeGLU)."""
    return {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}[name]


def weight(param: nnx.Param, dtype):
    """A layer's weight in `dtype`, gathered whole over the axes FSDP splits it on (its "embed" dimension) and still
    split over the others (tensor, expert): the FSDP schedule, made explicit. Left to XLA, a projection whose input
    is split along the sequence could contract over the split d_model instead, regathering the activations along
    the sequence every layer. The gradient goes straight back to the parameter's own sharding, in its dtype, so
    the reduction over every batch axis is one reduce-scatter (a plain constraint's transpose would all-reduce
    the whole gradient over the sequence or expert axis first)."""
    value = param[...]
    names = tuple(param.get_metadata()["out_sharding"][-value.ndim:])  # a scanned layer's lead with "layers"
    return _gathered(value, jnp.dtype(dtype), names, value.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gathered(value, dtype, names, value_dtype):
    return constrain(value.astype(dtype), tuple(None if n == "embed" else n for n in names))


def _gathered_fwd(value, dtype, names, value_dtype):
    return _gathered(value, dtype, names, value_dtype), None


def _gathered_bwd(dtype, names, value_dtype, _, grad):
    return (constrain(grad.astype(value_dtype), names),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def param(rngs: nnx.Rngs, shape, names, cfg: ModelConfig, std: float | None = None, ones: bool = False):
    dtype = jnp.dtype(cfg.param_dtype)
    value = (jnp.ones(shape, dtype) if ones else
             jax.random.normal(rngs.params(), shape, dtype) * (cfg.init_std if std is None else std))
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def ahead(x, k: int):
    """x [B, T] shifted k positions to the left along T, zeros past the end: entry i holds x[i + k]."""
    return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis (`dim`, default d_model; `eps`, default cfg.norm_eps). With `cfg.norm_offset` the
    scale is 1 + w, w from 0 (Gemma's form, whose checkpoints store w)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dim: int | None = None, names=("norm",),
                 eps: float | None = None):
        dim = cfg.d_model if dim is None else dim
        self.scale = nnx.Param(jnp.full((dim,), 0.0 if cfg.norm_offset else 1.0, jnp.dtype(cfg.param_dtype)),
                               out_sharding=names, eager_sharding=False)
        self.eps, self.offset = cfg.norm_eps if eps is None else eps, float(cfg.norm_offset)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (scale + self.offset if self.offset else scale)).astype(x.dtype)


def _frequencies(head_dim: int, theta: float) -> np.ndarray:
    """RoPE's angle per unit of position for each of the head_dim // 2 rotated pairs, f32."""
    half = head_dim // 2
    return np.float32(theta) ** (-np.arange(half, dtype=np.float32) / half)


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> tuple[np.ndarray, float]:
    """(angle per position for each rotated pair [head_dim // 2] f32, the factor on cos and sin) of `cfg`'s RoPE;
    `local`: a sliding-window layer's (rope_local_theta, unscaled, where set). The scalings follow the formulas Hugging Face
    names `linear`, `llama3` and `yarn`, so imported checkpoints see the angles they were trained with."""
    hd = cfg.head_dim
    if local and cfg.rope_local_theta:
        return _frequencies(hd, cfg.rope_local_theta), 1.0
    freqs = _frequencies(hd, cfg.rope_theta)
    kind, factor = cfg.rope_scaling, cfg.rope_factor
    if kind == "linear":
        return (freqs / np.float32(factor)).astype(np.float32), 1.0
    if kind == "llama3":
        wavelen = 2 * np.pi / freqs.astype(np.float64)
        low, high = cfg.rope_original_max_len / cfg.rope_low_freq_factor, cfg.rope_original_max_len / cfg.rope_high_freq_factor
        smooth = (cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        scaled = np.where(wavelen > low, freqs / factor, np.where(wavelen < high, freqs,
                                                                  (1 - smooth) * freqs / factor + smooth * freqs))
        return scaled.astype(np.float32), 1.0
    if kind == "yarn":
        def correction_dim(rotations):
            return hd * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        lo = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
        hi = min(math.ceil(correction_dim(cfg.rope_beta_slow)), hd - 1)
        ramp = np.clip((np.arange(hd // 2, dtype=np.float32) - lo) / ((hi - lo) or 0.001), 0, 1)
        keep = 1 - ramp  # 1: the high frequencies, extrapolated as they are; 0: interpolated (divided by factor)
        scaled = freqs / np.float32(factor) * (1 - keep) + freqs * keep
        attention = cfg.rope_attention_factor or yarn_mscale(factor)
        if not cfg.rope_attention_factor and cfg.rope_mscale and cfg.rope_mscale_all_dim:  # DeepSeek's form
            attention = yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
        return scaled.astype(np.float32), float(attention)
    return freqs, 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the positions are not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary(positions, rope_freqs: tuple[np.ndarray, float]):
    """RoPE's (cos, sin) at `positions` [B, T]: f32 [B, T, 1, head_dim // 2] each. rope_freqs: `rope_frequencies`."""
    freqs, factor = rope_freqs
    angle = positions.astype(jnp.float32)[:, :, None, None] * freqs
    return _scaled(jnp.cos(angle), factor), _scaled(jnp.sin(angle), factor)


def _scaled(x, factor: float):
    return x if factor == 1.0 else x * np.float32(factor)


def rotary_lookup(positions, rope_freqs: tuple[np.ndarray, float]):
    """`rotary` for positions that index their row, 0 <= p < T (the data pipeline restarts them at each document),
    read from a table of positions 0..T-1 built at trace time; a position outside it reads NaN. XLA fuses a sine
    into every op that reads it, so even computed once per step the sines were recomputed in every fusion that
    applies or differentiates RoPE (docs/performance.md); a lookup fuses as a load."""
    freqs, factor = rope_freqs
    t = positions.shape[1]
    angle = np.arange(t, dtype=np.float32)[:, None] * freqs
    index = jnp.where(positions < 0, t, positions)  # take would wrap a negative index around
    return tuple(jnp.take(table, index, axis=0, mode="fill", fill_value=np.nan)[:, :, None, :]
                 for table in (_scaled(np.cos(angle), factor), _scaled(np.sin(angle), factor)))


def rope(x, rotary_tables):
    """Rotary embedding, rotate-half form. x: [B, T, N, D]; rotary_tables: (cos, sin) from `rotary` or
    `rotary_lookup`."""
    cos, sin = rotary_tables
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
