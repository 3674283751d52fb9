"""Output projection fused with the cross-entropy, in chunks along the sequence.

`linear_cross_entropy(x, w, targets, weights, chunk_tokens, dtype)` is sum_t weights_t * CE(x_t @ w, targets_t),
computed a chunk of sequence positions at a time (about `chunk_tokens` tokens per device), so the [B, T, vocab]
logits never exist whole. The gradient is computed in the same pass (weights * (softmax - one-hot) is known as soon
as the chunk's logsumexp is) and the backward only scales it by the incoming cotangent: no matmul is recomputed,
the FLOPs are the unfused head's, and each chunk's logits are used while they are still in cache. On the 2-core
CPU the unfused head's [2048, 32000] logits are 8x the L3 cache and its matmuls run at ~2/3 of the speed they reach
on cache-sized chunks (BUILD.md, performance notes).

Chunk k holds positions k, k + n, k + 2n, ... (n chunks): strided, so a sequence split over the `sequence` mesh
axis stays split inside every chunk. Under `jax.grad` the forward also produces dL/dx and dL/dw (one extra
[d, vocab] f32 buffer); a plain call (eval) computes the loss only. Targets and weights get no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.mesh import constrain, split_ways


def _chunks(a, n: int):
    """[B, T, ...] -> [n, B, T/n, ...]: chunk k holds positions k, k + n, ..."""
    b, t = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, t // n, n, *a.shape[2:]), 2, 0)


def _unchunk(a):
    """Inverse of `_chunks`."""
    n, b, c = a.shape[:3]
    return jnp.moveaxis(a, 0, 2).reshape(b, c * n, *a.shape[3:])


def _chunk_logits(x, w):
    """[B, C, d] @ [d, V] -> f32 [B, C, V], the matmul in w's (compute) dtype with f32 results."""
    b, c, d = x.shape
    logits = jnp.dot(x.reshape(b * c, d).astype(w.dtype), w, preferred_element_type=jnp.float32)
    return constrain(logits.reshape(b, c, -1), ("batch", "seq", "act_vocab"))


def _chunk_loss(logits, targets, weights):
    """Summed weighted CE of one chunk, and the logsumexp [B, C]."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(weights * (lse - target_logit)), lse


def n_chunks(batch: int, t: int, chunk_tokens: int) -> int:
    """How many chunks the sequence splits into so that one chunk holds at most `chunk_tokens` tokens per device
    (the batch is split over `split_ways("batch")` devices), with every chunk the same length (a divisor of t)."""
    positions = max(chunk_tokens * split_ways("seq") // max(batch // split_ways("batch"), 1), 1)
    if chunk_tokens <= 0 or positions >= t:
        return 1
    return t // max(c for c in range(1, positions + 1) if t % c == 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def linear_cross_entropy(x, w, targets, weights, chunk_tokens: int, dtype):
    """x: [B, T, d] final hidden states, w: [d, V] output projection, targets: int [B, T], weights: f32 [B, T].
    Returns the f32 sum over positions of weights * cross-entropy of softmax(x @ w) against targets, computing
    about `chunk_tokens` tokens per device at a time (0 = all at once). The matmuls run in `dtype`, f32 results."""
    n = n_chunks(x.shape[0], x.shape[1], chunk_tokens)
    w_dt = w.astype(dtype)  # cast once, not per chunk

    def body(total, xs):
        x_c, t_c, w_c = xs
        return total + _chunk_loss(_chunk_logits(x_c, w_dt), t_c, w_c)[0], None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (_chunks(x, n), _chunks(targets, n), _chunks(weights, n)))
    return total


def _fwd(x, w, targets, weights, chunk_tokens, dtype):
    n = n_chunks(x.shape[0], x.shape[1], chunk_tokens)
    w_dt = w.astype(dtype)  # cast once, not per chunk
    # dW is summed over every token, and the tokens are split over the batch's `shards` devices. Each device sums
    # its own tokens' share into its slice of a [shards, d, V] accumulator, reduced once after the last chunk: a
    # plain [d, V] sum would make XLA reduce it across devices after every chunk (n times the gradient traffic).
    shards = split_ways("batch")

    def body(carry, xs):
        total, dw = carry
        x_c, x_t, t_c, wt_c = xs
        logits = _chunk_logits(x_c, w_dt)
        loss, lse = _chunk_loss(logits, t_c, wt_c)
        # d(loss)/d(logits) = weights * (softmax - one_hot), one fused pass over the chunk's logits.
        is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t_c[..., None]
        dlogits = wt_c[..., None] * (jnp.exp(logits - lse[..., None]) - is_target)
        dlogits = constrain(dlogits.astype(dtype), ("batch", "seq", "act_vocab"))
        b, c, v = dlogits.shape
        dx_c = jnp.dot(dlogits.reshape(b * c, v), w_dt.T, preferred_element_type=jnp.float32).reshape(b, c, -1)
        per_shard = constrain(dlogits.reshape(shards, b // shards * c, v), ("batch", None, "act_vocab"))
        dw = dw + jax.lax.dot_general(x_t, per_shard, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        return (total + loss, constrain(dw, ("batch", None, "act_vocab"))), dx_c.astype(x.dtype)

    init = (jnp.zeros((), jnp.float32), jnp.zeros((shards, *w.shape), jnp.float32))
    x_chunks = _chunks(x, n)
    # [n, shards, d, tokens]: dW's matmul reads x transposed; transposed once here it is a row-major matmul
    # (XLA:CPU ran the transposed-operand form ~25% slower).
    b, c, d = x_chunks.shape[1:]
    x_t = jnp.swapaxes(x_chunks.reshape(n, shards, b // shards * c, d), 2, 3).astype(dtype)
    x_t = constrain(x_t, (None, "batch"))
    (total, dw), dx = jax.lax.scan(body, init, (x_chunks, x_t, _chunks(targets, n), _chunks(weights, n)))
    return total, (_unchunk(dx), dw.sum(0).astype(w.dtype))


def _bwd(chunk_tokens, dtype, res, g):
    del chunk_tokens, dtype
    dx, dw = res
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None


linear_cross_entropy.defvjp(_fwd, _bwd)
