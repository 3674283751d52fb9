"""The weight gradient of a grouped matmul for GPUs, as a Pallas (Triton) kernel that reads only routed rows.

XLA:GPU compiles `jax.lax.ragged_dot_general`'s ragged-contracting form (x [m, k], g [m, n], group sizes [G] ->
[G, k, n], each group's x rows^T @ its g rows) to a dense matmul over every group: a dropless MoE layer's weight
gradient then costs G/top_k times its FLOPs. Here each program of a (group, k block, n block) grid walks its
group's rows only, in blocks of BM, and accumulates its [BK, BN] tile in float32 registers; rows past the group
(and past sum(sizes)) are masked out, so an expert-parallel receive buffer's padding costs nothing.
`model.moe_weight_grad=pallas` takes it (jaxtrain.models.moe._kernel_ops). Pallas's interpreter checks it against
XLA on CPU (tests/models/test_gpu_grouped.py); `scripts/bench_ragged_dot.py` checks it on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BM, BK, BN = 64, 64, 64  # rows per step, and the output tile; Triton's dot needs each >= 16


def ragged_weight_grad(x, g, sizes, *, interpret: bool = False):
    """x [m, k], g [m, n] (rows sorted by group), sizes [G] -> [G, k, n] in g's dtype: each group's x rows^T @ its
    g rows, as `jax.lax.ragged_dot_general` with ragged contracting dims; a group of no rows gives zeros."""
    m, k = x.shape
    n = g.shape[1]
    bk, bn = min(BK, max(16, pl.next_power_of_2(k))), min(BN, max(16, pl.next_power_of_2(n)))
    ends = jnp.cumsum(sizes).astype(jnp.int32)
    starts = ends - sizes.astype(jnp.int32)

    def kernel(starts_ref, ends_ref, x_ref, g_ref, out_ref):
        e, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        start, end = starts_ref[e], jnp.minimum(ends_ref[e], m)
        in_k, in_n = kb * bk + jnp.arange(bk) < k, nb * bn + jnp.arange(bn) < n

        def step(i, acc):
            first = start + i * BM
            rows = (first + jnp.arange(BM) < end)[:, None]
            xs = plgpu.load(x_ref.at[pl.ds(first, BM), pl.ds(kb * bk, bk)], mask=rows & in_k[None], other=0.0)
            gs = plgpu.load(g_ref.at[pl.ds(first, BM), pl.ds(nb * bn, bn)], mask=rows & in_n[None], other=0.0)
            return acc + jnp.dot(xs.T, gs, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, (end - start + BM - 1) // BM, step, jnp.zeros((bk, bn), jnp.float32))
        out_ref[...] = acc.astype(out_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((sizes.shape[0], k, n), g.dtype),
        grid=(sizes.shape[0], pl.cdiv(k, bk), pl.cdiv(n, bn)),
        in_specs=[pl.no_block_spec] * 4,  # whole arrays in global memory: the kernel loads its rows itself
        out_specs=pl.BlockSpec((None, bk, bn), lambda e, kb, nb: (e, kb, nb)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(starts, ends, x, g)
