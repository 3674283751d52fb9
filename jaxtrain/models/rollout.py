"""Batched rollouts for RL (GRPO): sampling on the training mesh with the trainer's own parameters, no copy.

`make_sampler(...)(params, prompts, step=...)` prefills every prompt, then decodes with the K/V cache in one jitted
`lax.while_loop`, activations and cache split over the batch and tensor axes as in training. Prompts of different
lengths share one compile per (rows, max_prompt_tokens + max_new_tokens): each is left-padded to max_prompt_tokens
and `Transformer.decode(left_pad=...)` hides the padding and shifts RoPE, so a row computes what it would alone.
The loop ends once every row has drawn a stop id (rows run in lockstep until then). Row r of step s draws its i-th
token with fold_in(fold_in(fold_in(key(seed), s), r), i): a resumed run samples the same completions, and a row's
completion does not depend on the other rows. Log-probs are log_softmax(logits / temperature) of the drawn token,
before top-k and top-p (temperature 1 when greedy): what the trainer recomputes from its logits / temperature.
`Rollouts` is the trainer's right-padded layout; `Sampler` is the interface another engine (vLLM) would implement.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.models import sampling
from jaxtrain.parallel import mesh as mesh_lib


# (model, mesh, rules, max_new_tokens, argument signature) -> the compiled rollout (MeshSampler._executable).
_EXECUTABLES: dict = {}


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """N rows, each one prompt then its completion then 0 padding, T long (the training layout).
    `log_probs[r, i]`: the sampler's log-prob of tokens[r, i + 1] where that is a completion token, else 0 (the
    layout of objectives.token_log_probs). `completions`: each row's ids, its stop id included if drawn;
    `truncated`: reached max_new_tokens without one. `seconds`: the sampling's wall time (compiles excluded)."""
    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_weights: np.ndarray
    log_probs: np.ndarray
    completions: list[list[int]]
    truncated: np.ndarray
    seconds: float
    new_tokens: int

    def batch(self) -> dict[str, np.ndarray]:
        """The model's inputs and the loss weights, as a training batch."""
        return {"tokens": self.tokens, "positions": self.positions, "segment_ids": self.segment_ids,
                "loss_weights": self.loss_weights}

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


def end_at_strings(out: Rollouts, decode, stops: Sequence[str]) -> Rollouts:
    """`out` with each completion ended at the end of its first stop string (its text `decode(ids)`): the token
    that completes it is the completion's last, the rest of the row padding, and the row no longer truncated. The
    sampler decoded past it (stop strings end a completion for training, not the decode)."""
    if not stops:
        return out
    tokens, positions, segments, weights, log_probs = (np.array(a) for a in (
        out.tokens, out.positions, out.segment_ids, out.loss_weights, out.log_probs))
    completions, truncated = [list(c) for c in out.completions], np.array(out.truncated)
    for r, ids in enumerate(completions):
        if not any(s in decode(ids) for s in stops):
            continue
        lo, hi = 1, len(ids)  # the fewest tokens whose text holds the first stop string whole
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if any(s in decode(ids[:mid]) for s in stops) else (mid + 1, hi)
        end = int(segments[r].sum()) - (len(ids) - lo)  # the row's length with `lo` completion tokens
        for a in (tokens, positions, segments, weights):
            a[r, end:] = 0
        log_probs[r, end - 1:] = 0
        completions[r], truncated[r] = ids[:lo], False
    return dataclasses.replace(out, tokens=tokens, positions=positions, segment_ids=segments, loss_weights=weights,
                               log_probs=log_probs, completions=completions, truncated=truncated)


class Sampler(Protocol):
    """What a rollout engine implements: completions of `prompts` (token ids) under `params`, whose randomness is a
    function of (seed, step, row)."""

    def __call__(self, params, prompts: Sequence[Sequence[int]], *, step: int) -> Rollouts: ...


def make_sampler(graphdef, mesh, rules, *, max_prompt_tokens: int, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] = (), seed: int = 0) -> Sampler:
    """A Sampler for the model `graphdef` on `mesh` under the logical axis `rules` (the trainer's). Its params are
    used as they are placed (the trainer's state["params"]); rows are split over the batch axes, and padded with
    idle rows to a multiple of them. Settings as `sampling.generate`."""
    sampling.check_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    if max_prompt_tokens < 1 or max_new_tokens < 1:
        raise ValueError(f"max_prompt_tokens and max_new_tokens: must be >= 1, got {max_prompt_tokens}, "
                         f"{max_new_tokens}")
    return MeshSampler(graphdef, mesh, mesh_lib.resolve_rules(rules), max_prompt_tokens, max_new_tokens,
                       float(temperature), int(top_k), float(top_p), tuple(int(t) for t in stop_ids), int(seed))


@dataclasses.dataclass(eq=False)
class MeshSampler:
    """`make_sampler`'s Sampler: this process's jitted rollout on the training mesh."""
    graphdef: object
    mesh: object
    rules: dict
    max_prompt_tokens: int
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: tuple[int, ...]
    seed: int

    def __call__(self, params, prompts: Sequence[Sequence[int]], *, step: int) -> Rollouts:
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            raise ValueError("prompts: none given")
        for r, p in enumerate(prompts):
            if not 1 <= len(p) <= self.max_prompt_tokens:
                raise ValueError(f"prompts[{r}]: {len(p)} tokens; a prompt needs 1 to max_prompt_tokens "
                                 f"({self.max_prompt_tokens})")
        ways = mesh_lib.axis_ways(self.mesh.shape, self.rules, "batch")
        n = -(-len(prompts) // ways) * ways  # idle rows fill the last split
        tokens = np.zeros((n, self.max_prompt_tokens), np.int32)
        left_pad = np.full(n, self.max_prompt_tokens - 1, np.int32)
        for r, p in enumerate(prompts):
            tokens[r, self.max_prompt_tokens - len(p):] = p
            left_pad[r] = self.max_prompt_tokens - len(p)
        rows = mesh_lib.batch_sharding(self.mesh, self.rules)
        place = lambda x: jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, P(*rows.spec[:x.ndim])),
                                                       lambda index: x[index])  # noqa: E731
        args = (params, place(tokens), place(left_pad), place(np.arange(n) < len(prompts)), np.uint32(self.seed),
                np.uint32(step), np.float32(self.temperature), np.int32(self.top_k), np.float32(self.top_p),
                stop_array(self.stop_ids))
        run = self._executable(args)
        jax.block_until_ready(params)  # the weights may still be the previous train step's output in flight
        start = time.perf_counter()
        ids, log_probs = jax.device_get(run(*args))
        seconds = time.perf_counter() - start
        return self._layout(prompts, ids[:len(prompts)], log_probs[:len(prompts)], seconds)

    def _executable(self, args):
        """The rollout compiled for these arguments' shapes and placements, outside the timing. The sampling settings
        are arguments: samplers of one model, mesh and max_new_tokens share it."""
        key = (self.graphdef, self.mesh, tuple(sorted(self.rules.items())), self.max_new_tokens,
               jax.tree.structure(args),
               tuple((np.shape(x), x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(args)))
        if key not in _EXECUTABLES:
            if len(_EXECUTABLES) >= 32:  # a bound on memory (what was cleared recompiles)
                _EXECUTABLES.clear()
            run = jax.jit(functools.partial(rollout, self.graphdef, max_new_tokens=self.max_new_tokens),
                          out_shardings=NamedSharding(self.mesh, P()))
            with mesh_lib.activation_sharding(self.mesh, self.rules):
                _EXECUTABLES[key] = run.lower(*args).compile()
        return _EXECUTABLES[key]

    def _layout(self, prompts, ids, log_probs, seconds) -> Rollouts:
        """The right-padded training layout of each prompt and its completion (ids -1 past a row's end)."""
        n, t = len(prompts), self.max_prompt_tokens + self.max_new_tokens
        out = {name: np.zeros((n, t), dtype) for name, dtype in (
            ("tokens", np.int32), ("segment_ids", np.int32), ("loss_weights", np.float32), ("log_probs", np.float32))}
        completions, truncated = [], np.zeros(n, bool)
        for r, (prompt, row) in enumerate(zip(prompts, ids)):
            count = int(np.sum(row >= 0))
            completion = row[:count].tolist()
            p, end = len(prompt), len(prompt) + count
            out["tokens"][r, :end] = prompt + completion
            out["segment_ids"][r, :end] = 1
            out["loss_weights"][r, p:end] = 1
            out["log_probs"][r, p - 1:end - 1] = log_probs[r, :count]
            truncated[r] = not (completion and completion[-1] in self.stop_ids)
            completions.append(completion)
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy()
        return Rollouts(positions=positions, completions=completions, truncated=truncated, seconds=seconds,
                        new_tokens=sum(map(len, completions)), **out)


def stop_array(stop_ids: Sequence[int]) -> np.ndarray:
    """The stop ids padded with -1 (never drawn) to a multiple of 8: samplers with up to 8 share a compile."""
    out = np.full(-(-max(len(stop_ids), 1) // 8) * 8, -1, np.int32)
    out[:len(stop_ids)] = stop_ids
    return out


def rollout(graphdef, params, tokens, left_pad, active, seed, step, temperature, top_k, top_p, stop_ids, *,
            max_new_tokens: int):
    """tokens [N, P]: prompts left-padded by left_pad [N]; active [N]: the rows that sample (others are filler).
    Returns (ids [N, max_new_tokens], -1 after a row's stop id; their log-probs [N, max_new_tokens], 0 there)."""
    model = nnx.merge(graphdef, params)
    n, prompt_len = tokens.shape
    keys = jax.vmap(functools.partial(jax.random.fold_in, jax.random.fold_in(jax.random.key(seed), step)))(
        jnp.arange(n, dtype=jnp.uint32))
    # Greedy draws' log-probs are at temperature 1: log_softmax(logits), what the trainer computes.
    scale = jnp.where(temperature > 0, temperature, 1.0)

    def draw(i, logits):
        logits = logits.astype(jnp.float32)
        ids = jax.vmap(lambda row, key: sampling.sample_logits(
            row[None], jax.random.fold_in(key, i), temperature, top_k, top_p)[0])(logits, keys)
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits / scale, axis=-1), ids[:, None], -1)[:, 0]
        return ids, log_probs

    def stops(ids):
        return jnp.any(ids[:, None] == stop_ids[None, :], axis=-1)

    cache = model.init_cache(n, prompt_len + max_new_tokens)
    logits, cache = model.decode(tokens, cache, 0, left_pad=left_pad)
    token, log_prob = draw(0, logits)
    ids = jnp.full((n, max_new_tokens), -1, jnp.int32).at[:, 0].set(token)
    log_probs = jnp.zeros((n, max_new_tokens), jnp.float32).at[:, 0].set(log_prob)

    def running(carry):
        i, _, done, *_ = carry
        return (i + 1 < max_new_tokens) & ~jnp.all(done)

    def step_fn(carry):
        i, token, done, cache, ids, log_probs = carry  # token i is drawn, not yet run through the model
        logits, cache = model.decode(token[:, None], cache, prompt_len + i, left_pad=left_pad)
        token, log_prob = draw(i + 1, logits)
        ids = ids.at[:, i + 1].set(jnp.where(done, -1, token))
        log_probs = log_probs.at[:, i + 1].set(jnp.where(done, 0.0, log_prob))
        return i + 1, token, done | stops(token), cache, ids, log_probs

    carry = (jnp.int32(0), token, stops(token) | ~active, cache, ids, log_probs)
    return jax.lax.while_loop(running, step_fn, carry)[-2:]
