"""Causal self-attention over packed documents: the mask, and the ways the model computes it.

Under sequence parallelism `layer_mask` and `self_attention` pick how K/V cross the `sequence` axis
(model.context_parallel): gathered whole (XLA's), or ring / Ulysses / USP attention (jaxtrain.parallel.context).

`model.attention_block` = 0: one `jax.nn.dot_product_attention` call (XLA's kernel, or cuDNN's on GPU).
`model.attention_block` > 0: written out in query blocks that skip the keys above the diagonal, with a backward of
its own (`blocked_attention`): autodiff of the blocks summed every block's K/V gradient into the whole [B, S, ...]
array through pads and adds, and read its operands transposed, which XLA:CPU runs in f32 even for bf16 inputs
(jaxtrain.models.cpu_bf16). Here every matmul of the forward and backward accumulates in f32, and its lhs
contracts its last dim, copied into that layout where needed.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtrain.parallel import context
from jaxtrain.parallel.mesh import constrain, split_ways
from jaxtrain.models.cpu_bf16 import transposed_in_memory

# A masked logit, as jax.nn.dot_product_attention's XLA path sets it.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(segment_ids, window: int = 0):
    """[B, 1, T, T] boolean: causal, same document, and never attending to padding; with `window`, a query sees
    only the newest `window` positions up to itself."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
    if window:
        causal = causal & ~jnp.tril(jnp.ones((t, t), dtype=jnp.bool_), -window)
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, None, :]
    return (causal[None] & same_doc & real)[:, None]


class ContextMask(NamedTuple):
    """A layer's mask under ring or Ulysses attention (jaxtrain.parallel.context), which builds it block by block:
    segment ids and positions [B, T] (restarting per document, so the mask holds in any token order: the zigzag
    layout's too) and the window (int32 scalar, 0 = none; traced where layers alternate windows)."""
    segment_ids: jax.Array
    positions: jax.Array
    window: jax.Array


def layer_mask(segment_ids, positions, window: int, mode: str):
    """What a layer's attention is masked by: a ContextMask under model.context_parallel `mode` "ring", "ulysses" or
    "usp" with the sequence split over devices; else `attention_mask`'s (K/V gathered whole). The one place that
    decides."""
    if mode == "allgather" or split_ways("seq") == 1:
        return attention_mask(segment_ids, window)
    return ContextMask(segment_ids, positions, jnp.asarray(window, jnp.int32))


def self_attention(q, k, v, mask, attend, mode: str, scale: float = 0.0, ulysses_ways: int = 0, kernel=None):
    """A layer's attention of q [B, T, N, D] (split along the sequence) over its k, v under `layer_mask`'s `mask`:
    ring, Ulysses or USP attention (`mode`; USP's Ulysses groups of `ulysses_ways`, model.ulysses_ways) for a
    ContextMask, the K/V shards exchanged explicitly, each ring step in `kernel` if given (gpu_flash's or
    tpu_flash's RingKernel); else every query needs every earlier key, so K/V are gathered whole along the
    sequence (None = not split) and attend(q, k, v, mask) runs on each device's queries."""
    if isinstance(mask, ContextMask):
        kv_names = ("batch", "seq", "act_kv_heads", None)
        attention = {"ring": context.ring_attention, "ulysses": context.ulysses_attention,
                     "usp": functools.partial(context.usp_attention, ulysses=ulysses_ways)}[mode]
        if kernel is not None:  # Ulysses is the ring of one group, so the kernel runs it too
            ways = {"ring": 1, "ulysses": split_ways("seq"), "usp": ulysses_ways}[mode]
            attention = functools.partial(context.usp_attention, ulysses=ways, kernel=kernel)
        return attention(q, constrain(k, kv_names), constrain(v, kv_names), mask.segment_ids, mask.positions,
                         window=mask.window, scale=scale)
    k, v = (constrain(x, ("batch", None, "act_kv_heads", None)) for x in (k, v))
    return attend(q, k, v, constrain(mask, ("batch", None, "seq", None)))


def causal_attention(q, k, v, mask, block: int, impl: str = "xla", scale: float = 0.0, softcap: float = 0.0):
    """Attention of q [B, T, N, D] over k, v [B, S, KV, D] under a causal `mask` [B, 1, T, S].

    block 0: one `jax.nn.dot_product_attention` call with `implementation=impl` ("xla" or "cudnn"; jax's own
    default, None, is XLA's kernel on every backend, GPUs included). block > 0: `blocked_attention`, query blocks of
    `block` positions; block i attends to keys [0, end of block i) only, so the blocks above the diagonal, which the
    mask zeroes, are never computed (4 blocks: 10/16 of the work). On XLA:CPU that is faster than the library call
    on the same blocks, whose grouped-query reshapes and vmap add copies (docs/performance.md). Equal up to float
    rounding; queries that see no key (padding) get a different, unused output. One block of plain autodiff
    (`attend`) when `block` does not divide T or the sequence is split over devices (slicing it would move the
    slices between them). `scale` multiplies the logits (0: head_dim^-0.5); `softcap` > 0 caps them
    (softcap * tanh(logits / softcap)), which jax's kernels lack: `attend` then runs, whatever the block."""
    t = q.shape[1]
    scale = scale or q.shape[-1] ** -0.5
    if softcap:
        k, v = _repeat_kv(k, v, q.shape[2])
        return attend(q, k, v, mask, scale, softcap)
    if block <= 0:
        if impl == "cudnn":  # is_causal lets cuDNN skip the blocks above the diagonal; the mask adds the documents.
            # Not on a sequence shard: its queries start mid-sequence, and the mask alone holds the causal offsets.
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=split_ways("seq") == 1,
                                                implementation="cudnn", scale=scale)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
    k, v = _repeat_kv(k, v, q.shape[2])
    if block >= t or t % block or split_ways("seq") > 1:
        return attend(q, k, v, mask, scale)
    return blocked_attention(q, k, v, mask, block, scale)


def _repeat_kv(k, v, n_heads: int):
    """Grouped-query attention: each kv head repeated for its query heads (query head n reads kv head n // groups);
    the backward sums the copies' gradients. A grouped 5-D einsum instead was slower on CPU."""
    groups = n_heads // k.shape[2]
    if groups == 1:
        return k, v
    return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def _f32(spec: str, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def masked_softmax(logits, mask, scale: float, softcap: float = 0.0):
    """Softmax of the scaled (and capped) f32 logits over the keys, masked logits set to -0.7 * float32 max."""
    scaled = logits * jnp.float32(scale)
    if softcap:
        scaled = jnp.float32(softcap) * jnp.tanh(scaled / jnp.float32(softcap))
    return jax.nn.softmax(jnp.where(mask, scaled, jnp.float32(_MASKED)), axis=-1)


def attend(q, k, v, mask, scale: float, softcap: float = 0.0):
    """Softmax attention over all of k, v (as many heads as q), the math of `jax.nn.dot_product_attention`'s XLA
    path: logits and softmax in f32 (`_probs`)."""
    probs = masked_softmax(_f32("btnd,bsnd->bnts", q, k), mask, scale, softcap)
    return _f32("bnts,bsnd->btnd", probs.astype(v.dtype), v).astype(q.dtype)


def _heads_major(x):
    """[B, T, N, D] <-> [B, N, T, D], laid out in memory."""
    return transposed_in_memory(x, (0, 2, 1, 3))


def _spans(t: int, block: int) -> list[tuple[int, int]]:
    return [(s, s + block) for s in range(0, t, block)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def blocked_attention(q, k, v, mask, block: int, scale: float):
    """`attend` in query blocks of `block` (dividing T) over as many kv heads as query heads, the blocks above the
    diagonal skipped. The backward keeps each block's softmax probabilities (f32) from the forward."""
    return _blocked_fwd(q, k, v, mask, block, scale)[0]


def _blocked_fwd(q, k, v, mask, block, scale):
    qh, kh, vh = _heads_major(q), _heads_major(k), _heads_major(v)
    outs, probs = [], []
    for s, e in _spans(q.shape[1], block):
        p = masked_softmax(_f32("bntd,bnsd->bnts", qh[:, :, s:e], kh[:, :, :e]), mask[:, :, s:e, :e], scale)
        outs.append(_f32("bnts,bnsd->bntd", p.astype(v.dtype), vh[:, :, :e]))
        probs.append(p)
    out = _heads_major(jnp.concatenate(outs, axis=2).astype(q.dtype))
    return out, (qh, kh, vh, mask, probs)


def _blocked_bwd(block, scale, res, g):
    qh, kh, vh, mask, probs = res
    gh = _heads_major(g.astype(vh.dtype))
    scale = jnp.float32(scale)
    spans = _spans(qh.shape[2], block)
    dq, dlogits = [], []
    for (s, e), p in zip(spans, probs):
        dp = _f32("bntd,bnsd->bnts", gh[:, :, s:e], vh[:, :, :e])
        # Softmax's backward; masked logits get none (rows that see no key have p > 0 there).
        dl = jnp.where(mask[:, :, s:e, :e], p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale, 0)
        dl = dl.astype(kh.dtype)
        dq.append(_f32("bnts,bnsd->bntd", dl, kh[:, :, :e]))
        dlogits.append(dl)
    # Keys [s, e) are read by the query blocks from s on: dK^T and dV^T of that key block are one matmul each over
    # those queries, with g and q transposed once ([B, N, D, T]) and the blocks' probabilities and logit gradients
    # sliced and stacked along the queries (plain copies, which XLA:CPU runs far faster than transposes:
    # docs/performance.md), and no sums.
    gt, qt = transposed_in_memory(gh, (0, 1, 3, 2)), transposed_in_memory(qh, (0, 1, 3, 2))
    dkt, dvt = [], []
    for j, (s, e) in enumerate(spans):
        p_j = jnp.concatenate([p[..., s:e].astype(vh.dtype) for p in probs[j:]], axis=2)
        dl_j = jnp.concatenate([dl[..., s:e] for dl in dlogits[j:]], axis=2)
        dvt.append(_f32("bndt,bnts->bnds", gt[..., s:], p_j))
        dkt.append(_f32("bndt,bnts->bnds", qt[..., s:], dl_j))
    dq = _heads_major(jnp.concatenate(dq, axis=2).astype(qh.dtype))
    dk, dv = (transposed_in_memory(jnp.concatenate(parts, axis=3).astype(kh.dtype), (0, 3, 1, 2))  # -> [B, T, N, D]
              for parts in (dkt, dvt))
    return dq, dk, dv, None


blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)
