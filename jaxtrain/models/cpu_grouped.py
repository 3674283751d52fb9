"""Grouped matmuls for XLA:CPU that multiply only each group's own rows.

XLA:CPU runs `jax.lax.ragged_dot` as a dense matmul over every group with the other groups' rows zeroed, so a
dropless MoE layer pays for every expert on every routed row (E/k times the FLOPs it needs). Here a loop over
tiles of TILE rows, each within one group (a group's last tile runs past its end into rows that a later tile
rewrites, or that are masked), reads each tile's rows in place and multiplies them by its group's weight. The
loop runs only the tiles in use, so the work is the routed rows plus under TILE per group, however long the
static buffer (an expert-parallel receive buffer is mostly padding). `ragged_dot` and `ragged_weight_grad` have
the semantics of `jax.lax.ragged_dot` and of its ragged-contracting form (the weight gradient): rows past
sum(sizes) give zeros and contribute nothing. tests/models/test_moe.py checks both against XLA's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TILE = 64  # rows per tile: a [64, d] x [d, f] matmul keeps the CPU's vector units busy; padding <= 63 per group


def _plan(sizes, rows: int, tile: int):
    """Static bound T on the tiles, and per tile: its first row, group and how many of its rows are the group's."""
    groups = sizes.shape[0]
    bound = -(-(rows + groups * (tile - 1)) // tile)
    per_group = (sizes + tile - 1) // tile
    tiles_end = jnp.cumsum(per_group)
    t = jnp.arange(bound)
    group = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right"), groups - 1)
    within = t - (tiles_end[group] - per_group[group])  # the tile's index within its group
    first = jnp.cumsum(sizes)[group] - sizes[group] + within * tile
    return first, group, jnp.clip(sizes[group] - within * tile, 0, tile), tiles_end[-1]


def ragged_dot(x, w, sizes, tile: int = TILE):
    """x [m, k] (rows sorted by group), w [G, k, n], sizes [G] -> [m, n]: each group's rows times its weight."""
    m = x.shape[0]
    first, group, _, used = _plan(sizes, m, tile)
    x = jnp.pad(x, ((0, tile), (0, 0)))

    # Tiles in order: a tile's rows past its group's end hold the next group's rows, which that group's own tiles
    # (later in the loop) overwrite; past the last group they are cut or zeroed below.
    def product(i, out):
        rows = jax.lax.dynamic_slice_in_dim(x, first[i], tile)
        y = jnp.dot(rows, w[group[i]], preferred_element_type=jnp.float32).astype(out.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, y, first[i], 0)

    out = jax.lax.fori_loop(0, used, product, jnp.zeros((m + tile, w.shape[-1]), x.dtype))[:m]
    return jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], out, 0)


def ragged_weight_grad(x, g, sizes, tile: int = TILE):
    """x [m, k], g [m, n] (rows sorted by group), sizes [G] -> [G, k, n]: each group's x rows^T @ its g rows."""
    first, group, count, used = _plan(sizes, x.shape[0], tile)
    x, g = (jnp.pad(a, ((0, tile), (0, 0))) for a in (x, g))

    def add(i, total):
        rows = jax.lax.dynamic_slice_in_dim(x, first[i], tile)
        grads = jnp.where((jnp.arange(tile) < count[i])[:, None], jax.lax.dynamic_slice_in_dim(g, first[i], tile), 0)
        return total.at[group[i]].add(jnp.dot(rows.T, grads, preferred_element_type=jnp.float32))

    total = jnp.zeros((sizes.shape[0], x.shape[-1], g.shape[-1]), jnp.float32)
    return jax.lax.fori_loop(0, used, add, total).astype(g.dtype)
