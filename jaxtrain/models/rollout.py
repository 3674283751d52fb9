"""Batched rollouts for RL (GRPO): sampling on the training mesh with the trainer's own parameters, no copy.

`make_sampler(...)(params, prompts, step=...)` prefills every prompt, then decodes with the K/V cache in a jitted
`lax.while_loop`, activations and cache split over the batch and tensor axes as in training. Prompts of different
lengths share one compile per (rows, max_prompt_tokens + max_new_tokens): each is left-padded to max_prompt_tokens
and `Transformer.decode(left_pad=...)` hides the padding and shifts RoPE, so a row computes what it would alone.
Finished rows stop costing compute: once at most half the batch (rounded up to whole batch shards) is live, the
loop returns and the live rows' state (cache, last token, ...) is gathered into a batch that size, and so on down
to one row per shard; each size compiles once. Row r of step s draws its i-th token with
fold_in(fold_in(fold_in(key(seed), s), r), i), r its place in the rollout: a resumed run samples the same
completions, and a row's completion does not depend on the other rows nor on the compaction. Log-probs are
log_softmax(logits / temperature) of the drawn token, before top-k and top-p (temperature 1 when greedy): what the
trainer recomputes. `Rollouts` is the trainer's layout; `Sampler` the interface another engine (vLLM) would implement.
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


# (function, model, mesh, rules, max_new_tokens, argument signature) -> its executable (MeshSampler._call).
_EXECUTABLES: dict = {}


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """N rows, each one prompt then its completion then 0 padding, T long (the training layout).
    `log_probs[r, i]`: the sampler's log-prob of tokens[r, i + 1] where that is a completion token, else 0 (the
    layout of objectives.token_log_probs). `completions`: each row's ids, its stop id included if drawn;
    `truncated`: reached max_new_tokens without one. `seconds`: the sampling's wall time (compiles excluded).
    `decode_row_steps`: rows run through the model in the decode loop, summed over its steps (filler rows
    included); `lockstep_row_steps`: the same had every row run until the last was done. `entropy`: the mean
    entropy of softmax(logits / temperature) over the sampled tokens (before top-k and top-p)."""
    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_weights: np.ndarray
    log_probs: np.ndarray
    completions: list[list[int]]
    truncated: np.ndarray
    seconds: float
    new_tokens: int
    decode_row_steps: int = 0
    lockstep_row_steps: int = 0
    entropy: float = 0.0

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
                 top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] = (), seed: int = 0,
                 compact: bool = True) -> Sampler:
    """A Sampler for the model `graphdef` on `mesh` under the logical axis `rules` (the trainer's). Its params are
    used as they are placed (the trainer's state["params"]); rows are split over the batch axes, and padded with
    idle rows to a multiple of them. Settings as `sampling.generate`. `compact=False`: rows in lockstep to the end
    (the reference the compacted decode equals)."""
    sampling.check_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    if max_prompt_tokens < 1 or max_new_tokens < 1:
        raise ValueError(f"max_prompt_tokens and max_new_tokens: must be >= 1, got {max_prompt_tokens}, "
                         f"{max_new_tokens}")
    return MeshSampler(graphdef, mesh, mesh_lib.resolve_rules(rules), max_prompt_tokens, max_new_tokens,
                       float(temperature), int(top_k), float(top_p), tuple(int(t) for t in stop_ids), int(seed),
                       bool(compact))


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
    compact: bool = True

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
        settings = (np.uint32(self.seed), np.uint32(step), np.float32(self.temperature), np.int32(self.top_k),
                    np.float32(self.top_p), stop_array(self.stop_ids))
        compiling = [0.0]  # seconds spent compiling, left out of the timing
        call = functools.partial(self._call, compiling)
        jax.block_until_ready(params)  # the weights may still be the previous train step's output in flight
        start = time.perf_counter()
        state = call(prefill, params, self._place(tokens), self._place(left_pad),
                     self._place(np.arange(n) < len(prompts)), *settings)
        ids = np.full((n, self.max_new_tokens), -1, np.int32)
        log_probs = np.zeros((n, self.max_new_tokens), np.float32)
        entropy = np.zeros((n, self.max_new_tokens), np.float32)
        size, at, row_steps = n, 0, 0

        def collect(state):  # the rows' draws so far, home to their own places
            rows, *got = jax.device_get([state[k] for k in ("rows", "ids", "log_probs", "entropy")])
            ids[rows], log_probs[rows], entropy[rows] = got

        while True:
            smaller = next_size(size, ways) if self.compact else 0
            # The state is donated: the loop updates the cache in place, as one program would (one cache, not two).
            state = call(decode_steps, params, state, np.int32(smaller), *settings, pin=state, donate=(1,))
            i, done = jax.device_get((state["i"], state["done"]))
            row_steps, at = row_steps + size * (int(i) - at), int(i)
            if at + 1 >= self.max_new_tokens or done.all() or not smaller:
                break
            # Few rows left: the finished ones go home, the live ones (first) continue in a batch of `smaller`.
            collect(state)
            live_first = np.argsort(done, kind="stable")[:smaller].astype(np.int32)
            state, size = call(gather, state, self._place(live_first), pin=state), smaller
        collect(state)
        drawn = ids[:len(prompts)] >= 0
        seconds = time.perf_counter() - start - compiling[0]
        return dataclasses.replace(self._layout(prompts, ids[:len(prompts)], log_probs[:len(prompts)], seconds),
                                   decode_row_steps=row_steps, lockstep_row_steps=n * at,
                                   entropy=float(entropy[:len(prompts)][drawn].mean()) if drawn.any() else 0.0)

    def _place(self, x: np.ndarray) -> jax.Array:
        """`x` [rows, ...] split over the batch axes."""
        rows = mesh_lib.batch_sharding(self.mesh, self.rules)
        return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, P(*rows.spec[:x.ndim])),
                                            lambda index: x[index])

    def _call(self, compiling: list, fn, *args, pin=None, donate=()):
        """`fn(graphdef, *args, max_new_tokens=...)` run by its executable for these arguments' shapes and
        placements, compiled once (the seconds that takes added to compiling[0]). The sampling settings are
        arguments: samplers of one model, mesh and max_new_tokens share it. `pin`: a state whose placements the
        results keep (decode_steps and gather: the next call's arguments are this one's results). `donate`: the
        positions of arguments whose buffers the results may take."""
        key = (fn, self.graphdef, self.mesh, tuple(sorted(self.rules.items())), self.max_new_tokens,
               jax.tree.structure(args),
               tuple((np.shape(x), x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(args)))
        if key not in _EXECUTABLES:
            start = time.perf_counter()
            if len(_EXECUTABLES) >= 64:  # a bound on memory (what was cleared recompiles)
                _EXECUTABLES.clear()
            pinned = {} if pin is None else {"out_shardings": jax.tree.map(lambda x: x.sharding, pin)}
            run = jax.jit(functools.partial(fn, self.graphdef, max_new_tokens=self.max_new_tokens),
                          donate_argnums=donate, **pinned)
            with mesh_lib.activation_sharding(self.mesh, self.rules):
                _EXECUTABLES[key] = run.lower(*args).compile()
            compiling[0] += time.perf_counter() - start
        return _EXECUTABLES[key](*args)

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


def next_size(size: int, ways: int) -> int:
    """The batch the live rows move to once they fit: half of `size` rounded up to a whole split of the `ways`
    batch shards; 0 where that is not smaller (the rows stay in lockstep to the end)."""
    smaller = -(-size // 2 // ways) * ways if size > 1 else 0
    return smaller if 0 < smaller < size else 0


def _draw(i, logits, rows, seed, step, temperature, top_k, top_p):
    """Each row's token i from its logits [N, vocab], its log-prob and the entropy it was drawn at. Row r's key is fold_in(fold_in(fold_in(
    key(seed), step), r), i) with r the row's place in the rollout (`rows`), wherever compaction moved it."""
    keys = jax.vmap(functools.partial(jax.random.fold_in, jax.random.fold_in(jax.random.key(seed), step)))(
        rows.astype(jnp.uint32))
    logits = logits.astype(jnp.float32)
    ids = jax.vmap(lambda row, key: sampling.sample_logits(
        row[None], jax.random.fold_in(key, i), temperature, top_k, top_p)[0])(logits, keys)
    # Greedy draws' log-probs are at temperature 1: log_softmax(logits), what the trainer computes.
    scale = jnp.where(temperature > 0, temperature, 1.0)
    all_log_probs = jax.nn.log_softmax(logits / scale, axis=-1)
    log_probs = jnp.take_along_axis(all_log_probs, ids[:, None], -1)[:, 0]
    return ids, log_probs, -jnp.sum(jnp.exp(all_log_probs) * all_log_probs, axis=-1)


def _stops(ids, stop_ids):
    return jnp.any(ids[:, None] == stop_ids[None, :], axis=-1)


def prefill(graphdef, params, tokens, left_pad, active, seed, step, temperature, top_k, top_p, stop_ids, *,
            max_new_tokens: int) -> dict:
    """tokens [N, P]: prompts left-padded by left_pad [N]; active [N]: the rows that sample (others are filler, done
    from the start). Returns the decode's state: {"i": 0, "token": token 0 of each row, drawn, "done", "rows": each
    row's place, "left_pad", "cache", "ids" [N, max_new_tokens] (-1 past a row's stop id), "log_probs" (0 there),
    "entropy" (of each draw's distribution, 0 there)}."""
    model = nnx.merge(graphdef, params)
    n, prompt_len = tokens.shape
    rows = mesh_lib.constrain(jnp.arange(n, dtype=jnp.int32), ("batch",))
    cache = model.init_cache(n, prompt_len + max_new_tokens)
    logits, cache = model.decode(tokens, cache, 0, left_pad=left_pad)
    token, log_prob, entropy = _draw(0, logits, rows, seed, step, temperature, top_k, top_p)
    ids = jnp.full((n, max_new_tokens), -1, jnp.int32).at[:, 0].set(token)
    log_probs = jnp.zeros((n, max_new_tokens), jnp.float32).at[:, 0].set(log_prob)
    entropies = jnp.zeros((n, max_new_tokens), jnp.float32).at[:, 0].set(entropy)
    state = {"token": token, "done": _stops(token, stop_ids) | ~active, "rows": rows, "left_pad": left_pad,
             "ids": ids, "log_probs": log_probs, "entropy": entropies}
    state = {k: mesh_lib.constrain(v, ("batch",)) for k, v in state.items()}
    return {"i": jnp.int32(0), "cache": cache, **state}


def decode_steps(graphdef, params, state, floor, seed, step, temperature, top_k, top_p, stop_ids, *,
                 max_new_tokens: int) -> dict:
    """`state` (prefill's) decoded on until every row is done, max_new_tokens are drawn, or (floor > 0) at most
    `floor` rows are live: then they are gathered into a batch of `floor` (MeshSampler.__call__)."""
    model = nnx.merge(graphdef, params)
    prompt_len = state["cache"]["latent" if "latent" in state["cache"] else "k"].shape[2] - max_new_tokens

    def running(s):
        live = jnp.sum(~s["done"])
        return (s["i"] + 1 < max_new_tokens) & (live > 0) & ((floor == 0) | (live > floor))

    def step_fn(s):  # token i is drawn, not yet run through the model
        i, done = s["i"], s["done"]
        logits, cache = model.decode(s["token"][:, None], s["cache"], prompt_len + i, left_pad=s["left_pad"])
        token, log_prob, entropy = _draw(i + 1, logits, s["rows"], seed, step, temperature, top_k, top_p)
        return {**s, "i": i + 1, "token": token, "done": done | _stops(token, stop_ids), "cache": cache,
                "ids": s["ids"].at[:, i + 1].set(jnp.where(done, -1, token)),
                "log_probs": s["log_probs"].at[:, i + 1].set(jnp.where(done, 0.0, log_prob)),
                "entropy": s["entropy"].at[:, i + 1].set(jnp.where(done, 0.0, entropy))}

    return jax.lax.while_loop(running, step_fn, state)


def rollout(graphdef, params, tokens, left_pad, active, seed, step, temperature, top_k, top_p, stop_ids, *,
            max_new_tokens: int):
    """The rows in lockstep in one program (prefill's arguments): (ids [N, max_new_tokens], -1 after a row's stop
    id; their log-probs, 0 there)."""
    settings = (seed, step, temperature, top_k, top_p, stop_ids)
    state = prefill(graphdef, params, tokens, left_pad, active, *settings, max_new_tokens=max_new_tokens)
    state = decode_steps(graphdef, params, state, jnp.int32(0), *settings, max_new_tokens=max_new_tokens)
    return state["ids"], state["log_probs"]


def gather(graphdef, state, index, *, max_new_tokens: int) -> dict:
    """`state`'s rows `index` (the live ones first): the decode's state for a smaller batch."""
    del graphdef, max_new_tokens
    return {k: v if k == "i" else jax.tree.map(lambda c: c[:, index], v) if k == "cache" else v[index]
            for k, v in state.items()}
