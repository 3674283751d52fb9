"""Output projection fused with the cross-entropy, in chunks along the sequence.

`linear_cross_entropy(x, w, targets, weights, chunk_tokens, dtype)` is sum_t weights_t * CE(x_t @ w, targets_t),
computed a chunk of sequence positions at a time (about `chunk_tokens` tokens per device), so the [B, T, vocab]
logits never exist whole. The gradient is computed in the same pass (weights * (softmax - one-hot) is known as soon
as the chunk's logsumexp is) and the backward only scales it by the incoming cotangent: no matmul is recomputed,
the FLOPs are the unfused head's, and each chunk's logits are used while they are still in cache: on a CPU a
matmul whose output outgrows the L3 cache runs markedly slower than on cache-sized chunks (docs/performance.md).

`token_log_probs` gives each token's log-probability instead (DPO sums them per sequence), chunked the same way.

Chunk k holds positions k, k + n, k + 2n, ... (n chunks): strided, so a sequence split over the `sequence` mesh
axis stays split inside every chunk. Under `jax.grad` the forward also produces dL/dx and dL/dw (one extra
[d, vocab] f32 buffer); a plain call (eval) computes the loss only. Targets and weights get no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.parallel.mesh import constrain, split_ways
from jaxtrain.models import cpu_bf16
from jaxtrain.models.layers import project, sum_in


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
    return constrain(project(x.astype(w.dtype), w, preferred_element_type=jnp.float32), ("batch", "seq", "act_vocab"))


def _by_shard(a, batch_ways: int, seq_ways: int, tokens_last: bool = False, f_name: str | None = None):
    """[B, C, f] -> [batch_ways, seq_ways, tokens, f] (or [..., f, tokens]): each device's tokens, grouped under the
    (batch shard, sequence shard) it holds, so that dW is summed on every device apart. A local reshuffle (the
    leading dims are 1 per device); merging batch and sequence directly would gather the sequence. `f_name`: the
    logical name of f (tokens first only)."""
    b, c, f = a.shape
    a = a.reshape(batch_ways, b // batch_ways, seq_ways, c // seq_ways, f)
    a = jnp.transpose(a, (0, 2, 4, 1, 3) if tokens_last else (0, 2, 1, 3, 4))
    shape = (f, -1) if tokens_last else (-1, f)
    return constrain(a.reshape(batch_ways, seq_ways, *shape), ("batch", "seq") if tokens_last else
                     ("batch", "seq", None, f_name))


def _gathered_once(w, dtype):
    """w [d, V] cast to `dtype` and gathered over the axes FSDP splits d_model on, once, before the chunk loop. Left
    to XLA, XLA:GPU put the gather inside the loop: every chunk gathered the head again for its logits and for its dx
    (docs/planning.md)."""
    return constrain(w.astype(dtype), (None, "vocab"))


def _chunk_loss(logits, targets, weights):
    """Summed weighted CE of one chunk, and the logsumexp [B, C]."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(weights * (lse - target_logit)), lse


def n_chunks(batch: int, t: int, chunk_tokens: int, batch_ways: int | None = None, seq_ways: int | None = None) -> int:
    """How many chunks the sequence splits into so that one chunk holds at most `chunk_tokens` tokens per device
    (the batch is split over `batch_ways` devices, the sequence over `seq_ways`; default: as the active rules
    split them), with every chunk the same length (a divisor of t, and a multiple of seq_ways)."""
    batch_ways = split_ways("batch") if batch_ways is None else batch_ways
    seq_ways = split_ways("seq") if seq_ways is None else seq_ways  # divides t (config validation)
    positions = max(chunk_tokens * seq_ways // max(batch // batch_ways, 1), seq_ways)
    if chunk_tokens <= 0 or positions >= t:
        return 1
    return t // max(c for c in range(seq_ways, positions + 1, seq_ways) if t % c == 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def linear_cross_entropy(x, w, targets, weights, chunk_tokens: int, dtype, grad_dtype="float32"):
    """x: [B, T, d] final hidden states, w: [d, V] output projection, targets: int [B, T], weights: f32 [B, T].
    Returns the f32 sum over positions of weights * cross-entropy of softmax(x @ w) against targets, computing
    about `chunk_tokens` tokens per device at a time (0 = all at once). The matmuls run in `dtype`, f32 results.
    w's gradient is reduced over the batch and sequence shards in `grad_dtype` (optim.grad_reduce_dtype)."""
    n = n_chunks(x.shape[0], x.shape[1], chunk_tokens)
    w_dt = _gathered_once(w, dtype)

    def body(total, xs):
        x_c, t_c, w_c = xs
        return total + _chunk_loss(_chunk_logits(x_c, w_dt), t_c, w_c)[0], None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (_chunks(x, n), _chunks(targets, n), _chunks(weights, n)))
    return total


def _fwd(x, w, targets, weights, chunk_tokens, dtype, grad_dtype):
    n = n_chunks(x.shape[0], x.shape[1], chunk_tokens)
    w_dt = _gathered_once(w, dtype)
    # dW is summed over every token, and the tokens are split over devices along the batch and the sequence. Each
    # device sums its own tokens' share into its slice of a [batch ways, seq ways, d, V] accumulator, reduced once
    # after the last chunk: a plain [d, V] sum would make XLA reduce it across devices after every chunk (n times
    # the gradient traffic).
    ways = split_ways("batch"), split_ways("seq")
    # dx's matmul reads w transposed, which XLA:CPU computes in f32 for bf16 operands: transpose it once instead.
    w_t = cpu_bf16.transposed_in_memory(w_dt) if cpu_bf16.applies(w_dt) else w_dt.T

    def body(carry, xs):
        total, dw = carry
        x_c, x_t, t_c, wt_c = xs
        logits = _chunk_logits(x_c, w_dt)
        loss, lse = _chunk_loss(logits, t_c, wt_c)
        # d(loss)/d(logits) = weights * (softmax - one_hot), one fused pass over the chunk's logits.
        is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t_c[..., None]
        dlogits = wt_c[..., None] * (jnp.exp(logits - lse[..., None]) - is_target)
        dlogits = constrain(cpu_bf16.cast(dlogits, dtype), ("batch", "seq", "act_vocab"))
        dx_c = project(dlogits, w_t, preferred_element_type=jnp.float32)
        per_shard = _by_shard(dlogits, *ways, f_name="act_vocab")
        dw = dw + jax.lax.dot_general(x_t, per_shard, (((3,), (2,)), ((0, 1), (0, 1))),
                                      preferred_element_type=jnp.float32)
        return (total + loss, constrain(dw, ("batch", "seq", None, "act_vocab"))), dx_c.astype(x.dtype)

    init = (jnp.zeros((), jnp.float32), jnp.zeros((*ways, *w.shape), jnp.float32))
    x_chunks = _chunks(x, n)
    # [n, batch ways, seq ways, d, tokens]: dW's matmul reads x transposed; transposed once here it is a row-major
    # matmul (XLA:CPU runs the transposed-operand form slower: docs/performance.md).
    x_t = jax.vmap(lambda a: _by_shard(a.astype(dtype), *ways, tokens_last=True))(x_chunks)
    (total, dw), dx = jax.lax.scan(body, init, (x_chunks, x_t, _chunks(targets, n), _chunks(weights, n)))
    # Over the batch shards first, into w's layout (a reduce-scatter over fsdp, the rest of the batch axes then
    # reduce the shard), then over the sequence shards, the shard only.
    dw = sum_in(constrain(sum_in(dw, 0, grad_dtype), ("seq", "embed", "vocab")), 0, grad_dtype)
    return total, (_unchunk(dx), dw.astype(w.dtype))


def _bwd(chunk_tokens, dtype, grad_dtype, res, g):
    del chunk_tokens, dtype, grad_dtype
    dx, dw = res
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None


linear_cross_entropy.defvjp(_fwd, _bwd)


def token_log_probs(x, w, targets, chunk_tokens: int, dtype):
    """log softmax(x @ w)[targets], f32 [B, T], about `chunk_tokens` tokens per device at a time (0 = all at
    once): each token's own log-probability, which DPO sums per sequence. Not fused with its gradient (that
    needs the per-token cotangents, known only after the pair losses): the backward recomputes each chunk's
    logits instead of keeping [B, T, vocab]."""
    n = n_chunks(x.shape[0], x.shape[1], chunk_tokens)
    w_dt = _gathered_once(w, dtype)

    @jax.checkpoint
    def chunk(w_dt, x_c, t_c):
        logits = _chunk_logits(x_c, w_dt)
        target_logit = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
        return target_logit - jax.nn.logsumexp(logits, axis=-1)

    return _unchunk(jax.lax.map(lambda xs: chunk(w_dt, *xs), (_chunks(x, n), _chunks(targets, n))))
