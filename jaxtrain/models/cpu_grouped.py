"""Grouped matmuls for XLA:CPU that multiply only each group's own rows.

XLA:CPU runs `jax.lax.ragged_dot` as a dense matmul over every group with the other groups' rows zeroed, so a
dropless MoE layer pays for every expert on every routed row (E/k times the FLOPs it needs). Here a loop over
tiles of TILE rows reads each tile's rows in place, multiplies them by its group's weight and writes back the
rows that are its group's (a group's last tile overlaps its neighbours' rows, which it leaves alone). The
loop runs only the tiles in use, so the work is the routed rows plus under TILE per group, however long the
static buffer (an expert-parallel receive buffer is mostly padding). `ragged_dot` and `ragged_weight_grad` have
the semantics of `jax.lax.ragged_dot` and of its ragged-contracting form (the weight gradient): rows past
sum(sizes) give zeros and contribute nothing. `expert_mlp` runs a whole gated expert MLP per tile, so the hidden
activations, too, exist for routed rows only. tests/models/test_moe.py checks all three against XLA's.
"""

from __future__ import annotations

import functools

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


def _write_own(out, y, first, own, end, tile: int):
    """`out` with the tile's own rows (from `first`) replaced by `y`'s; its other rows left as they are."""
    keep = jax.lax.dynamic_slice_in_dim(out, first, tile)
    y = jnp.where(_mine(first, own, end, tile)[:, None], y.astype(out.dtype), keep)
    return jax.lax.dynamic_update_slice_in_dim(out, y, first, 0)


def ragged_dot(x, w, sizes, tile: int = TILE):
    """x [m, k] (rows sorted by group), w [G, k, n], sizes [G] -> [m, n]: each group's rows times its weight."""
    m = x.shape[0]
    tile = min(tile, m)
    first, group, own, end, used = _plan(sizes, m, tile)

    def product(i, out):  # each tile writes its group's rows only: tiles may overlap others' rows
        y = jnp.dot(jax.lax.dynamic_slice_in_dim(x, first[i], tile), w[group[i]], preferred_element_type=jnp.float32)
        return _write_own(out, y, first[i], own[i], end[i], tile)

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


def expert_mlp(rows, sizes, w_gate_up, w_down, act, tile: int = TILE):
    """Each row through its expert's gated MLP, tile by tile: rows [m, d] sorted by expert, sizes [E], w_gate_up
    [E, d, T, 2f/T] (each of T blocks gate then up), w_down [E, f, d] -> [m, d] (rows past sum(sizes): zeros). The
    hidden activations exist one tile at a time, so the element-wise work, like the matmuls', is the routed rows
    only (an expert-parallel receive buffer is mostly padding); the backward recomputes them tile by tile."""
    return _expert_mlp(act, min(tile, rows.shape[0]), rows, sizes, w_gate_up, w_down)


def _hidden(act, x, w_gate_up):
    """x [t, d] through one expert's joined gate-and-up weight -> act(gate) * up [t, f]."""
    d, ways, width = w_gate_up.shape
    h = jnp.dot(x, w_gate_up.reshape(d, ways * width), preferred_element_type=jnp.float32).astype(x.dtype)
    h = h.reshape(-1, ways, width)
    return act(h[..., :width // 2].reshape(x.shape[0], -1)) * h[..., width // 2:].reshape(x.shape[0], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _expert_mlp(act, tile, rows, sizes, w_gate_up, w_down):
    first, group, own, end, used = _plan(sizes, rows.shape[0], tile)

    def body(i, out):
        x = jax.lax.dynamic_slice_in_dim(rows, first[i], tile)
        y = jnp.dot(_hidden(act, x, w_gate_up[group[i]]), w_down[group[i]], preferred_element_type=jnp.float32)
        return _write_own(out, y, first[i], own[i], end[i], tile)

    return jax.lax.fori_loop(0, used, body, jnp.zeros((rows.shape[0], w_down.shape[-1]), rows.dtype))


def _expert_mlp_fwd(act, tile, rows, sizes, w_gate_up, w_down):
    return _expert_mlp(act, tile, rows, sizes, w_gate_up, w_down), (rows, sizes, w_gate_up, w_down)


def _expert_mlp_bwd(act, tile, residuals, dy):
    rows, sizes, w_gate_up, w_down = residuals
    first, group, own, end, used = _plan(sizes, rows.shape[0], tile)

    def body(i, grads):
        dx, d_gate_up, d_down = grads
        e, mine = group[i], _mine(first[i], own[i], end[i], tile)[:, None]
        x = jax.lax.dynamic_slice_in_dim(rows, first[i], tile)
        g = jnp.where(mine, jax.lax.dynamic_slice_in_dim(dy, first[i], tile), 0)
        hidden, pull = jax.vjp(lambda x, w: _hidden(act, x, w), x, w_gate_up[e])
        d_down = d_down.at[e].add(jnp.dot(hidden.T, g, preferred_element_type=jnp.float32))
        dxi, dw = pull(jnp.dot(g, w_down[e].T, preferred_element_type=jnp.float32).astype(hidden.dtype))
        dx = _write_own(dx, dxi, first[i], own[i], end[i], tile)
        return dx, d_gate_up.at[e].add(dw.astype(jnp.float32)), d_down

    zeros = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
    dx, d_gate_up, d_down = jax.lax.fori_loop(0, used, body, (jnp.zeros_like(rows), zeros(w_gate_up), zeros(w_down)))
    return dx, None, d_gate_up.astype(w_gate_up.dtype), d_down.astype(w_down.dtype)


_expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)
