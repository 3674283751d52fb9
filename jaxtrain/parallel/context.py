"""Context parallelism: ring, Ulysses and USP attention over the `sequence` mesh axis, and the zigzag layout that
balances the causal mask.

DESIGN.md's named exception for ring/Ulysses attention: XLA's partitioner can only gather K/V whole, so the
exchange is explicit (`ppermute`, `all_to_all`) in a shard_map over `sequence` and the batch's axes. One group
structure covers the three: Ulysses within groups of `ulysses` consecutive devices of the axis, the ring across
the n / ulysses groups. `ring_attention` (groups of 1): each device keeps its queries while the K/V shards go
round the ring, combined by online softmax; the backward is a ring too (custom_vjp: K/V and their gradient
accumulators go round again, each block's probabilities recomputed from the saved log-sum-exp, as
ring-flash-attention does). `ulysses_attention` (one group): all_to_all trades the sequence split for a head
split around whole-sequence attention. `usp_attention`: both. Masks come from each token's global position and
segment id, so packed documents may cross shard borders and any layout works; a (query, key) sub-block the mask
empties is skipped by lax.cond (or each step runs in a `kernel`'s flash kernels: models.gpu_flash, tpu_flash).
`balance_permutation` is the zigzag layout (ring member i holds chunks i and 2r-1-i of 2r); `attention_work`
counts each device's work under a layout, `ring_work` reads it from the compiled ring.
tests/parallel/test_context.py checks each equals the unsharded attention, outputs and gradients.
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
# model.ulysses_ways 0 picks at most this many: one GPU node, where the all-to-alls stay on NVLink.
_NODE = 8


# --- The zigzag layout ------------------------------------------------------------------------------------------
def balance_permutation(seq_len: int, n: int) -> np.ndarray:
    """Token order of the zigzag (head-tail) layout: x[..., perm] puts chunks i and 2n-1-i of 2n equal chunks on
    ring member i (its contiguous block of the permuted sequence), so every member's queries see as many earlier
    keys. n: the ring's size (mesh.sequence / ulysses ways). perm[j] is the original index of the token at j: pass it
    (broadcast) as ring_attention's `positions`."""
    if n < 1 or seq_len % (2 * n):
        raise ConfigError("train.seq_len", f"{seq_len} does not split into 2 x {n} (the ring's size) equal chunks, "
                          "as the balanced (zigzag) layout needs")
    chunks = np.arange(seq_len).reshape(2 * n, seq_len // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def inverse_balance_permutation(seq_len: int, n: int) -> np.ndarray:
    """y[..., inv] undoes x[..., balance_permutation(seq_len, n)]."""
    return np.argsort(balance_permutation(seq_len, n))


def ulysses_ways(ways: int, n: int, heads: int, kv_heads: int) -> int:
    """USP's Ulysses group size on a sequence axis of n: `ways` (model.ulysses_ways), or for 0 the largest divisor
    of n, at most one node's 8, that divides the query and KV heads."""
    if ways:
        return ways
    return max(u for u in range(1, min(n, _NODE) + 1) if n % u == 0 and heads % u == 0 and kv_heads % u == 0)


# --- Masks and the work they leave -----------------------------------------------------------------------------
def _mask(seg_q, pos_q, seg_k, pos_k, window: int, causal: bool):
    """[..., tq, tk] bool from [..., tq] and [..., tk]: `_keep` of every (query, key) pair."""
    return _keep(seg_q[..., :, None], pos_q[..., :, None], seg_k[..., None, :], pos_k[..., None, :], window, causal)


def _keep(seg_q, pos_q, seg_k, pos_k, window: int, causal: bool):
    """Which (query, key) pairs attend, from arrays that broadcast together: same document, key not padding
    (segment 0), causal by position, and within `window` positions. Operators only, so numpy arrays give numpy
    (attention_work), and a flash kernel's tiles (models.gpu_flash, models.tpu_flash) their mask."""
    keep = (seg_q == seg_k) & (seg_k != 0)
    d = pos_q - pos_k
    if causal:
        keep = keep & (d >= 0)
    if isinstance(window, (int, np.integer)):
        if window:
            keep = keep & ((d < window) if causal else (abs(d) < window))
    else:  # traced (a model whose layers alternate windows picks one per layer): 0 = no window
        reach = jnp.where(window > 0, window, jnp.iinfo(jnp.int32).max)
        keep = keep & ((d < reach) if causal else (abs(d) < reach))
    return keep


def attention_work(positions, segment_ids, n: int, *, window: int = 0, causal: bool = True, chunks: int = 2):
    """Each ring member's attention work over one ring under the layout of `positions` and `segment_ids`
    ([B, T], as ring_attention gets them, permuted or not): (sub-block pairs it computes, the rest skipped as
    ring_attention skips them; unmasked q.k pairs), each int [n]. The sub-blocks are each block cut in `chunks`.
    A model of the work; `ring_work` reads it from the compiled ring."""
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


SUB_BLOCK = 2048  # tokens: a sub-block pair's logits, [b, KV, G, c, c] f32, are 512 MiB at 32 heads


def _chunks(t: int, chunks: int) -> int:
    """`chunks` if it divides a block of t tokens, else 1 (no sub-blocks); 0: the fewest (2, 4, 8, ...) that cut it
    into sub-blocks of SUB_BLOCK tokens or fewer (2 where that does not divide)."""
    if chunks == 0:
        chunks = 2
        while t // chunks > SUB_BLOCK and t % (2 * chunks) == 0:
            chunks *= 2
    return chunks if chunks > 0 and t % chunks == 0 else 1


# --- Shared plumbing ---------------------------------------------------------------------------------------------
def _batch_axes(mesh, batch: int, axes, seq_axis: str) -> tuple[str, ...]:
    """The mesh axes the batch is split over inside the shard_map: `axes`, else the active rules' "batch" axes,
    else data and fsdp where present; the longest leading run whose product divides the batch."""
    if axes is None:
        active = mesh_lib.active_sharding()
        axes = active[1].get("batch", ()) if active is not None else ("data", "fsdp")
    axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a != seq_axis)
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


def _check(q, k, segment_ids, n: int, axis: str, u: int, field: str) -> None:
    """ConfigError naming the field when the sequence does not divide by the axis, the Ulysses groups (u, set by
    `field`) do not divide it, or the query or KV heads do not divide by u."""
    if segment_ids.shape[1] % n:
        raise ConfigError("train.seq_len", f"{segment_ids.shape[1]} does not divide by mesh.{axis}={n}")
    if q.shape[2] % k.shape[2]:
        raise ConfigError("model.n_kv_heads", f"{k.shape[2]} does not divide model.n_heads={q.shape[2]}")
    if u < 1 or n % u:
        raise ConfigError(field, f"{u} does not divide mesh.{axis}={n}")
    for name, heads in (("model.n_kv_heads", k.shape[2]), ("model.n_heads", q.shape[2])):
        if heads % u:
            raise ConfigError(name, f"{heads} heads do not divide by {field}={u}: Ulysses attention splits the "
                              "heads over its group (use ring attention, or a size that divides them)")


def _sharded(local, mesh, axis: str, batch_axes, q, k, v, segment_ids, positions, window, whole: bool = False,
             ulysses: int = 1):
    """local(q, k, v, seg, pos, window) on each device's shard of the batch and of the sequence (split over
    `axis`), `window` whole on each. Inside, active rules (if any) no longer map the manual axes, so an
    attention_fn's constraints name only the others. `whole`: every mesh axis manual (Mosaic kernels run only
    there), the heads split as the active rules split them (`_head_axes`; `ulysses` ways inside)."""
    b, t = segment_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    batch_axes = _batch_axes(mesh, b, batch_axes, axis)
    manual = (axis, *batch_axes)
    active = mesh_lib.active_sharding()
    spec = heads = P(batch_axes or None, axis)
    if whole:
        split = _head_axes(mesh, active and active[1], q.shape[2], k.shape[2], manual, ulysses)
        heads = P(batch_axes or None, axis, split or None)
        manual = tuple(mesh.axis_names)

    def inner(*args):
        if active is None:
            return local(*args)
        with mesh_lib.activation_sharding(mesh, mesh_lib._without(active[1], manual)):
            return local(*args)

    return jax.shard_map(inner, mesh=mesh, in_specs=(heads,) * 3 + (spec,) * 2 + (P(),), out_specs=heads,
                         axis_names=set(manual), check_vma=False)(q, k, v, segment_ids, positions, _window(window))


def _head_axes(mesh, rules, heads: int, kv_heads: int, manual, ulysses: int = 1) -> tuple[str, ...]:
    """The mesh axes outside `manual` that the active `rules` (None: none) split both query and KV heads over
    ("act_heads", "act_kv_heads"), if alike and each device keeps whole Ulysses groups of both; else none: the
    heads whole on every device of those axes."""
    if not rules:
        return ()
    axes, kv_axes = (tuple(a for a in rules.get(name, ()) if a not in manual and mesh.shape[a] > 1)
                     for name in ("act_heads", "act_kv_heads"))
    n = math.prod(mesh.shape[a] for a in axes) * ulysses
    return axes if axes == kv_axes and heads % n == 0 and kv_heads % n == 0 else ()


def _window(window):
    """The window as an int32 scalar: an argument of the shard_map and of _ring, so it may be traced."""
    return jnp.asarray(window, jnp.int32)


def _f32(spec: str, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _q_major(x):
    """[b, h, g, q] -> [b, q, h, g, 1], to scale outputs laid out [b, q, h, g, d]."""
    return jnp.moveaxis(x, 3, 1)[..., None]


# --- The group structure: Ulysses within groups of u consecutive devices, the ring across them -----------------
def _gather(axis: str, seg, pos):
    """The whole sequence's segment ids and positions (small ints), in the axis' layout: gathered once, for the
    queries' group block and every key block of the ring."""
    return (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (seg, pos))


def _ulysses_groups(axis: str, u: int):
    n = jax.lax.axis_size(axis)
    return None if u == n else [list(range(g * u, (g + 1) * u)) for g in range(n // u)]


def _heads_for_sequence(axis: str, u: int, *xs):
    """Each device's sequence shard of every head -> its group's sequence block (u shards) of its share of the
    heads; u = 1: as they are."""
    if u == 1:
        return xs
    return tuple(jax.lax.all_to_all(x, axis, 2, 1, tiled=True, axis_index_groups=_ulysses_groups(axis, u))
                 for x in xs)


def _sequence_for_heads(axis: str, u: int, out):
    if u == 1:
        return out
    return jax.lax.all_to_all(out, axis, 1, 2, tiled=True, axis_index_groups=_ulysses_groups(axis, u))


def _pass(x, axis: str, u: int):
    """x to the next group round the ring: (group g, member j) -> (g + 1, j), device g * u + j."""
    n = jax.lax.axis_size(axis)
    r = n // u
    return jax.lax.ppermute(x, axis, [(i, (i // u + 1) % r * u + i % u) for i in range(n)])


# --- Ring attention (over Ulysses groups) -----------------------------------------------------------------------
def ring_attention(q, k, v, segment_ids, positions=None, *, mesh=None, axis: str = "sequence", window: int = 0,
                   scale: float = 0.0, causal: bool = True, chunks: int = 0, batch_axes=None, kernel=None):
    """Attention of q [B, T, N, D] over k, v [B, T, KV, D] (N a multiple of KV: grouped-query), the sequence split
    over mesh `axis` and the batch over `batch_axes` (default: the active rules' "batch" axes, else data and fsdp);
    `mesh` None: the one active while a step traces (mesh_lib.activation_sharding). A query sees the keys of its own
    segment (segment_ids [B, T], 0 = padding, which nobody sees), at positions ([B, T], default 0..T-1; the
    permutation under zigzag) up to its own with `causal`, and within `window` positions with window > 0 (it may be
    traced: an int32 scalar). Positions restarting at 0 in each document give the same mask, if a segment id names
    one document per row. `scale`: 0 for D^-0.5. A query that sees no key gets 0. Other mesh axes stay XLA's (auto).
    Each block is cut in `chunks` sub-blocks along queries and keys (the logits of one pair, [b, KV, G, c, c] f32,
    are the largest temporary; 0: sub-blocks of at most SUB_BLOCK tokens), and a pair the mask empties is skipped:
    in the future, outside the window, or in other documents. Every ring step waits for the busiest device, so
    under the contiguous layout that saves no time (the last device sees every key); under zigzag
    (`balance_permutation`) each device skips the same share. `kernel`: each step's block in kernels of its own
    instead (models.gpu_flash's or tpu_flash's RingKernel: forward carries the softmax state through a block,
    backward adds its dq, dk, dv; they cut and skip tiles, so `chunks` is unused), in a shard_map over every mesh
    axis, the heads split as the rules split them."""
    return usp_attention(q, k, v, segment_ids, positions, mesh=mesh, axis=axis, ulysses=1, window=window,
                         scale=scale, causal=causal, chunks=chunks, batch_axes=batch_axes, kernel=kernel)


def usp_attention(q, k, v, segment_ids, positions=None, *, mesh=None, axis: str = "sequence", ulysses: int = 0,
                  window: int = 0, scale: float = 0.0, causal: bool = True, chunks: int = 0, batch_axes=None,
                  field: str = "model.ulysses_ways", kernel=None):
    """Ring attention across groups of `ulysses` consecutive devices of `axis`, Ulysses within each (as USP does:
    the ring's hops across the slow network, the all-to-alls within a node); 0: `ulysses_ways`' pick. An all_to_all
    within each group gives every device its group's sequence block for its share of the heads (query and KV heads
    must divide by `ulysses`), the ring runs over the groups' blocks, and an all_to_all trades back. The zigzag
    layout for it is balance_permutation(T, mesh.shape[axis] // ulysses). Arguments as ring_attention's."""
    mesh = _mesh(mesh)
    n = mesh.shape[axis]
    u = ulysses_ways(ulysses, n, q.shape[2], k.shape[2])
    _check(q, k, segment_ids, n, axis, u, field)
    chunks = _chunks(segment_ids.shape[1] * u // n, chunks)
    scale = float(scale or q.shape[-1] ** -0.5)

    def local(q, k, v, seg, pos, window):
        seg_all, pos_all = _gather(axis, seg, pos)
        q, k, v = _heads_for_sequence(axis, u, q, k, v)
        out = _ring(q, k, v, seg_all, pos_all, window, axis, u, scale, bool(causal), chunks, kernel)
        return _sequence_for_heads(axis, u, out)

    return _sharded(local, mesh, axis, batch_axes, q, k, v, segment_ids, positions, window, kernel is not None, u)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _ring(q, k, v, seg_all, pos_all, window, axis, u, scale, causal, chunks, kernel):
    return _ring_forward(q, k, v, seg_all, pos_all, window, axis, u, scale, causal, chunks, kernel)[0]


def _ring_fwd(q, k, v, seg_all, pos_all, window, axis, u, scale, causal, chunks, kernel):
    out, lse, _ = _ring_forward(q, k, v, seg_all, pos_all, window, axis, u, scale, causal, chunks, kernel)
    return out, (q, k, v, seg_all, pos_all, window, out, lse)


def _ring_bwd(axis, u, scale, causal, chunks, kernel, res, g):
    return (*_ring_backward(res, g, axis, u, scale, causal, chunks, kernel)[:3], None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ring_setup(q, k, seg_all, pos_all, axis: str, u: int):
    """(ring size, q as [b, t, KV, G, D], the queries' segments and positions, keys_at): keys_at(s) gives those of
    the K/V block held at step s, group idx - s's. t: a group's block, u shards."""
    r, idx = jax.lax.axis_size(axis) // u, jax.lax.axis_index(axis) // u
    b, t, heads, d = q.shape

    def keys_at(s):
        start = ((idx - s) % r) * t
        return tuple(jax.lax.dynamic_slice_in_dim(x, start, t, axis=1) for x in (seg_all, pos_all))

    return r, q.reshape(b, t, k.shape[2], heads // k.shape[2], d), *keys_at(0), keys_at


def _unhoisted(mask, carry):
    """`mask`, tied to the loop's carry. Masks depend on positions only, so inside a differentiated layer scan
    JAX's partial evaluation computed every (ring step, sub-block pair)'s mask ahead and stacked them (with the
    logits that use them): 805 GiB of temporaries for Llama-3-8B at 128K on 8 devices, 32 GiB tied."""
    return jax.lax.optimization_barrier((mask, carry))[0]


def _pairs(chunks: int, t: int, fn, carry):
    """carry through fn(carry, q0, k0) over every (query, key) sub-block pair of a step, q0 and k0 their offsets:
    a loop, so the program does not grow with chunks (long sequences need many, to bound the logits' size)."""
    c = t // chunks
    return jax.lax.fori_loop(0, chunks * chunks, lambda p, carry: fn(carry, p // chunks * c, p % chunks * c), carry)


def _ring_forward(q, k, v, seg_all, pos_all, window, axis, u, scale, causal, chunks, kernel=None):
    """(out [b, t, N, D] in q's dtype, log-sum-exp [b, KV, G, t] f32 (+inf where a query sees no key), the
    sub-block pairs computed: int32). The count is incremented inside the taken branch, so it reads what ran; a
    `kernel` counts none."""
    r, q5, seg, pos, keys_at = _ring_setup(q, k, seg_all, pos_all, axis, u)
    b, t, kv, g, d = q5.shape
    sl = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=t // chunks)
    put = jax.lax.dynamic_update_slice_in_dim

    def update(st, q, k, v, mask):  # one sub-block pair's online-softmax step
        o, m, l, done = st
        mask = mask[:, None, None]
        s = jnp.where(mask, _f32("bqhgd,bkhd->bhgqk", q, k) * jnp.float32(scale), jnp.float32(_MASKED))
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        fix = jnp.exp(m - m_new)
        return (o * _q_major(fix) + _f32("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v), m_new,
                l * fix + p.sum(axis=-1), done + 1)

    def step(s, state, k, v):
        seg_k, pos_k = keys_at(s)

        def pair(state, q0, k0):
            mask = _unhoisted(_mask(sl(seg, q0, axis=1), sl(pos, q0, axis=1), sl(seg_k, k0, axis=1),
                                    sl(pos_k, k0, axis=1), window, causal), state)
            o, m, l, done = state
            blk = (sl(o, q0, axis=1), sl(m, q0, axis=3), sl(l, q0, axis=3), done)
            blk = jax.lax.cond(jnp.any(mask), update, lambda st, *_: st, blk, sl(q5, q0, axis=1), sl(k, k0, axis=1),
                               sl(v, k0, axis=1), mask)
            return put(o, blk[0], q0, 1), put(m, blk[1], q0, 3), put(l, blk[2], q0, 3), blk[3]

        return _pairs(chunks, t, pair, state)

    def kernel_step(s, state, k, v):  # the kernel carries the softmax state on through this block
        o, m, l, done = state
        o, m, l = kernel.forward(q4, k, v, seg, pos, *keys_at(s), window, scale, causal,
                                 (o.reshape(q4.shape), m.reshape(b, -1, t), l.reshape(b, -1, t)))
        return o.reshape(q5.shape), m.reshape(b, kv, g, t), l.reshape(b, kv, g, t), done

    q4 = q5.reshape(b, t, kv * g, d)
    step = step if kernel is None else kernel_step

    def body(s, carry):
        state, k, v = carry
        # Sent before this step's block is computed, so the transfer can overlap it.
        k_next, v_next = _pass(k, axis, u), _pass(v, axis, u)
        return step(s, state, k, v), k_next, v_next

    state = (jnp.zeros(q5.shape, jnp.float32), jnp.full((b, kv, g, t), _MASKED, jnp.float32),
             jnp.zeros((b, kv, g, t), jnp.float32), jnp.int32(0))
    state, k, v = jax.lax.fori_loop(0, r - 1, body, (state, k, v))
    o, m, l, done = step(r - 1, state, k, v)
    seen = l > 0
    o = o / _q_major(jnp.where(seen, l, 1.0))
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    return o.reshape(q.shape).astype(q.dtype), lse, done


def _ring_backward(res, g, axis, u, scale, causal, chunks, kernel=None):
    """dq, dk, dv and the sub-block pairs computed: K/V go round the ring again with f32 dK/dV accumulators beside
    them, each sub-block's probabilities recomputed from the forward's log-sum-exp; a last hop brings each
    accumulator home."""
    q, k, v, seg_all, pos_all, window, out, lse = res
    r, q5, seg, pos, keys_at = _ring_setup(q, k, seg_all, pos_all, axis, u)
    t = q5.shape[1]
    g5 = g.reshape(q5.shape)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", g5.astype(jnp.float32), out.reshape(q5.shape).astype(jnp.float32))
    sc = jnp.float32(scale)
    sl = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=t // chunks)
    put = jax.lax.dynamic_update_slice_in_dim

    def grads(acc, q, g, lse, delta, k, v, mask):  # one sub-block pair's share of dq, dk, dv
        dq, dk, dv, done = acc
        mask = mask[:, None, None]
        p = jnp.where(mask, jnp.exp(_f32("bqhgd,bkhd->bhgqk", q, k) * sc - lse[..., None]), 0.0)
        dv = dv + _f32("bhgqk,bqhgd->bkhd", p.astype(g.dtype), g)
        ds = p * (_f32("bqhgd,bkhd->bhgqk", g, v) - delta[..., None]) * sc
        return (dq + _f32("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k),
                dk + _f32("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), q), dv, done + 1)

    def step(s, acc, k, v):
        seg_k, pos_k = keys_at(s)

        def pair(acc, q0, k0):
            mask = _unhoisted(_mask(sl(seg, q0, axis=1), sl(pos, q0, axis=1), sl(seg_k, k0, axis=1),
                                    sl(pos_k, k0, axis=1), window, causal), acc)
            dq, dk, dv, done = acc
            blk = (sl(dq, q0, axis=1), sl(dk, k0, axis=1), sl(dv, k0, axis=1), done)
            blk = jax.lax.cond(jnp.any(mask), grads, lambda acc, *_: acc, blk, sl(q5, q0, axis=1),
                               sl(g5, q0, axis=1), sl(lse, q0, axis=3), sl(delta, q0, axis=3), sl(k, k0, axis=1),
                               sl(v, k0, axis=1), mask)
            return put(dq, blk[0], q0, 1), put(dk, blk[1], k0, 1), put(dv, blk[2], k0, 1), blk[3]

        return _pairs(chunks, t, pair, acc)

    def kernel_step(s, acc, k, v):  # the kernels add this block's gradients to the accumulators
        dq, dk, dv, done = acc
        dq, dk, dv = kernel.backward(q4, k, v, g4, lse.reshape(b, -1, t), delta.reshape(b, -1, t), seg, pos,
                                     *keys_at(s), window, scale, causal, (dq.reshape(q4.shape), dk, dv))
        return dq.reshape(q5.shape), dk, dv, done

    b = q5.shape[0]
    q4, g4 = q5.reshape(b, t, -1, q5.shape[-1]), g5.reshape(b, t, -1, q5.shape[-1])
    step = step if kernel is None else kernel_step

    def body(s, carry):
        (dq, dk, dv, done), k, v = carry
        k_next, v_next = _pass(k, axis, u), _pass(v, axis, u)
        dq, dk, dv, done = step(s, (dq, dk, dv, done), k, v)
        return (dq, _pass(dk, axis, u), _pass(dv, axis, u), done), k_next, v_next

    acc = (jnp.zeros(q5.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32),
           jnp.int32(0))
    acc, k_, v_ = jax.lax.fori_loop(0, r - 1, body, (acc, k, v))
    dq, dk, dv, done = step(r - 1, acc, k_, v_)
    dk, dv = _pass(dk, axis, u), _pass(dv, axis, u)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), done


# --- Ulysses attention (one group) -------------------------------------------------------------------------------
def ulysses_attention(q, k, v, segment_ids, positions=None, *, mesh=None, axis: str = "sequence", window: int = 0,
                      scale: float = 0.0, causal: bool = True, attention_fn=None, batch_axes=None):
    """ring_attention's result by another exchange: an all_to_all trades each device's sequence shard of every
    head for the whole sequence of its share of the heads (query and KV heads alike, so KV heads must divide by
    the axis), attention runs there, and a second all_to_all trades back. attention_fn(q, k, v, mask [b, 1, T, T],
    scale) -> out, e.g. a faster kernel; default plain f32-softmax attention (0 where a query sees no key). The
    mask comes from the gathered positions: a kernel that assumes the contiguous causal order needs that layout."""
    mesh = _mesh(mesh)
    n = mesh.shape[axis]
    _check(q, k, segment_ids, n, axis, n, f"mesh.{axis}")
    scale = float(scale or q.shape[-1] ** -0.5)
    attention_fn = attention_fn or _dense_attention

    def local(q, k, v, seg, pos, window):
        seg, pos = _gather(axis, seg, pos)
        q, k, v = _heads_for_sequence(axis, n, q, k, v)
        out = attention_fn(q, k, v, _mask(seg, pos, seg, pos, window, causal)[:, None], scale)
        return _sequence_for_heads(axis, n, out)

    return _sharded(local, mesh, axis, batch_axes, q, k, v, segment_ids, positions, window)


def _dense_attention(q, k, v, mask, scale: float):
    """Grouped-query attention of q [b, T, N, D] over k, v [b, S, KV, D] under mask [b, 1, T, S], softmax in f32."""
    b, t, heads, d = q.shape
    q5 = q.reshape(b, t, k.shape[2], heads // k.shape[2], d)
    mask = mask[:, :, None]
    s = jnp.where(mask, _f32("bqhgd,bkhd->bhgqk", q5, k) * jnp.float32(scale), jnp.float32(_MASKED))
    p = jnp.where(mask, jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(p.sum(axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return _f32("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v).reshape(q.shape).astype(q.dtype)


# --- The work the compiled ring does -----------------------------------------------------------------------------
def ring_work(segment_ids, positions=None, *, mesh, axis: str = "sequence", ulysses: int = 1, window: int = 0,
              causal: bool = True, chunks: int = 2, heads: int = 0, head_dim: int = 8):
    """Each device's attention FLOPs ([n] float) in one forward and backward of the ring over this batch layout
    (segment ids, positions [B, T]; `heads` query and KV heads, 0: `ulysses`), read from the compiled program."""
    # Read, not modelled: the compiled HLO holds both branches of every sub-block's lax.cond, so its FLOPs say
    # nothing about the skipping. The ring's own forward and backward (the functions the training step's
    # custom_vjp calls, unchanged) count the pairs inside the taken branch; this compiles them on the mesh, runs
    # them, and returns those counts times a pair's matmul FLOPs. An io_callback or a test-only copy of the loop
    # would read a different program. The values of q, k, v do not steer the conds (masks do): zeros serve.
    b, t = np.shape(segment_ids)
    n, u, heads = mesh.shape[axis], ulysses, heads or ulysses
    chunks = _chunks(t * u // n, chunks)
    c = t * u // n // chunks
    scale = head_dim ** -0.5
    if positions is None:
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    spec = P(None, axis)

    def local(q, seg, pos):
        seg_all, pos_all = _gather(axis, seg, pos)
        q, = _heads_for_sequence(axis, u, q)
        out, lse, fwd = _ring_forward(q, q, q, seg_all, pos_all, _window(window), axis, u, scale, causal, chunks)
        *_, bwd = _ring_backward((q, q, q, seg_all, pos_all, _window(window), out, lse), out, axis, u, scale,
                                 causal, chunks)
        return jnp.stack([fwd, bwd])[None]

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=P(axis), axis_names={axis},
                                check_vma=False))
    q = jnp.zeros((b, t, heads, head_dim), jnp.float32)
    args = (q, jnp.asarray(segment_ids, jnp.int32), jnp.asarray(positions, jnp.int32))
    counts = np.asarray(run.lower(*args).compile()(*args))
    # Per pair: forward 2 matmuls (q.k, p.v), backward 5 (q.k again, dv, dp, dq, dk), each 2 * b * h * c * c * d.
    return (2 * counts[:, 0] + 5 * counts[:, 1]) * 2.0 * b * (heads // u) * c * c * head_dim
