"""Sampling from a trained model with a K/V cache (`jaxtrain generate` is its command line).

The prompt is prefilled in one jitted call, padded to the cache length so prompts of different lengths share a
compile; one jitted `lax.while_loop` then samples the new tokens, stopping once every sample has produced a
stop id. Sampling settings are traced values and never recompile. `window` (the trained seq_len) bounds the
cache: past it the cache slides, each new token attending to the newest `window` tokens, and RoPE never sees a
distance longer than training did. Temperature 0 is greedy; otherwise softmax(logits / temperature) restricted
to the top_k ids, then to the smallest set whose probability reaches top_p. New token i draws with
`fold_in(key(seed), i)`: the same seed gives the same text (docs/experiments.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.fields import Group

# The config's `sample` group: a sample of text printed at the end of a run (max_new_tokens 0 = none).
CONFIG = dict(prompt="And God said", max_new_tokens=40, temperature=0.8, top_k=40)
# Cache lengths are rounded up to a multiple of this (up to the window) so nearby lengths share a compile.
CACHE_BUCKET = 64


def sample_logits(logits, key, temperature, top_k, top_p):
    """Next ids [B] int32 from logits [B, V]; see the module docstring for the rule."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ranked = -jnp.sort(-scaled, axis=-1)  # most likely first
    # Ties with the k-th id stay: which of equal logits to drop would be arbitrary.
    kth = jnp.where(top_k > 0, ranked[:, jnp.clip(top_k - 1, 0, vocab - 1)], -jnp.inf)
    ranked = jnp.where(ranked >= kth[:, None], ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    # An id stays while the mass before it is below top_p, so the most likely one always stays; 1.0 is
    # exactly "off" (a float cumsum may reach 1 before the tail and would cut it).
    kept = (jnp.cumsum(probs, axis=-1) - probs < top_p) | (top_p >= 1.0)
    cutoff = jnp.maximum(jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1), kth)
    filtered = jnp.where(scaled >= cutoff[:, None], scaled, -jnp.inf)
    sampled = jax.random.categorical(key, filtered, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def prefill(graphdef, params, tokens, prompt_len):
    """tokens [B, L]: prompts padded to the cache length L, the first `prompt_len` real.

    Returns (logits after the prompt [B, V], cache). The padding's K/V land in slots that decoding
    overwrites before any query can see them."""
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(*tokens.shape)
    return model.decode(tokens, cache, 0, last_index=prompt_len - 1)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_samples", "max_new_tokens"))
def decode(graphdef, params, logits, cache, prompt_len, key, temperature, top_k, top_p, stop_id, *,
           num_samples: int, max_new_tokens: int):
    """Samples `max_new_tokens` ids per sample from a prefill of one prompt (batch 1, broadcast here).

    Returns ids [num_samples, max_new_tokens]. The loop ends once every sample has drawn `stop_id` (a scalar,
    or [S] ids any of which stops) and leaves the rest -1; samples run in lockstep, so one that stopped
    earlier keeps drawing: cut each at its first stop id."""
    model = nnx.merge(graphdef, params)
    stop_ids = jnp.atleast_1d(stop_id)

    def stops(token):
        return jnp.any(token[:, None] == stop_ids[None, :], axis=-1)

    logits = jnp.broadcast_to(logits, (num_samples, logits.shape[-1]))
    cache = jax.tree.map(lambda c: jnp.broadcast_to(c, (c.shape[0], num_samples, *c.shape[2:])), cache)

    def draw(i, logits):
        return sample_logits(logits, jax.random.fold_in(key, i), temperature, top_k, top_p)

    first = draw(0, logits)
    out = jnp.full((num_samples, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)

    def running(carry):
        i, _, done, _, _ = carry
        return (i + 1 < max_new_tokens) & ~jnp.all(done)

    def step(carry):
        i, token, done, cache, out = carry  # token i is drawn but not yet run through the model
        logits, cache = model.decode(token[:, None], cache, prompt_len + i)
        token = draw(i + 1, logits)
        return i + 1, token, done | stops(token), cache, out.at[:, i + 1].set(token)

    carry = (jnp.int32(0), first, stops(first), cache, out)
    return jax.lax.while_loop(running, step, carry)[-1]


def check_settings(*, max_new_tokens, temperature, top_k, top_p, num_samples=1, window=1):
    """Raises ValueError('<name>: <reason>') for a setting outside its range (NaN included)."""
    checks = [("max_new_tokens", max_new_tokens, max_new_tokens >= 0, "must be >= 0"),
              ("temperature", temperature, temperature >= 0, "must be >= 0 (0: greedy)"),
              ("top_k", top_k, top_k >= 0, "must be >= 0 (0: off)"),
              ("top_p", top_p, 0 < top_p <= 1, "must be in (0, 1] (1: off)"),
              ("num_samples", num_samples, num_samples >= 1, "must be >= 1"),
              ("window", window, window >= 1, "must be >= 1")]
    for name, value, ok, reason in checks:
        if not ok:
            raise ValueError(f"{name}: {reason}, got {value}")


def cache_length(prompt_len: int, max_new_tokens: int, window: int) -> int:
    """The K/V cache `generate` decodes with: the prompt and the new tokens, rounded up to CACHE_BUCKET (fewer
    compiles), at most `window`."""
    return min(window, -(-(min(prompt_len, window) + max_new_tokens) // CACHE_BUCKET) * CACHE_BUCKET)


def generate(graphdef, params, prompt_ids: list[int], *, window: int, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_id: int | Sequence[int] | None = None, num_samples: int = 1,
             keep_stop: bool = False) -> list[list[int]]:
    """`num_samples` continuations of one prompt: the generated ids of each, prompt excluded. Each ends at
    its first `stop_id` (one id, or any of several), which is left out unless `keep_stop` (as transformers'
    `generate` returns it)."""
    check_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   num_samples=num_samples, window=window)
    if not prompt_ids:
        raise ValueError("prompt: empty; the model needs at least one token to continue")
    if max_new_tokens == 0:
        return [[] for _ in range(num_samples)]
    prompt = list(prompt_ids)[-window:]
    cache_len = cache_length(len(prompt), max_new_tokens, window)
    tokens = np.zeros((1, cache_len), np.int32)
    tokens[0, :len(prompt)] = prompt
    stops = [] if stop_id is None else [int(stop_id)] if np.ndim(stop_id) == 0 else [int(t) for t in stop_id]

    logits, cache = prefill(graphdef, params, tokens, np.int32(len(prompt)))
    ids = decode(graphdef, params, logits, cache, np.int32(len(prompt)), jax.random.key(seed),
                 np.float32(temperature), np.int32(top_k), np.float32(top_p),
                 np.asarray(stops or [-1], np.int32), num_samples=num_samples, max_new_tokens=max_new_tokens)
    samples = []
    for row in np.asarray(ids).tolist():
        end = next((i for i, t in enumerate(row) if t == -1 or t in stops), len(row))
        samples.append(row[:end + 1] if keep_stop and end < len(row) and row[end] != -1 else row[:end])
    return samples


def sample(graphdef, params, prompt_ids: list[int], *, window: int, max_new_tokens: int, temperature: float,
           top_k: int, seed: int, stop_id: int | None = None, top_p: float = 1.0) -> list[int]:
    """The generated ids of one continuation (prompt and stop id excluded)."""
    return generate(graphdef, params, prompt_ids, window=window, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_id=stop_id)[0]


def check_config(sample) -> None:
    g = Group(sample, "sample")
    g.positive_int("max_new_tokens", allow_zero=True)
    g.number("temperature", lo=0)
    g.positive_int("top_k", allow_zero=True)
