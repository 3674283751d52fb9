"""Expert-parallel dispatch: each routed row sent once to the device holding its expert, and back, by all-to-all.

One of the named exceptions to "XLA inserts every collective" (DESIGN.md): which device a row goes to depends on
the router's output, an exchange the SPMD partitioner cannot express (left to it, every token is gathered to
every expert shard and the partial outputs all-reduced). `dispatch(local_fn, n_experts)` runs in a shard_map
over the mesh axes that split the tokens, `expert` among them: each device sorts its rows' assignments by
expert, sends each to the expert's device, runs its own experts over what it received (`local_fn`, a grouped
matmul over rows sorted by local expert), and sends the results back. On GPU and TPU `ragged_all_to_all` moves
only the real rows; XLA:CPU has none, so there each destination gets a buffer padded to the most a source may
send it, a static-shape `all_to_all`. That bound is the worst case (every row a device can send one device), or,
with `capacity` f > 0, ceil(f * rows / shards): a balanced share times f, the rows past it dropped (their output
0, the residual carries them) and counted. Gradients are the same exchanges transposed.
tests/parallel/test_experts.py checks both forms equal the one-device layer (the ragged one emulated on CPU).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel import mesh as mesh_lib

AXIS = "expert"


def _token_axes(rules, mesh, name: str) -> tuple[str, ...]:
    return tuple(a for a in rules.get(name, ()) if mesh.shape[a] > 1)


def can_dispatch(batch: int, tokens: int) -> bool:
    """Whether the active mesh splits a [batch, tokens] input over `expert` evenly, as `dispatch` needs, outside a
    pipeline's stage vmap (not yet tested there: the layer then gathers, as with `moe_dispatch="gather"`)."""
    active = mesh_lib._ACTIVE.get()
    if active is None or active[0].shape.get(AXIS, 1) == 1 or mesh_lib._HELD.get():
        return False
    mesh, rules = active
    batch_axes, seq_axes = _token_axes(rules, mesh, "batch"), _token_axes(rules, mesh, "seq")
    return (AXIS in batch_axes and batch % math.prod(mesh.shape[a] for a in batch_axes) == 0
            and tokens % math.prod(mesh.shape[a] for a in seq_axes) == 0)


def dispatch(local_fn, n_experts: int, capacity: float = 0.0):
    """f(weights, x [B, T, d], experts [B, T, k] int, gates [B, T, k]) -> (y [B, T, d] in x's dtype: sum_j
    gates[..., j] * expert_{experts[..., j]}(x) over the kept assignments, dropped [B, T]: each token's assignments
    past the receive bound `capacity` sets, f32; 0 with capacity 0). `weights` is a pytree whose leaves all lead
    with the expert dim (sharded over `expert`; other dims are gathered into the shard_map, as per_shard does).
    local_fn(local weights, rows [M, d] sorted by local expert, group sizes [experts per shard]) -> [M, d]; rows
    past the groups' sum are padding (a ragged_dot gives them zeros). Needs `can_dispatch`."""
    def run(weights, x, experts, gates):
        mesh, rules = mesh_lib._ACTIVE.get()
        batch_axes, seq_axes = _token_axes(rules, mesh, "batch"), _token_axes(rules, mesh, "seq")
        spec = P(batch_axes, seq_axes or None)
        manual = set(batch_axes) | set(seq_axes)
        dtypes = jax.tree.map(lambda a: a.dtype, weights)
        if mesh_lib.compile_platform() == "cpu":  # as per_shard: XLA:CPU crashes on the bf16 gradient all-reduce
            weights = jax.tree.map(mesh_lib._widened, weights)

        def inner(w, x, experts, gates):
            w = jax.tree.map(lambda a, dtype: a.astype(dtype), w, dtypes)
            with mesh_lib.activation_sharding(mesh, mesh_lib._without(rules, tuple(manual))):
                b, t, d = x.shape
                y, dropped = _exchange(local_fn, w, x.reshape(b * t, d), experts.reshape(b * t, -1), n_experts,
                                       capacity)
                y = jnp.einsum("nk,nkd->nd", gates.reshape(b * t, -1).astype(x.dtype), y).reshape(b, t, d)
                return y, jnp.sum(dropped, axis=-1, dtype=jnp.float32).reshape(b, t)

        return jax.shard_map(inner, mesh=mesh, in_specs=(jax.tree.map(lambda _: P(AXIS), weights), spec, spec, spec),
                             out_specs=(spec, spec), axis_names=manual, check_vma=False)(weights, x, experts, gates)

    return run


def _ragged() -> bool:
    """Whether to exchange ragged (only the real rows move): on GPU and TPU. XLA:CPU has no ragged all-to-all."""
    return mesh_lib.compile_platform() != "cpu"


_ragged_all_to_all = jax.lax.ragged_all_to_all  # a module attribute: tests run the ragged path on CPU emulated


def _exchange(local_fn, w, x, experts, n_experts: int, capacity: float = 0.0):
    """One device's part: x [n, d], experts [n, k] -> (each assignment's expert output [n, k, d], 0 where dropped;
    which assignments were dropped [n, k] bool)."""
    n, k = experts.shape
    shards = jax.lax.axis_size(AXIS)
    per_shard = n_experts // shards
    m = n * k  # this device's assignments
    # A token's k choices are distinct experts, so at most min(k, per_shard) of its rows go to one device: the
    # most any device sends another (the worst case a buffer must hold: every source's rows to one device).
    cap = n * min(k, per_shard)
    if capacity:  # a balanced share of the rows, times the factor
        cap = min(cap, max(1, math.ceil(capacity * m / shards)))
    d = x.shape[-1]

    flat = experts.reshape(m)
    order = jnp.argsort(flat, stable=True)  # sorted position -> assignment (token * k + j)
    inverse = _inverse(order)
    rows = jnp.take(x, order // k, axis=0)
    sizes = jnp.zeros(n_experts, jnp.int32).at[flat].add(1).reshape(shards, per_shard)
    wanted = sizes.sum(axis=1)  # rows for each destination, contiguous in `rows`
    start = jnp.cumsum(wanted) - wanted
    send = jnp.minimum(wanted, cap)  # the first `cap` of them go (in expert order); the rest are dropped
    sizes = jnp.clip(send[:, None] - (jnp.cumsum(sizes, axis=1) - sizes), 0, sizes)  # what goes, per local expert
    counts = jax.lax.all_to_all(sizes, AXIS, 0, 0, tiled=True)  # [source, local expert]
    recv = counts.sum(axis=1)
    slot = jnp.arange(m)
    destination = jnp.sum(slot[:, None] >= jnp.cumsum(wanted)[None, :], axis=-1)  # of each sorted row
    dropped = slot - start[destination] >= send[destination]

    if _ragged():  # received compactly, sources in order; only real rows cross the network
        sent = jax.lax.all_gather(send, AXIS)  # [source, destination]
        before_me = jnp.arange(shards)[:, None] < jax.lax.axis_index(AXIS)
        there = jnp.sum(jnp.where(before_me, sent, 0), axis=0)  # where my rows start on each destination
        base = jnp.cumsum(recv) - recv
        received = _ragged_all_to_all(rows, jnp.zeros((shards * cap, d), rows.dtype), start, send, there, recv,
                                      axis_name=AXIS)
    else:  # a buffer per destination, padded to cap rows
        base = jnp.arange(shards) * cap
        valid = slot[None, :cap] < send[:, None]
        buffer = jnp.where(valid[..., None], jnp.take(rows, jnp.minimum(start[:, None] + slot[None, :cap], m - 1),
                                                      axis=0), 0)
        received = jax.lax.all_to_all(buffer, AXIS, 0, 0, tiled=True).reshape(shards * cap, d)

    # Each source's rows arrive sorted by expert: segment (source, local expert) starts at base + its offset.
    seg_start = (base[:, None] + jnp.cumsum(counts, axis=1) - counts).reshape(-1)
    seg_size = counts.reshape(-1)
    at = jnp.arange(shards * cap)
    seg = jnp.maximum(jnp.searchsorted(seg_start, at, side="right") - 1, 0)
    local = jnp.where(at < seg_start[seg] + seg_size[seg], seg % per_shard, per_shard)  # per_shard: padding
    order2 = jnp.argsort(local, stable=True)
    inverse2 = _inverse(order2)
    out = local_fn(w, jnp.take(received, order2, axis=0), counts.sum(axis=0))
    out = jnp.take(out, inverse2, axis=0)  # back in the received layout

    if _ragged():  # each source's rows back to where they were in its sorted order
        theirs = jax.lax.all_to_all(start, AXIS, 0, 0, tiled=True)  # where each source kept what it sent me
        mine = _ragged_all_to_all(out, jnp.zeros((m, d), out.dtype), base, recv, theirs, send, axis_name=AXIS)
    else:
        back = jax.lax.all_to_all(out.reshape(shards, cap, d), AXIS, 0, 0, tiled=True)
        mine = back[destination, jnp.minimum(slot - start[destination], cap - 1)]  # [m, d] in sorted order
        mine = jnp.where(dropped[:, None], 0, mine)
    return jnp.take(mine, inverse, axis=0).reshape(n, k, -1), jnp.take(dropped, inverse).reshape(n, k)


def _inverse(order):
    """The inverse of the permutation `order`, as a scatter rather than another sort."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
