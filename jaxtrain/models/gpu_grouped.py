"""Grouped-matmul gradients for GPUs, as Pallas (Triton) kernels that read only routed rows.

XLA:GPU compiles `jax.lax.ragged_dot_general`'s ragged-contracting form (x [m, k], g [m, n], group sizes [G] ->
[G, k, n], each group's x rows^T @ its g rows) to a dense matmul over every group: a dropless MoE layer's weight
gradient then costs G/top_k times its FLOPs. Here each program of a (group, k block, n block) grid walks its
group's rows only, in blocks of BM, and accumulates its [BK, BN] tile in float32 registers; rows past the group
(and past sum(sizes)) are masked out, so an expert-parallel receive buffer's padding costs nothing.
`model.moe_weight_grad=pallas` takes it (jaxtrain.models.moe._kernel_ops). `ragged_transposed_dot`, the input
gradient g @ w[e]^T, reads each expert's [k, n] weight as it is (`model.moe_input_grad=pallas`), where a kernel of
the forward's form needs it transposed, a copy of every gathered expert weight per layer and microbatch.
Pallas's interpreter checks both against XLA on CPU (tests/models/test_gpu_grouped.py).
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


def _row_tiles(sizes, m: int):
    """(group, row tile) of each program of `ragged_transposed_dot`'s grid, and each group's row range [start, end).
    A group visits every tile of BM rows it overlaps, so a tile split by a group border is visited once per group;
    a last pseudo-group (index G) holds the rows past sum(sizes), which get zeros, and visits past the count go to
    an empty one (G + 1). cdiv(m, BM) + G visits cover any sizes: each border adds at most one."""
    groups = sizes.shape[0]
    ends = jnp.cumsum(sizes).astype(jnp.int32)
    total = jnp.minimum(ends[-1], m)
    ends = jnp.minimum(jnp.concatenate([ends, jnp.full((1,), m, jnp.int32), jnp.zeros((1,), jnp.int32)]), m)
    starts = jnp.concatenate([jnp.minimum(ends[:groups] - sizes.astype(jnp.int32), m), total[None],
                              jnp.zeros((1,), jnp.int32)])
    first, last = starts // BM, (ends - 1) // BM
    visits = jnp.where(ends > starts, last - first + 1, 0)
    visit_ends = jnp.cumsum(visits)
    v = jnp.arange(pl.cdiv(m, BM) + groups, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(visit_ends, v, side="right"), groups + 1).astype(jnp.int32)
    tile = first[group] + v - (visit_ends[group] - visits[group])
    return group, tile.astype(jnp.int32), starts, ends


def ragged_transposed_dot(g, w, sizes, *, interpret: bool = False):
    """g [m, n] (rows sorted by group), w [G, k, n], sizes [G] -> [m, k] in g's dtype: each row times its group's
    weight transposed, as `jax.lax.ragged_dot(g, swapaxes(w, 1, 2), sizes)` (rows past sum(sizes) give zeros),
    reading w in its own layout. Each program of a (row visit, k block) grid takes one group's rows of one tile of
    BM rows and walks n in blocks of BN."""
    m, n = g.shape
    groups, k = w.shape[0], w.shape[1]
    bk, bn = min(BK, max(16, pl.next_power_of_2(k))), min(BN, max(16, pl.next_power_of_2(n)))
    group, tile, starts, ends = _row_tiles(sizes, m)

    def kernel(group_ref, tile_ref, starts_ref, ends_ref, g_ref, w_ref, out_ref):
        v, kb = pl.program_id(0), pl.program_id(1)
        e, first = group_ref[v], tile_ref[v] * BM
        row = first + jnp.arange(BM)
        rows = ((row >= starts_ref[e]) & (row < ends_ref[e]))[:, None]
        in_k = (kb * bk + jnp.arange(bk) < k)[None]

        def step(j, acc):
            in_n = (j * bn + jnp.arange(bn) < n)[None]
            gs = plgpu.load(g_ref.at[pl.ds(first, BM), pl.ds(j * bn, bn)], mask=rows & in_n, other=0.0)
            ws = plgpu.load(w_ref.at[jnp.minimum(e, groups - 1), pl.ds(kb * bk, bk), pl.ds(j * bn, bn)],
                            mask=in_k.T & in_n, other=0.0)
            return acc + jnp.dot(gs, ws.T, preferred_element_type=jnp.float32)

        steps = (e < groups).astype(jnp.int32) * pl.cdiv(n, bn)  # the rows past sum(sizes): zeros
        acc = jax.lax.fori_loop(jnp.int32(0), steps, step, jnp.zeros((BM, bk), jnp.float32))
        plgpu.store(out_ref.at[pl.ds(first, BM), pl.ds(kb * bk, bk)], acc.astype(out_ref.dtype), mask=rows & in_k)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, k), g.dtype),
        grid=(group.shape[0], pl.cdiv(k, bk)),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.no_block_spec,  # each program stores its own rows, masked: tiles split by a border are shared
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(group, tile, starts, ends, g, w)
