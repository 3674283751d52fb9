"""Context parallelism: ring and Ulysses attention over the `sequence` mesh axis, and the zigzag layout that
balances the causal mask.

DESIGN.md's named exception for ring/Ulysses attention: XLA's partitioner can only gather K/V whole, so the
exchange is explicit (`ppermute`, `all_to_all`) in a shard_map over `sequence` and the batch's axes.
`ring_attention`: each device keeps its queries while the K/V shards go round the ring, combined by online softmax;
the backward is a ring too (custom_vjp: K/V and their gradient accumulators go round again, each block's
probabilities recomputed from the saved log-sum-exp, as ring-flash-attention does). Masks come from each token's
global position and segment id, so packed documents may cross shard borders and either layout works; a (query,
key) sub-block the mask empties is skipped by lax.cond. `balance_permutation` is the zigzag layout (device i holds
chunks i and 2n-1-i of 2n) for the data path; `attention_work` counts each device's work under a layout.
`ulysses_attention` trades the sequence split for a head split by all_to_all around whole-sequence attention;
`usp_attention` runs the ring across one axis over Ulysses groups along another. tests/parallel/test_context.py
checks each equals the unsharded attention, outputs and gradients.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import ConfigError
from jaxtrain.parallel import mesh as mesh_lib

# A masked logit, as models/attention.py sets it: finite, so a row that sees no key never makes exp(-inf + inf).
_MASKED = -0.7 * float(np.finfo(np.float32).max)


# --- The zigzag layout ------------------------------------------------------------------------------------------
def balance_permutation(seq_len: int, n: int) -> np.ndarray:
    """Token order of the zigzag (head-tail) layout: x[..., perm] puts chunks i and 2n-1-i of 2n equal chunks on
    device i (its contiguous shard of the permuted sequence), so every device's queries see as many earlier keys.
    perm[j] is the original index of the token at j: pass it (broadcast) as ring_attention's `positions`."""
    if n < 1 or seq_len % (2 * n):
        raise ConfigError("train.seq_len", f"{seq_len} does not split into 2 x mesh.sequence={n} equal chunks, "
                          "as the balanced (zigzag) layout needs")
    chunks = np.arange(seq_len).reshape(2 * n, seq_len // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def inverse_balance_permutation(seq_len: int, n: int) -> np.ndarray:
    """y[..., inv] undoes x[..., balance_permutation(seq_len, n)]."""
    return np.argsort(balance_permutation(seq_len, n))


# --- Masks and the work they leave -----------------------------------------------------------------------------
def _mask(seg_q, pos_q, seg_k, pos_k, window: int, causal: bool):
    """[b, tq, tk] bool from [b, tq] and [b, tk]: same document, key not padding (segment 0), causal by position,
    and within `window` positions. Operators only, so numpy arrays give numpy (attention_work)."""
    keep = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k != 0)[:, None, :]
    d = pos_q[:, :, None] - pos_k[:, None, :]
    if causal:
        keep = keep & (d >= 0)
    if isinstance(window, (int, np.integer)):
        if window:
            keep = keep & ((d < window) if causal else (abs(d) < window))
    else:  # traced (a model whose layers alternate windows picks one per layer): 0 = no window
        keep = keep & (((d < window) if causal else (abs(d) < window)) | (window <= 0))
    return keep


def attention_work(positions, segment_ids, n: int, *, window: int = 0, causal: bool = True, chunks: int = 2):
    """Each sequence device's attention work over one ring under the layout of `positions` and `segment_ids`
    ([B, T], as ring_attention gets them, permuted or not): (sub-block pairs it computes, the rest skipped as
    ring_attention skips them; unmasked q.k pairs), each int [n]. The sub-blocks are each shard cut in `chunks`."""
    pos, seg = np.asarray(positions), np.asarray(segment_ids)
    t = seg.shape[1] // n
    c = t // _chunks(t, chunks)
    blocks, pairs = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for dev in range(n):
        for q0 in range(dev * t, (dev + 1) * t, c):
            for k0 in range(0, seg.shape[1], c):
                live = _mask(seg[:, q0:q0 + c], pos[:, q0:q0 + c], seg[:, k0:k0 + c], pos[:, k0:k0 + c], window,
                             causal).sum()
                blocks[dev] += live > 0
                pairs[dev] += live
    return blocks, pairs


def imbalance(work) -> float:
    """The busiest device's work over the mean."""
    work = np.asarray(work, np.float64)
    return float(work.max() / work.mean())


def _chunks(t: int, chunks: int) -> int:
    """`chunks` if it divides a shard of t tokens, else 1 (no sub-blocks)."""
    return chunks if chunks > 0 and t % chunks == 0 else 1


# --- Shared plumbing ---------------------------------------------------------------------------------------------
def _batch_axes(mesh, batch: int, axes, seq_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes the batch is split over inside the shard_map: `axes`, else the active rules' "batch" axes,
    else data and fsdp where present; the longest leading run whose product divides the batch."""
    if axes is None:
        active = mesh_lib.active_sharding()
        axes = active[1].get("batch", ()) if active is not None else ("data", "fsdp")
    axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in seq_axes)
    while axes and batch % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes


def _mesh(mesh):
    """`mesh`, else the one active while a step traces (mesh_lib.activation_sharding)."""
    if mesh is None:
        active = mesh_lib.active_sharding()
        if active is None:
            raise ValueError("context parallel attention needs a mesh: pass one, or trace inside "
                             "mesh.activation_sharding")
        mesh = active[0]
    return mesh


def _check(q, k, segment_ids, mesh, axes: tuple[str, ...], heads_axis: str | None = None) -> int:
    """How many ways `axes` split the sequence; ConfigError naming the field when the sequence does not divide,
    or (Ulysses, over `heads_axis`) the query or KV heads do not."""
    n = math.prod(mesh.shape[a] for a in axes)
    if segment_ids.shape[1] % n:
        ways = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in axes)
        raise ConfigError("train.seq_len", f"{segment_ids.shape[1]} does not divide by {ways}")
    if q.shape[2] % k.shape[2]:
        raise ConfigError("model.n_kv_heads", f"{k.shape[2]} does not divide model.n_heads={q.shape[2]}")
    if heads_axis is not None:
        for field, heads in (("model.n_kv_heads", k.shape[2]), ("model.n_heads", q.shape[2])):
            if heads % mesh.shape[heads_axis]:
                raise ConfigError(field, f"{heads} heads do not divide by mesh.{heads_axis}={mesh.shape[heads_axis]}: "
                                  "Ulysses attention splits the heads over that axis (use ring attention, or an axis "
                                  "size that divides them)")
    return n


def _sharded(local, mesh, axes: tuple[str, ...], batch_axes, q, k, v, segment_ids, positions, *replicated):
    """local(q, k, v, seg, pos, *replicated) on each device's shard of the batch and of the sequence (split over
    `axes`), `replicated` whole on each. Inside, active rules (if any) no longer map the manual axes, so an
    attention_fn's constraints name only the others."""
    b, t = segment_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    batch_axes = _batch_axes(mesh, b, batch_axes, axes)
    manual = (*axes, *batch_axes)
    spec = P(batch_axes or None, axes)
    active = mesh_lib.active_sharding()

    def inner(*args):
        if active is None:
            return local(*args)
        with mesh_lib.activation_sharding(mesh, mesh_lib._without(active[1], manual)):
            return local(*args)

    return jax.shard_map(inner, mesh=mesh, in_specs=(spec,) * 5 + (P(),) * len(replicated), out_specs=spec,
                         axis_names=set(manual), check_vma=False)(q, k, v, segment_ids, positions, *replicated)


def _f32(spec: str, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _q_major(x):
    """[b, h, g, q] -> [b, q, h, g, 1], to scale outputs laid out [b, q, h, g, d]."""
    return jnp.moveaxis(x, 3, 1)[..., None]


# --- Ring attention ----------------------------------------------------------------------------------------------
def ring_attention(q, k, v, segment_ids, positions=None, *, mesh=None, axis: str = "sequence", window: int = 0,
                   scale: float = 0.0, causal: bool = True, chunks: int = 2, batch_axes=None):
    """Attention of q [B, T, N, D] over k, v [B, T, KV, D] (N a multiple of KV: grouped-query), the sequence split
    over mesh `axis` and the batch over `batch_axes` (default: the active rules' "batch" axes, else data and fsdp);
    `mesh` None: the one active while a step traces (mesh_lib.activation_sharding). A query sees the keys of its own
    segment (segment_ids [B, T], 0 = padding, which nobody sees), at positions ([B, T], default 0..T-1; the
    permutation under zigzag) up to its own with `causal`, and within `window` positions with window > 0 (it may be
    traced: an int32 scalar). Positions restarting at 0 in each document give the same mask, if a segment id names
    one document per row. `scale`: 0 for D^-0.5. A query that sees no key gets 0. Other mesh axes stay XLA's (auto).
    Each shard is cut in `chunks` sub-blocks along queries and keys (the logits of one pair, [b, KV, G, c, c] f32 with
    c = T / (n * chunks), are the largest temporary), and a pair the mask empties is skipped: in the future, outside
    the window, or in other documents. Every ring step waits for the busiest device, so under the contiguous layout
    that saves no time (the last device sees every key); under zigzag (`balance_permutation`) each device skips the
    same share."""
    mesh = _mesh(mesh)
    n = _check(q, k, segment_ids, mesh, (axis,))
    chunks = _chunks(segment_ids.shape[1] // n, chunks)
    scale = float(scale or q.shape[-1] ** -0.5)

    def local(q, k, v, seg, pos, window):
        return _ring(q, k, v, seg, pos, window, axis, scale, bool(causal), chunks)

    return _sharded(local, mesh, (axis,), batch_axes, q, k, v, segment_ids, positions, _window(window))


def _window(window):
    """The window as an int32 scalar: an argument of the shard_map and of _ring, so it may be traced."""
    return jnp.asarray(window, jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _ring(q, k, v, seg, pos, window, axis, scale, causal, chunks):
    return _ring_forward(q, k, v, seg, pos, axis, window, scale, causal, chunks)[0]


def _ring_fwd(q, k, v, seg, pos, window, axis, scale, causal, chunks):
    out, lse = _ring_forward(q, k, v, seg, pos, axis, window, scale, causal, chunks)
    return out, (q, k, v, seg, pos, window, out, lse)


def _ring_bwd(axis, scale, causal, chunks, res, g):
    return (*_ring_backward(res, g, axis, scale, causal, chunks), None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ring_setup(q, k, seg, pos, axis):
    """(ring size, q as [b, t, KV, G, D], keys_at): keys_at(s) gives the segments and positions of the K/V shard
    held at step s, device idx - s's."""
    n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    b, t, heads, d = q.shape
    # The keys' segments and positions are small: gathered once rather than sent round with K/V.
    seg_all, pos_all = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (seg, pos))

    def keys_at(s):
        start = ((idx - s) % n) * t
        return (jax.lax.dynamic_slice_in_dim(x, start, t, axis=1) for x in (seg_all, pos_all))

    return n, q.reshape(b, t, k.shape[2], heads // k.shape[2], d), keys_at


def _pairs(chunks: int, t: int, fn, carry):
    """carry through fn(carry, q0, k0) over every (query, key) sub-block pair of a step, q0 and k0 their offsets:
    a loop, so the program does not grow with chunks (long sequences need many, to bound the logits' size)."""
    c = t // chunks
    return jax.lax.fori_loop(0, chunks * chunks, lambda p, carry: fn(carry, p // chunks * c, p % chunks * c), carry)


def _ring_forward(q, k, v, seg, pos, axis, window, scale, causal, chunks):
    """(out [b, t, N, D] in q's dtype, log-sum-exp [b, KV, G, t] f32; +inf where a query sees no key)."""
    n, q5, keys_at = _ring_setup(q, k, seg, pos, axis)
    b, t, kv, g, d = q5.shape
    c = t // chunks
    sl = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=c)
    put = jax.lax.dynamic_update_slice_in_dim

    def update(st, q, k, v, mask):  # one sub-block pair's online-softmax step
        o, m, l = st
        mask = mask[:, None, None]
        s = jnp.where(mask, _f32("bqhgd,bkhd->bhgqk", q, k) * jnp.float32(scale), jnp.float32(_MASKED))
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        fix = jnp.exp(m - m_new)
        return (o * _q_major(fix) + _f32("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v), m_new,
                l * fix + p.sum(axis=-1))

    def step(s, state, k, v):
        seg_k, pos_k = keys_at(s)

        def pair(state, q0, k0):
            o, m, l = state
            mask = _mask(sl(seg, q0, axis=1), sl(pos, q0, axis=1), sl(seg_k, k0, axis=1), sl(pos_k, k0, axis=1),
                         window, causal)
            blk = (sl(o, q0, axis=1), sl(m, q0, axis=3), sl(l, q0, axis=3))
            blk = jax.lax.cond(jnp.any(mask), update, lambda st, *_: st, blk, sl(q5, q0, axis=1), sl(k, k0, axis=1),
                               sl(v, k0, axis=1), mask)
            return put(o, blk[0], q0, 1), put(m, blk[1], q0, 3), put(l, blk[2], q0, 3)

        return _pairs(chunks, t, pair, state)

    def body(s, carry):
        state, k, v = carry
        # Sent before this step's block is computed, so the transfer can overlap it.
        k_next, v_next = _pass(k, axis, n), _pass(v, axis, n)
        return step(s, state, k, v), k_next, v_next

    state = (jnp.zeros(q5.shape, jnp.float32), jnp.full((b, kv, g, t), _MASKED, jnp.float32),
             jnp.zeros((b, kv, g, t), jnp.float32))
    state, k, v = jax.lax.fori_loop(0, n - 1, body, (state, k, v))
    o, m, l = step(n - 1, state, k, v)
    seen = l > 0
    o = o / _q_major(jnp.where(seen, l, 1.0))
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    return o.reshape(q.shape).astype(q.dtype), lse


def _ring_backward(res, g, axis, scale, causal, chunks):
    """dq, dk, dv: K/V go round the ring again with f32 dK/dV accumulators beside them, each sub-block's
    probabilities recomputed from the forward's log-sum-exp; a last hop brings each accumulator home."""
    q, k, v, seg, pos, window, out, lse = res
    n, q5, keys_at = _ring_setup(q, k, seg, pos, axis)
    t = q5.shape[1]
    g5 = g.reshape(q5.shape)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", g5.astype(jnp.float32), out.reshape(q5.shape).astype(jnp.float32))
    sc = jnp.float32(scale)
    sl = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=t // chunks)
    put = jax.lax.dynamic_update_slice_in_dim

    def grads(acc, q, g, lse, delta, k, v, mask):  # one sub-block pair's share of dq, dk, dv
        dq, dk, dv = acc
        mask = mask[:, None, None]
        p = jnp.where(mask, jnp.exp(_f32("bqhgd,bkhd->bhgqk", q, k) * sc - lse[..., None]), 0.0)
        dv = dv + _f32("bhgqk,bqhgd->bkhd", p.astype(g.dtype), g)
        ds = p * (_f32("bqhgd,bkhd->bhgqk", g, v) - delta[..., None]) * sc
        return (dq + _f32("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k),
                dk + _f32("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), q), dv)

    def step(s, dq, k, v, dk, dv):
        seg_k, pos_k = keys_at(s)

        def pair(acc, q0, k0):
            dq, dk, dv = acc
            mask = _mask(sl(seg, q0, axis=1), sl(pos, q0, axis=1), sl(seg_k, k0, axis=1), sl(pos_k, k0, axis=1),
                         window, causal)
            blk = (sl(dq, q0, axis=1), sl(dk, k0, axis=1), sl(dv, k0, axis=1))
            blk = jax.lax.cond(jnp.any(mask), grads, lambda acc, *_: acc, blk, sl(q5, q0, axis=1),
                               sl(g5, q0, axis=1), sl(lse, q0, axis=3), sl(delta, q0, axis=3), sl(k, k0, axis=1),
                               sl(v, k0, axis=1), mask)
            return put(dq, blk[0], q0, 1), put(dk, blk[1], k0, 1), put(dv, blk[2], k0, 1)

        return _pairs(chunks, t, pair, (dq, dk, dv))

    def body(s, carry):
        dq, k, v, dk, dv = carry
        k_next, v_next = _pass(k, axis, n), _pass(v, axis, n)
        dq, dk, dv = step(s, dq, k, v, dk, dv)
        return dq, k_next, v_next, _pass(dk, axis, n), _pass(dv, axis, n)

    dq = jnp.zeros(q5.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    dq, k_, v_, dk, dv = jax.lax.fori_loop(0, n - 1, body, (dq, k, v, dk, dv))
    dq, dk, dv = step(n - 1, dq, k_, v_, dk, dv)
    dk, dv = _pass(dk, axis, n), _pass(dv, axis, n)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _pass(x, axis: str, n: int):
    """x to the next device round the ring (device i's to i + 1)."""
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


# --- Ulysses attention -------------------------------------------------------------------------------------------
def ulysses_attention(q, k, v, segment_ids, positions=None, *, mesh=None, axis: str = "sequence", window: int = 0,
                      scale: float = 0.0, causal: bool = True, attention_fn=None, batch_axes=None):
    """ring_attention's result by another exchange: an all_to_all trades each device's sequence shard of every
    head for the whole sequence of its share of the heads (query and KV heads alike, so KV heads must divide by
    the axis), attention runs there, and a second all_to_all trades back. attention_fn(q, k, v, mask [b, 1, T, T],
    scale) -> out, e.g. a faster kernel; default plain f32-softmax attention (0 where a query sees no key). The
    mask comes from the gathered positions: a kernel that assumes the contiguous causal order needs that layout."""
    mesh = _mesh(mesh)
    _check(q, k, segment_ids, mesh, (axis,), heads_axis=axis)
    scale = float(scale or q.shape[-1] ** -0.5)
    attention_fn = attention_fn or _dense_attention

    def local(q, k, v, seg, pos, window):
        q, k, v, seg, pos = _heads_for_sequence(axis, q, k, v, seg, pos)
        out = attention_fn(q, k, v, _mask(seg, pos, seg, pos, window, causal)[:, None], scale)
        return _sequence_for_heads(axis, out)

    return _sharded(local, mesh, (axis,), batch_axes, q, k, v, segment_ids, positions, _window(window))


def _heads_for_sequence(axis: str, q, k, v, seg, pos):
    """Each device's sequence shard of every head -> the whole (axis-wide) sequence of its share of the heads."""
    q, k, v = (jax.lax.all_to_all(x, axis, 2, 1, tiled=True) for x in (q, k, v))
    return (q, k, v, *(jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (seg, pos)))


def _sequence_for_heads(axis: str, out):
    return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)


def _dense_attention(q, k, v, mask, scale: float):
    """Grouped-query attention of q [b, T, N, D] over k, v [b, S, KV, D] under mask [b, 1, T, S], softmax in f32."""
    b, t, heads, d = q.shape
    q5 = q.reshape(b, t, k.shape[2], heads // k.shape[2], d)
    mask = mask[:, :, None]
    s = jnp.where(mask, _f32("bqhgd,bkhd->bhgqk", q5, k) * jnp.float32(scale), jnp.float32(_MASKED))
    p = jnp.where(mask, jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(p.sum(axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return _f32("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v).reshape(q.shape).astype(q.dtype)


# --- Both: ring across one axis, Ulysses within another (USP) ---------------------------------------------------
def usp_attention(q, k, v, segment_ids, positions=None, *, mesh=None, ring_axis: str, ulysses_axis: str = "sequence",
                  window: int = 0, scale: float = 0.0, causal: bool = True, chunks: int = 2, batch_axes=None):
    """Ring attention across `ring_axis` over Ulysses groups along `ulysses_axis` (as USP does: the ring's hops
    across the slow network, the all-to-alls within a node). The sequence is split over (ring_axis, ulysses_axis),
    ring outermost: an all_to_all within each group gives every device its group's sequence block for its share of
    the heads, the ring runs over the groups' blocks, and an all_to_all trades back. The zigzag layout for it is
    balance_permutation(T, mesh.shape[ring_axis]). Arguments as ring_attention's; the heads as Ulysses needs."""
    mesh, axes = _mesh(mesh), (ring_axis, ulysses_axis)
    n = _check(q, k, segment_ids, mesh, axes, heads_axis=ulysses_axis)
    chunks = _chunks(segment_ids.shape[1] * mesh.shape[ulysses_axis] // n, chunks)
    scale = float(scale or q.shape[-1] ** -0.5)

    def local(q, k, v, seg, pos, window):
        q, k, v, seg, pos = _heads_for_sequence(ulysses_axis, q, k, v, seg, pos)
        out = _ring(q, k, v, seg, pos, window, ring_axis, scale, bool(causal), chunks)
        return _sequence_for_heads(ulysses_axis, out)

    return _sharded(local, mesh, axes, batch_axes, q, k, v, segment_ids, positions, _window(window))
