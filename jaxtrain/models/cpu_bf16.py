"""The matmul forms in which XLA:CPU runs bf16 at bf16 speed.

XLA:CPU (YNNPACK) runs a bf16 matmul at its bf16 speed (AVX512-BF16) only as a row-major lhs contracting its last
dim into an f32 result; any other form (a bf16 result, an lhs read transposed) is computed in f32 after converting
both operands (docs/performance.md, "CPU: what makes the step fast"). A transpose that feeds a dot directly is
folded into it as a transposed read, so operands that need another layout are copied first (`transposed_in_memory`).

Autodiff's backward of x @ w has both bad forms: its dw reads x transposed. So on CPU the bf16 projections take
`matmul`'s VJP: f32 accumulation cast back to bf16 in the forward, dx as g contracted with w's last dim (a supported
form), and dw from x transposed into memory first. Blocked attention (`jaxtrain.models.attention`) and the fused loss
(`jaxtrain.models.cross_entropy`) lay out their operands the same way.

`cast` is astype for a f32 -> bf16 cast that follows an exp in one fusion, where XLA:CPU's convert is slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.parallel import mesh as mesh_lib


def applies(*arrays) -> bool:
    """Whether these are bf16 operands of a matmul compiled by XLA:CPU (which needs the forms above)."""
    return all(a.dtype == jnp.bfloat16 for a in arrays) and mesh_lib.compile_platform() == "cpu"


def cast(a, dtype):
    """a.astype(dtype), bit for bit (its gradient too); f32 -> bf16 on CPU as integer ops. Fused after an exp (the
    fused loss's softmax gradient), XLA:CPU's own convert stalls the pass, and these integer ops do not
    (docs/performance.md); where no exp precedes the cast (RMSNorm, RoPE, matmul outputs, attention) they gain
    nothing."""
    if a.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16 and mesh_lib.compile_platform() == "cpu":
        return _round_to_bf16(a)
    return a.astype(dtype)


@jax.custom_vjp
def _round_to_bf16(a):
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    nearest_even = bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
    # A NaN becomes the quiet NaN of its sign, as XLA's convert makes it (rounding its payload could carry into the
    # sign or leave an infinity).
    bits = jnp.where(jnp.isnan(a), (bits & jnp.uint32(0x80000000)) | jnp.uint32(0x7FC00000), nearest_even)
    return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)


def _round_fwd(a):
    return _round_to_bf16(a), None


def _round_bwd(_, g):
    return (g.astype(jnp.float32),)  # astype's transpose


_round_to_bf16.defvjp(_round_fwd, _round_bwd)


def dot_f32(a, b, a_dim: int, b_dim: int):
    """a contracted with b over one dim each, accumulated and returned in f32."""
    return jax.lax.dot_general(a, b, (((a_dim,), (b_dim,)), ((), ())), preferred_element_type=jnp.float32)


def transposed_in_memory(a, perm=None):
    """a.transpose(perm) (default: all axes reversed, a.T) laid out in that order. A bare transpose would be folded
    into the next dot as a transposed read; the size-1 axis keeps it a copy."""
    perm = tuple(reversed(range(a.ndim))) if perm is None else tuple(perm)
    return a[..., None].transpose(*perm, a.ndim).reshape(tuple(a.shape[p] for p in perm))


@jax.custom_vjp
def matmul(x, w):
    """x [m, k] @ w [k, n] in bf16 with f32 accumulation, its backward in XLA:CPU's bf16 forms."""
    return dot_f32(x, w, 1, 0).astype(x.dtype)


def _matmul_fwd(x, w):
    return matmul(x, w), (x, w)


def _matmul_bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = dot_f32(g, w, 1, 1)
    dw = dot_f32(transposed_in_memory(x), g, 1, 0)
    return dx.astype(x.dtype), dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)
