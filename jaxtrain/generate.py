"""Sampling from a trained model.

For now this recomputes the whole window per token (one fixed-shape jit, fine for the short sample a
run prints at the end). KV-cache decoding arrives with the generation CLI.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def make_next_token_fn(graphdef, window: int):
    @jax.jit
    def next_token(params, tokens, length, key, temperature, top_k):
        """tokens: int32 [window], the first `length` real. Returns the sampled id at position `length`."""
        positions = jnp.arange(window, dtype=jnp.int32)
        segment_ids = (positions < length).astype(jnp.int32)
        logits = nnx.merge(graphdef, params)(tokens[None], positions[None], segment_ids[None])[0, length - 1]
        logits = logits.astype(jnp.float32)
        kth = jnp.sort(logits)[::-1][jnp.clip(top_k - 1, 0, logits.shape[0] - 1)]
        logits = jnp.where((top_k > 0) & (logits < kth), -jnp.inf, logits)
        greedy = jnp.argmax(logits)
        sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)

    return next_token


def sample(graphdef, params, prompt_ids: list[int], *, window: int, max_new_tokens: int, temperature: float,
           top_k: int, seed: int, stop_id: int | None = None) -> list[int]:
    """Returns the generated ids (prompt excluded). Keeps the last `window` tokens as context."""
    next_token = make_next_token_fn(graphdef, window)
    ids = list(prompt_ids)
    out = []
    key = jax.random.key(seed)
    for _ in range(max_new_tokens):
        ctx = ids[-window:]
        buf = np.zeros(window, np.int32)
        buf[:len(ctx)] = ctx
        key, sub = jax.random.split(key)
        tok = int(next_token(params, buf, len(ctx), sub, float(temperature), int(top_k)))
        if tok == stop_id:
            break
        ids.append(tok)
        out.append(tok)
    return out
