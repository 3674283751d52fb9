"""One ring step of context-parallel attention on GPUs, as Pallas (Triton) flash kernels.

A block of queries attends to a block of keys under a mask made in each tile from the tokens' segment ids and
positions, so the zigzag layout, packed documents and sliding windows hold; a tile the mask empties is skipped.
`RingKernel` is the `kernel` jaxtrain.parallel.context's ring takes (model.attention_impl=pallas). Its forward
carries each query's softmax state (output unnormalised, running max, sum) on through the block, in place; its
backward takes the whole ring's log-sum-exp and delta (rowsum dO * O), so each step's probabilities are the final
ones (as ring-flash-attention does), and adds this step's dq, dk, dv to the ring's f32 accumulators in place.
cuDNN's fused attention returns its log-sum-exp, but its backward takes no outside one and a positional mask
needs a dense bias; hence kernels of our own. Pallas's interpreter checks them on CPU against the ring's XLA
blocks and the unsharded attention (tests/parallel/test_context.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxtrain.parallel.context import _MASKED, _mask  # the ring's: its masked logit, and its mask from positions

BLOCK = 64  # query and key tile, tokens; Triton's dot needs >= 16


def tile(t: int, block: int = BLOCK) -> int:
    """The tile for a block of t tokens: the largest power of two up to `block` that divides it."""
    size = block
    while size >= 16 and t % size:
        size //= 2
    if size < 16:  # config validation says so first, naming train.seq_len
        raise ValueError(f"a ring block of {t} tokens: the flash kernels' tiles need a multiple of 16")
    return size


def _any(mask):
    return jnp.max(jnp.max(mask.astype(jnp.int32), axis=1), axis=0) > 0


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _forward_kernel(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q_ref, k_ref, v_ref, o_in, m_in, l_in,
                    o_ref, m_ref, l_ref, *, scale: float, causal: bool, groups: int, bq: int, bk: int, tk: int):
    i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(i * bq, bq)
    q, seg_q, pos_q, window = q_ref[b, rows, h, :], seg_q_ref[b, rows], pos_q_ref[b, rows], window_ref[0]

    def body(j, carry):
        cols = pl.ds(j * bk, bk)
        mask = _mask(seg_q, pos_q, seg_k_ref[b, cols], pos_k_ref[b, cols], window, causal)

        def update(carry):
            o, m, l = carry
            s = jnp.where(mask, _dot(q, k_ref[b, cols, h // groups, :].T) * scale, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            fix = jnp.exp(m - m_new)
            v = v_ref[b, cols, h // groups, :]
            return o * fix[:, None] + _dot(p.astype(v.dtype), v), m_new, l * fix + p.sum(axis=1)

        return jax.lax.cond(_any(mask), update, lambda carry: carry, carry)

    state = (o_in[b, rows, h, :], m_in[b, h, rows], l_in[b, h, rows])
    o_ref[...], m_ref[...], l_ref[...] = jax.lax.fori_loop(0, tk // bk, body, state)


def _probabilities(q, k, lse, mask, scale: float):
    return jnp.where(mask, jnp.exp(_dot(q, k.T) * scale - lse[:, None]), 0.0)


def _dq_kernel(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q_ref, k_ref, v_ref, g_ref, lse_ref, delta_ref,
               dq_in, dq_ref, *, scale: float, causal: bool, groups: int, bq: int, bk: int, tk: int):
    i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(i * bq, bq)
    q, do, lse, delta = q_ref[b, rows, h, :], g_ref[b, rows, h, :], lse_ref[b, h, rows], delta_ref[b, h, rows]
    seg_q, pos_q, window = seg_q_ref[b, rows], pos_q_ref[b, rows], window_ref[0]

    def body(j, dq):
        cols = pl.ds(j * bk, bk)
        mask = _mask(seg_q, pos_q, seg_k_ref[b, cols], pos_k_ref[b, cols], window, causal)

        def grad(dq):
            k, v = k_ref[b, cols, h // groups, :], v_ref[b, cols, h // groups, :]
            p = _probabilities(q, k, lse, mask, scale)
            ds = p * (_dot(do, v.T) - delta[:, None]) * scale
            return dq + _dot(ds.astype(k.dtype), k)

        return jax.lax.cond(_any(mask), grad, lambda dq: dq, dq)

    dq_ref[...] = jax.lax.fori_loop(0, tk // bk, body, dq_in[b, rows, h, :])


def _dkv_kernel(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q_ref, k_ref, v_ref, g_ref, lse_ref,
                delta_ref, dk_in, dv_in, dk_ref, dv_ref, *, scale: float, causal: bool, groups: int, bq: int,
                bk: int, tq: int):
    j, b, kv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * bk, bk)
    k, v, seg_k, pos_k, window = k_ref[b, cols, kv, :], v_ref[b, cols, kv, :], seg_k_ref[b, cols], \
        pos_k_ref[b, cols], window_ref[0]
    tiles = tq // bq

    def body(n, carry):  # over (query head of this KV head's group, query tile)
        h, rows = kv * groups + jax.lax.div(n, tiles), pl.ds(jax.lax.rem(n, tiles) * bq, bq)  # n >= 0: no floor
        mask = _mask(seg_q_ref[b, rows], pos_q_ref[b, rows], seg_k, pos_k, window, causal)

        def grad(carry):
            dk, dv = carry
            q, do = q_ref[b, rows, h, :], g_ref[b, rows, h, :]
            p = _probabilities(q, k, lse_ref[b, h, rows], mask, scale)
            ds = p * (_dot(do, v.T) - delta_ref[b, h, rows][:, None]) * scale
            return dk + _dot(ds.T.astype(q.dtype), q), dv + _dot(p.T.astype(do.dtype), do)

        return jax.lax.cond(_any(mask), grad, lambda carry: carry, carry)

    dk_ref[...], dv_ref[...] = jax.lax.fori_loop(0, groups * tiles, body,
                                                 (dk_in[b, cols, kv, :], dv_in[b, cols, kv, :]))


@dataclasses.dataclass(frozen=True)
class RingKernel:
    """The ring's per-step kernels. q [b, tq, N, D], k, v [b, tk, KV, D] (N a multiple of KV), segment ids and
    positions [b, t] int32 for each side, window an int32 scalar (0: none). `interpret`: Pallas's interpreter, so
    they run on CPU (tests); `block`: the largest tile."""
    interpret: bool = False
    block: int = BLOCK

    def _call(self, kernel, grid, out_specs, name, args, carried, **params):
        """kernel over grid, its outputs the `carried` arrays (its last inputs) updated in place."""
        window, *rest = args
        args = (jnp.reshape(window, (1,)).astype(jnp.int32), *rest, *carried)
        return pl.pallas_call(
            functools.partial(kernel, **params), grid=grid, out_specs=out_specs,
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in carried],
            in_specs=[pl.no_block_spec] * len(args),  # whole arrays in global memory: the kernels load their tiles
            input_output_aliases={len(args) - len(carried) + i: i for i in range(len(carried))},
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=self.interpret, name=name,
        )(*args)

    def forward(self, q, k, v, seg_q, pos_q, seg_k, pos_k, window, scale: float, causal: bool, state):
        """`state` (o [b, tq, N, D], m [b, N, tq], l [b, N, tq], f32) carried on over this block: each query's
        running max of its visible logits (_MASKED where it has seen none), the sum of exp(logit - m) and the
        exp-weighted sum of values."""
        b, tq, heads, d = q.shape
        tk = k.shape[1]
        bq, bk = tile(tq, self.block), tile(tk, self.block)
        stats = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
        return tuple(self._call(
            _forward_kernel, (tq // bq, b, heads), [pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0)),
                                                    stats, stats], "ring_flash_forward",
            (window, seg_q, pos_q, seg_k, pos_k, q, k, v), state,
            scale=scale, causal=causal, groups=heads // k.shape[2], bq=bq, bk=bk, tk=tk))

    def backward(self, q, k, v, g, lse, delta, seg_q, pos_q, seg_k, pos_k, window, scale: float, causal: bool,
                 acc):
        """`acc` (dq, dk, dv, f32, as q, k, v) plus this block's gradients: g the output's gradient (as q), lse and
        delta [b, N, tq] f32 the whole ring's log-sum-exp (+inf where a query sees no key) and rowsum(g * output)."""
        b, tq, heads, d = q.shape
        tk, kv_heads = k.shape[1], k.shape[2]
        bq, bk = tile(tq, self.block), tile(tk, self.block)
        params = dict(scale=scale, causal=causal, groups=heads // kv_heads, bq=bq, bk=bk)
        args = (window, seg_q, pos_q, seg_k, pos_k, q, k, v, g, lse, delta)
        dq, dk, dv = acc
        dq, = self._call(_dq_kernel, (tq // bq, b, heads), [pl.BlockSpec((None, bq, None, d),
                                                                         lambda i, b, h: (b, i, h, 0))],
                         "ring_flash_dq", args, (dq,), tk=tk, **params)
        kv_spec = pl.BlockSpec((None, bk, None, d), lambda j, b, h: (b, j, h, 0))
        dk, dv = self._call(_dkv_kernel, (tk // bk, b, kv_heads), [kv_spec, kv_spec], "ring_flash_dkv", args,
                            (dk, dv), tq=tq, **params)
        return dq, dk, dv
