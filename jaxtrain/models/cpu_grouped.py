"""Grouped matmuls for XLA:CPU that multiply only each group's own rows.

XLA:CPU runs `jax.lax.ragged_dot` as a dense matmul over every group with the other groups' rows zeroed, so a
dropless MoE layer pays for every expert on every routed row (E/k times the FLOPs it needs). Here a loop over
tiles of TILE rows reads each tile's rows in place, multiplies them by its group's weight and writes back the
rows that are its group's (a group's last tile overlaps its neighbours' rows, which it leaves alone). The
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
    """Static bound on the tiles, and per tile: the first row it reads (kept within the buffer: a tile may start
    earlier and overlap rows it then leaves alone), its group, where its own rows start and its group ends, and
    the tiles in use."""
    groups = sizes.shape[0]
    bound = -(-(rows + groups * (tile - 1)) // tile)
    per_group = (sizes + tile - 1) // tile
    tiles_end = jnp.cumsum(per_group)
    t = jnp.arange(bound)
    group = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right"), groups - 1)
    within = t - (tiles_end[group] - per_group[group])  # the tile's index within its group
    end = jnp.cumsum(sizes)[group]
    own = end - sizes[group] + within * tile  # the tile's own rows: [own, min(own + tile, end))
    first = jnp.clip(own, 0, max(rows - tile, 0))
    return first, group, own, end, tiles_end[-1]


def _mine(first, own, end, tile: int):
    """Which of a tile's rows (from `first`) are its own: its group's, and not another tile's of that group."""
    row = first + jnp.arange(tile)
    return (row >= own) & (row < end)


def ragged_dot(x, w, sizes, tile: int = TILE):
    """x [m, k] (rows sorted by group), w [G, k, n], sizes [G] -> [m, n]: each group's rows times its weight."""
    m = x.shape[0]
    tile = min(tile, m)
    first, group, own, end, used = _plan(sizes, m, tile)

    def product(i, out):  # each tile writes its group's rows only: tiles may overlap others' rows
        y = jnp.dot(jax.lax.dynamic_slice_in_dim(x, first[i], tile), w[group[i]],
                    preferred_element_type=jnp.float32).astype(out.dtype)
        keep = jax.lax.dynamic_slice_in_dim(out, first[i], tile)
        y = jnp.where(_mine(first[i], own[i], end[i], tile)[:, None], y, keep)
        return jax.lax.dynamic_update_slice_in_dim(out, y, first[i], 0)

    return jax.lax.fori_loop(0, used, product, jnp.zeros((m, w.shape[-1]), x.dtype))


def ragged_weight_grad(x, g, sizes, tile: int = TILE):
    """x [m, k], g [m, n] (rows sorted by group), sizes [G] -> [G, k, n]: each group's x rows^T @ its g rows."""
    m = x.shape[0]
    tile = min(tile, m)
    first, group, own, end, used = _plan(sizes, m, tile)

    def add(i, total):
        grads = jnp.where(_mine(first[i], own[i], end[i], tile)[:, None],
                          jax.lax.dynamic_slice_in_dim(g, first[i], tile), 0)
        return total.at[group[i]].add(jnp.dot(jax.lax.dynamic_slice_in_dim(x, first[i], tile).T, grads,
                                              preferred_element_type=jnp.float32))

    total = jnp.zeros((sizes.shape[0], x.shape[-1], g.shape[-1]), jnp.float32)
    return jax.lax.fori_loop(0, used, add, total).astype(g.dtype)
