"""One ring step of context-parallel attention on TPUs, as Pallas (Mosaic) flash kernels.

The TPU counterpart of models.gpu_flash, with the same `RingKernel` interface (model.attention_impl=pallas picks
by the platform the step compiles for). Splash attention's masks are static numpy objects and its backward takes
no outside log-sum-exp, while a ring step's mask depends on which device's block it holds (zigzag layout, a
traced window); hence kernels of our own. Each tile's mask comes from segment ids and positions
(parallel.context's rule); a table of the tiles that may hold a visible pair, from each tile's ranges, rides in
SMEM so an empty tile costs no matmul. Mosaic's layouts shape the code: heads-major [b, N, t, D] blocks, per-query
statistics broadcast over 128 lanes, key-side ids over 8 sublanes, as jax's own TPU flash kernels keep them.
The wrapper converts the ring's layout to these at each step. Pallas's interpreter checks the numbers on CPU,
and a lowering for TPU checks that Mosaic takes them (tests/parallel/test_context.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxtrain.parallel.context import _MASKED, _keep  # the ring's masked logit and its rule for a visible pair

LANES, SUBLANES = 128, 8  # a vreg's shape: tiles are multiples of LANES (models.config.RING_KERNEL_LIMITS)
BLOCK = 512  # query and key tile, tokens
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def tile(t: int, block: int = BLOCK) -> int:
    """The tile for a block of t tokens: the largest multiple of LANES up to `block` that divides it."""
    size = max(block // LANES, 1) * LANES
    while size >= LANES and t % size:
        size -= LANES
    if size < LANES:  # config validation says so first, naming train.seq_len
        raise ValueError(f"a ring block of {t} tokens: the TPU flash kernels' tiles need a multiple of {LANES}")
    return size


def _widen(x, n: int):
    """[bq, LANES] per-query values (each row one value) as [bq, n]."""
    return jnp.tile(x, (1, pl.cdiv(n, LANES)))[:, :n]


def _dot(a, b, dims=None):
    dims = dims or (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _tile_mask(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, bk: int, causal: bool):
    """[bq, bk] bool: queries' ids [bq, LANES] widened, keys' [SUBLANES, bk] first row."""
    return _keep(_widen(seg_q_ref[...], bk), _widen(pos_q_ref[...], bk), seg_k_ref[:1, :], pos_k_ref[:1, :],
                 window_ref[0], causal)


def _live(seg_q, pos_q, seg_k, pos_k, window, causal: bool, bq: int, bk: int):
    """int32 [b * nq * nk]: 0 where tile (query tile i, key tile j) holds no visible pair for certain, from
    each tile's ranges of segment ids and positions (a tile it keeps may still be empty: its mask decides)."""
    b = seg_q.shape[0]

    def ranges(x, size, axis):
        x = x.reshape(b, -1, size)
        return jnp.expand_dims(x.min(-1), axis), jnp.expand_dims(x.max(-1), axis)

    (sq0, sq1), (pq0, pq1) = ranges(seg_q, bq, 2), ranges(pos_q, bq, 2)
    (sk0, sk1), (pk0, pk1) = ranges(seg_k, bk, 1), ranges(pos_k, bk, 1)
    live = (sq0 <= sk1) & (sk0 <= sq1) & (sk1 > 0)
    nearest = jnp.maximum(pq0 - pk1, 0)  # the least query - key distance, causal pairs only
    if causal:
        live = live & (pk0 <= pq1)
    else:
        nearest = jnp.maximum(nearest, pk0 - pq1)
    reach = jnp.where(window > 0, window, jnp.iinfo(jnp.int32).max)
    return (live & (nearest < reach)).astype(jnp.int32).reshape(-1)


def _forward_kernel(window_ref, live_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q_ref, k_ref, v_ref, o_in,
                    m_in, l_in, o_ref, m_ref, l_ref, *, scale: float, causal: bool, nq: int, nk: int):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():  # the output blocks stay in VMEM across the key tiles (j): the state comes in once
        o_ref[...], m_ref[...], l_ref[...] = o_in[...], m_in[...], l_in[...]

    @pl.when(live_ref[(b * nq + i) * nk + j] != 0)
    def _():
        v = v_ref[...]
        bk, d = v.shape
        mask = _tile_mask(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, bk, causal)
        s = jnp.where(mask, _dot(q_ref[...], k_ref[...], _NT) * scale, _MASKED)
        m = m_ref[...]
        m_new = jnp.maximum(m, s.max(axis=1)[:, None])
        p = jnp.where(mask, jnp.exp(s - _widen(m_new, bk)), 0.0)
        fix = jnp.exp(m - m_new)
        l_ref[...] = l_ref[...] * fix + jax.lax.broadcast_in_dim(p.sum(axis=1), m.shape, (0,))
        m_ref[...] = m_new
        o_ref[...] = o_ref[...] * _widen(fix, d) + _dot(p.astype(v.dtype), v)


def _grads(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q, k, v, do, lse_ref, delta_ref,
           scale: float, causal: bool):
    """(p, ds) [bq, bk] f32 of one tile, from the whole ring's log-sum-exp and delta."""
    bk = k.shape[0]
    mask = _tile_mask(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, bk, causal)
    p = jnp.where(mask, jnp.exp(_dot(q, k, _NT) * scale - _widen(lse_ref[...], bk)), 0.0)
    return p, p * (_dot(do, v, _NT) - _widen(delta_ref[...], bk)) * scale


def _dq_kernel(window_ref, live_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, dq_in, dq_ref, *, scale: float, causal: bool, nq: int, nk: int):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        dq_ref[...] = dq_in[...]

    @pl.when(live_ref[(b * nq + i) * nk + j] != 0)
    def _():
        k = k_ref[...]
        _, ds = _grads(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q_ref[...], k, v_ref[...],
                       do_ref[...], lse_ref, delta_ref, scale, causal)
        dq_ref[...] += _dot(ds.astype(k.dtype), k)


def _dkv_kernel(window_ref, live_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, dk_in, dv_in, dk_ref, dv_ref, *, scale: float, causal: bool, nq: int, nk: int):
    b, j, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)  # n: (query head of the group, query tile)

    @pl.when(n == 0)
    def _():
        dk_ref[...], dv_ref[...] = dk_in[...], dv_in[...]

    @pl.when(live_ref[(b * nq + jax.lax.rem(n, nq)) * nk + j] != 0)
    def _():
        q, do = q_ref[...], do_ref[...]
        p, ds = _grads(window_ref, seg_q_ref, pos_q_ref, seg_k_ref, pos_k_ref, q, k_ref[...], v_ref[...], do,
                       lse_ref, delta_ref, scale, causal)
        dv_ref[...] += _dot(p.astype(do.dtype), do, _TN)
        dk_ref[...] += _dot(ds.astype(q.dtype), q, _TN)


def _heads_major(x):
    return jnp.swapaxes(x, 1, 2)


def _lanes(x):
    return jnp.broadcast_to(x[..., None], (*x.shape, LANES))


def _specs(bq: int, bk: int, d: int, at):
    """BlockSpecs over a grid whose indices at() maps to (batch, query head, query tile, KV head, key tile): the
    ids (queries' [bq, LANES], keys' [SUBLANES, bk]), a query's row block [bq, d], a key's block [bk, d] and
    per-query statistics [bq, LANES]."""
    def spec(shape, pick):
        return pl.BlockSpec(shape, lambda *g: pick(*at(*g[:4])))  # g[4:]: the scalar prefetch refs

    ids_q = spec((None, bq, LANES), lambda b, h, i, kv, j: (b, i, 0))
    ids_k = spec((None, SUBLANES, bk), lambda b, h, i, kv, j: (b, 0, j))
    rows = spec((None, None, bq, d), lambda b, h, i, kv, j: (b, h, i, 0))
    keys = spec((None, None, bk, d), lambda b, h, i, kv, j: (b, kv, j, 0))
    stats = spec((None, None, bq, LANES), lambda b, h, i, kv, j: (b, h, i, 0))
    return [ids_q, ids_q, ids_k, ids_k], rows, keys, stats


@dataclasses.dataclass(frozen=True)
class RingKernel:
    """The ring's per-step kernels, as models.gpu_flash.RingKernel's: q [b, tq, N, D], k, v [b, tk, KV, D],
    segment ids and positions [b, t] int32 for each side, window an int32 scalar (0: none). `interpret`:
    Pallas's interpreter, so they run on CPU (tests); `block`: the largest tile."""
    interpret: bool = False
    block: int = BLOCK

    def _call(self, kernel, grid, specs, out_specs, name, prefetch, args, carried, **params):
        """kernel over grid with `prefetch` in SMEM, its outputs the `carried` arrays (its last inputs) updated
        in place; the last grid axis accumulates."""
        return pl.pallas_call(
            functools.partial(kernel, **params),
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(prefetch), grid=grid, in_specs=specs,
                                                   out_specs=out_specs),
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in carried],
            input_output_aliases={len(prefetch) + len(args) + i: i for i in range(len(carried))},
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",)),
            interpret=self.interpret, name=name,
        )(*prefetch, *args, *carried)

    def _setup(self, q, k, seg_q, pos_q, seg_k, pos_k, window, causal):
        """((bq, bk) tiles, the SMEM scalars: window and the live tiles, the ids in the kernels' layouts)."""
        b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
        bq, bk = tile(tq, self.block), tile(tk, self.block)
        window = jnp.asarray(window, jnp.int32)
        prefetch = (window.reshape(1), _live(seg_q, pos_q, seg_k, pos_k, window, causal, bq, bk))
        ids = (_lanes(seg_q), _lanes(pos_q),
               *(jnp.broadcast_to(x[:, None, :], (b, SUBLANES, tk)) for x in (seg_k, pos_k)))
        return (bq, bk), prefetch, ids

    def forward(self, q, k, v, seg_q, pos_q, seg_k, pos_k, window, scale: float, causal: bool, state):
        """`state` (o [b, tq, N, D], m [b, N, tq], l [b, N, tq], f32) carried on over this block, as
        models.gpu_flash.RingKernel.forward's."""
        b, tq, heads, d = q.shape
        (bq, bk), prefetch, ids = self._setup(q, k, seg_q, pos_q, seg_k, pos_k, window, causal)
        nq, nk = tq // bq, k.shape[1] // bk
        groups = heads // k.shape[2]
        id_specs, rows, keys, stats = _specs(bq, bk, d, lambda b, h, i, j: (b, h, i, jax.lax.div(h, groups), j))
        o, m, l = state
        o, m, l = self._call(_forward_kernel, (b, heads, nq, nk), id_specs + [rows, keys, keys, rows, stats, stats],
                             [rows, stats, stats], "ring_flash_forward", prefetch,
                             (*ids, *map(_heads_major, (q, k, v))), (_heads_major(o), _lanes(m), _lanes(l)),
                             scale=scale, causal=causal, nq=nq, nk=nk)
        return _heads_major(o), m[..., 0], l[..., 0]

    def backward(self, q, k, v, g, lse, delta, seg_q, pos_q, seg_k, pos_k, window, scale: float, causal: bool,
                 acc):
        """`acc` (dq, dk, dv, f32, as q, k, v) plus this block's gradients, as
        models.gpu_flash.RingKernel.backward's."""
        b, tq, heads, d = q.shape
        kv_heads = k.shape[2]
        groups = heads // kv_heads
        (bq, bk), prefetch, ids = self._setup(q, k, seg_q, pos_q, seg_k, pos_k, window, causal)
        nq, nk = tq // bq, k.shape[1] // bk
        args = (*ids, *map(_heads_major, (q, k, v, g)), _lanes(lse), _lanes(delta))
        dq, dk, dv = map(_heads_major, acc)
        params = dict(scale=scale, causal=causal, nq=nq, nk=nk)

        id_specs, rows, keys, stats = _specs(bq, bk, d, lambda b, h, i, j: (b, h, i, jax.lax.div(h, groups), j))
        dq, = self._call(_dq_kernel, (b, heads, nq, nk), id_specs + [rows, keys, keys, rows, stats, stats, rows],
                         [rows], "ring_flash_dq", prefetch, args, (dq,), **params)

        # grid (b, KV head, key tile, (query head of its group, query tile))
        id_specs, rows, keys, stats = _specs(bq, bk, d, lambda b, kv, j, n: (
            b, kv * groups + jax.lax.div(n, nq), jax.lax.rem(n, nq), kv, j))
        dk, dv = self._call(_dkv_kernel, (b, kv_heads, nk, groups * nq),
                            id_specs + [rows, keys, keys, rows, stats, stats, keys, keys], [keys, keys],
                            "ring_flash_dkv", prefetch, args, (dk, dv), **params)
        return tuple(map(_heads_major, (dq, dk, dv)))
