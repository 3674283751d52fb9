"""Pipeline parallelism over the `pipeline` mesh axis, in plain jit/GSPMD style (as MaxText does it).

The stacked layers ([n_layers, ...] leaves) are split into `stages`; the batch into `microbatches`. A
stage-major buffer [stages, microbatch, ...] holds what every stage works on. Each *tick* runs all stages at
once (`jax.vmap` over the stage axis, each stage a `lax.scan` over its layers), then shifts the outputs one
stage along (`jnp.roll` on the stage axis). With the stage axis sharded over the `pipeline` mesh axis
(logical name "stages"), every device runs only its own stage and XLA lowers the roll to a
collective-permute. The ticks are a `lax.scan`, so autodiff gives the backward pass (and its reverse
permutes); the result equals running every layer in order on the whole batch.

Schedules (S stages, M microbatches, R repeats, L layers):
  gpipe     stage s runs the contiguous layers [s*L/S, (s+1)*L/S). M + S - 1 ticks; any M >= 1 works (M >= S keeps
            the bubble down).
  circular  interleaved: the layers form S*R chunks of K = L/(S*R); chunk c runs on stage c % S, so a microbatch
            goes round the ring R times. R*M + S - 1 ticks. Needs M >= S when R > 1 (a microbatch leaving the
            last stage must find stage 0 free; when M > S it waits M - S ticks on stage 0's device).
  Fraction of stage-ticks idle (the bubble): (S - 1) / (R*M + S - 1), see `bubble_fraction`.

Layer order: `run` takes the stacked layers stage-major (`layer_order`): position (s*R + r)*K + k holds layer
(r*S + s)*K + k, the k-th layer of the chunk stage s runs in repeat r. A leaf [L, ...] sharded on its dim 0 over
`pipeline` then holds on each device exactly its stages' chunks, and the reshape to [S, R, K, ...] moves nothing.
For gpipe (R = 1) that is the model's order. For circular it is not: the training state keeps its stacked layers
in this order (`train.abstract_train_state`'s init puts them there), checkpoints record the order they hold
and restore converts (`jaxtrain.checkpoint`), and decoding reads the layers through it. In the model's order the
stage weights would have to be re-laid out over the pipeline axis on every step, and their gradients back: an
all-to-all of all the layer weights twice a step (`configs/plan_1b.py` at 16 layers, data 2 x pipeline 4,
2 repeats: a 1.41 GiB all-to-all and 1.41 GiB more permutes per device and step; BUILD.md, performance).

Memory: the backward pass keeps each tick's stage inputs (and whatever `layer_fn` saves; wrap it in
`jax.checkpoint` to trade compute for memory), i.e. activations for R*M + S - 1 stage-microbatches per
device, as GPipe does; there is no 1F1B-style early backward under a single jit.

Sharding: stage-major buffers are constrained to ("stages", "batch") and stage params to ("stages",) on their
leading dims (the leaf to ("layers",) first); their other dims are left unconstrained, so that fsdp, tensor
or sequence shardings set inside `layer_fn` survive. The vmap over stages passes the stage mesh axes as
`spmd_axis_name`, so constraints inside `layer_fn` keep the stage dim on its shard. The final carry is read
from stage 0's device and broadcast over the pipeline axis once per call. Gradients: each tick adds to the
weight gradient of the chunk each stage ran; summed over a microbatch's rows split over `data`, XLA would
all-reduce it over `data` on every tick. So each pure data-parallel replica (mesh.replica_axes) gets its own
copy of the stage weights ([S, R, D, K, ...], a broadcast sharded over the replica axes) and runs its rows
with it (a vmap over the replicas): the copies' gradients stay local through the loop and are summed once.
No 1F1B schedule: under one jit the backward pass is the transpose of the whole tick loop, so its activation
memory is GPipe's whatever the order; the circular schedule is the one that shrinks the bubble.

Idle stage-ticks (the bubble) compute on real, finite data (an earlier microbatch), never on
uninitialised buffers, and their results never reach the output, so their cotangents are exactly zero and
gradients stay free of NaNs.

Microbatches are split as `jaxtrain.parallel.mesh.split_microbatches` does (row i goes to microbatch i % M, so each
microbatch spans every data shard) and the output is put back in the original row order.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group
from jaxtrain.parallel import mesh as mesh_lib

SCHEDULES = ("gpipe", "circular")
# The config's `pipeline` group: `stages` (1 = off) splits the layers into that many stages over the mesh's
# `pipeline` axis (which must divide it); each batch (or gradient-accumulation microbatch) runs as `microbatches`
# pipeline microbatches; `schedule` "gpipe", or "circular" with `repeats` chunks of layers per stage.
CONFIG = dict(stages=1, microbatches=1, schedule="gpipe", repeats=1)


def check_config(pipeline, *, n_layers: int, microbatch: int, mesh_shape: dict, rules: dict) -> None:
    """ConfigError naming the first bad field of the `pipeline` group; `microbatch`: rows per accumulation step."""
    g = Group(pipeline, "pipeline")
    for f in ("stages", "microbatches", "repeats"):
        g.positive_int(f)
    p = pipeline
    if p.stages % mesh_shape["pipeline"]:
        raise ConfigError("mesh.pipeline", f"{mesh_shape['pipeline']} does not divide pipeline.stages={p.stages}")
    if p.stages == 1:
        return
    try:
        check(n_layers, microbatch, p.stages, p.microbatches, p.schedule, p.repeats)
    except ValueError as e:
        field, _, reason = str(e).partition(": ")
        raise ConfigError(field, reason) from None
    dp = mesh_lib.data_parallel_size(mesh_shape, rules)
    if (microbatch // p.microbatches) % dp:
        raise ConfigError("pipeline.microbatches", f"a pipeline microbatch of {microbatch // p.microbatches} "
                          f"sequences is not divisible by the data-parallel size {dp}")


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Fraction of stage-ticks idle: (S - 1) / (R*M + S - 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def check(n_layers: int, batch: int, stages: int, microbatches: int, schedule: str, repeats: int = 1) -> None:
    """Raises ValueError (one line, naming the config field) if `run` cannot take this configuration."""
    if stages < 1:
        raise ValueError(f"pipeline.stages: must be >= 1, got {stages}")
    if microbatches < 1:
        raise ValueError(f"pipeline.microbatches: must be >= 1, got {microbatches}")
    if repeats < 1:
        raise ValueError(f"pipeline.repeats: must be >= 1, got {repeats}")
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    if schedule == "gpipe" and repeats != 1:
        raise ValueError(f"pipeline.repeats: only the circular schedule repeats; gpipe needs 1, got {repeats}")
    if n_layers % stages:
        raise ValueError(f"pipeline.stages: n_layers={n_layers} is not divisible by stages={stages}")
    if n_layers % (stages * repeats):
        raise ValueError(f"pipeline.repeats: n_layers={n_layers} is not divisible by "
                         f"stages*repeats={stages}*{repeats}")
    if batch % microbatches:
        raise ValueError(f"pipeline.microbatches: batch={batch} is not divisible by microbatches={microbatches}")
    if schedule == "circular" and repeats > 1 and microbatches < stages:
        raise ValueError(f"pipeline.microbatches: the circular schedule with repeats>1 needs microbatches >= "
                         f"stages, got {microbatches} < {stages}")


def layer_order(n_layers: int, stages: int, repeats: int = 1) -> tuple[int, ...]:
    """The model's layer at each position of the stacked layers' dim 0 when pipelined: stage-major, position
    (s*R + r)*K + k holds layer (r*S + s)*K + k (K = L/(S*R)). The identity unless repeats > 1 (circular) on more
    than one stage (one stage runs a plain scan, whatever `repeats` says)."""
    S, R = stages, repeats if stages > 1 else 1
    if n_layers % (S * R):
        raise ValueError(f"pipeline.repeats: n_layers={n_layers} is not divisible by stages*repeats={S}*{R}")
    K = n_layers // (S * R)
    return tuple((r * S + s) * K + k for s in range(S) for r in range(R) for k in range(K))


def is_layer_order(order, n_layers: int) -> bool:
    """Whether `order` holds each of the `n_layers` layers exactly once."""
    return sorted(order) == list(range(n_layers))


def stacked_path(path) -> bool:
    """Whether a state leaf's key path lies under the stacked layers (the model's `blocks`, in the params and in
    every optimizer moment that mirrors them): their dim 0 is the layer."""
    return any(getattr(key, "key", None) == "blocks" for key in path)


def reorder_layers(tree, old_order, new_order):
    """`tree` with every stacked-layer leaf (`stacked_path`) moved from `old_order` to `new_order` along dim 0
    (tuples as `layer_order` gives; None = the model's order). A gather: under jit over a sharded dim, XLA moves
    the layers between devices."""
    n = None
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if stacked_path(path):
            n = leaf.shape[0]
            break
    if n is None:
        return tree
    old, new = (tuple(range(n)) if o is None else tuple(o) for o in (old_order, new_order))
    if not (is_layer_order(old, n) and is_layer_order(new, n)):
        raise ValueError(f"layer orders {old} -> {new}: not both orders of the {n} stacked layers")
    if old == new:
        return tree
    position = {layer: i for i, layer in enumerate(old)}
    take = [position[layer] for layer in new]  # new position j <- old position of layer new[j]
    return jax.tree_util.tree_map_with_path(lambda p, x: x[np.asarray(take)] if stacked_path(p) else x, tree)


# --- Sharding helpers ---------------------------------------------------------------------------------
def _stage_axis(stages: int):
    """Mesh axes the stage dimension is sharded over (for vmap's spmd_axis_name), or None."""
    active = mesh_lib.active_sharding()
    if active is None:
        return None
    mesh, rules = active
    axis = mesh_lib.spec_for((stages,), ("stages",), mesh, rules)[0]
    return None if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def _replicas() -> tuple[tuple[str, ...], int]:
    """(mesh axes, ways) of the pure data-parallel replicas under the active sharding (mesh.replica_axes)."""
    active = mesh_lib.active_sharding()
    if active is None:
        return (), 1
    mesh, rules = active
    axes = mesh_lib.replica_axes(mesh.shape, rules)
    return axes, math.prod(mesh.shape[a] for a in axes)


def _unsplit(x):  # [M, B/M, ...] -> [B, ...], inverse of mesh_lib.split_microbatches
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


# --- The pipeline -------------------------------------------------------------------------------------
def run(layer_fn: Callable, layer_params, carry, *, stages: int, microbatches: int, schedule: str = "gpipe",
        repeats: int = 1):
    """Runs every layer of `layer_params` in order over `carry`, pipelined.

    layer_fn(one_layer_params, carry) -> carry applies one layer; `layer_params` has leaves [n_layers, ...] in
    `layer_order(n_layers, stages, repeats)`, the model's order unless circular; `carry` is a pytree of arrays
    [batch, ...] (extras such as positions travel with the activations, so each microbatch keeps its own).
    Returns the final carry [batch, ...] in the original row order, equal to `lax.scan` over all the layers (in
    the model's order) on the whole batch.
    """
    n_layers = jax.tree.leaves(layer_params)[0].shape[0]
    batch = jax.tree.leaves(carry)[0].shape[0]
    check(n_layers, batch, stages, microbatches, schedule, repeats)
    S, M, R = stages, microbatches, repeats
    K = n_layers // (S * R)  # layers per chunk (per stage and repeat)

    def scan_layers(params, c):
        return jax.lax.scan(lambda c, p: (layer_fn(p, c), None), c, params)[0]

    if S == 1:  # one stage: nothing to pipeline, microbatches would change nothing
        return scan_layers(layer_params, carry)

    # Stage params [S, R, K, ...]: stage s, repeat r holds chunk r*S + s, the layers in stage-major order.
    def to_stages(w):
        # Pinning the [L] layout first also pins the gradient's (the transpose of a constraint is itself).
        w = mesh_lib.constrain(w, ("layers",))
        return mesh_lib.constrain(w.reshape(S, R, K, *w.shape[1:]), ("stages",))

    stage_params = jax.tree.map(to_stages, layer_params)
    stage_ids = jnp.arange(S)
    replica_axes, D = _replicas()
    if D > 1 and (batch // M) % D == 0:
        # Each data-parallel replica runs its rows of a microbatch with its own copy of the stage weights
        # ([S, R, D, K, ...]), so every tick's weight gradient stays on its replica and the copies' gradients are
        # summed once, after the loop (mesh.per_replica): one all-reduce over the replicas a step, not one a tick.
        stage_params = jax.tree.map(
            lambda w: mesh_lib.per_replica(w, replica_axes, dim=2, leading=(_stage_axis(S), None)), stage_params)
        per_replica_layers = mesh_lib.over_replicas(scan_layers, replica_axes)

        def run_chunk(chunk, c):  # chunk leaves [D, K, ...], c leaves [microbatch, ...]
            return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), per_replica_layers(chunk, c))
    else:
        run_chunk = scan_layers

    def stage_fn(params, repeat, c):  # one stage's work for one tick (vmapped over the stages)
        if R == 1:
            chunk = jax.tree.map(lambda w: w[0], params)
        else:
            chunk = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, repeat, 0, keepdims=False), params)
        return run_chunk(chunk, c)

    run_stages = jax.vmap(stage_fn, spmd_axis_name=_stage_axis(S))

    def stage_major(x):  # [S, microbatch, ...]
        return mesh_lib.constrain(x, ("stages", "batch"))

    def select_stage0(first, rest):  # stage 0 takes `first`, the others `rest`
        pick = lambda a, b: jnp.where((stage_ids == 0).reshape(S, *[1] * (a.ndim - 1)), a, b)
        return jax.tree.map(lambda a, b: stage_major(pick(a, b)), first, rest)

    # `store` [S, M, microbatch, ...]: stage 0's copy is the input queue. It starts as the microbatches, and
    # each microbatch's output from the last stage is written back into its slot (after the ring shift, so
    # the write is local to stage 0), where stage 0 reads it for the next repeat; at the end it holds the
    # outputs. The other stages' copies are filled alike but only ever feed idle stage-ticks.
    micro = jax.tree.map(lambda x: mesh_lib.split_microbatches(x, M), carry)
    store = jax.tree.map(
        lambda x: mesh_lib.constrain(jnp.broadcast_to(x[None], (S, *x.shape)), ("stages", None, "batch")), micro)

    def read(store, slot):
        return jax.tree.map(lambda b: stage_major(jax.lax.dynamic_index_in_dim(b, slot, 1, keepdims=False)), store)

    def tick(loop, t):
        state, store = loop  # state: what each stage works on at tick t
        # Stage s works on repeat (t - s) // M; idle ticks clamp it into range (their results are dropped).
        repeat = jnp.clip((t - stage_ids) // M, 0, R - 1)
        out = run_stages(stage_params, repeat, state)
        shifted = jax.tree.map(lambda x: stage_major(jnp.roll(x, 1, axis=0)), out)  # stage s -> s + 1, S-1 -> 0
        # The last stage finished microbatch (t - S + 1) % M (if t >= S - 1); keep it in stage 0's slot.
        done = t - (S - 1)
        slot = done % M

        def write(b, x):
            old = jax.lax.dynamic_index_in_dim(b, slot, 1, keepdims=False)
            new = jnp.where(done >= 0, x, old)
            return mesh_lib.constrain(jax.lax.dynamic_update_index_in_dim(b, new, slot, 1), ("stages", None, "batch"))

        store = jax.tree.map(write, store, shifted)
        # Next tick: stage 0 takes microbatch (t + 1) % M from its queue (new input, or its previous repeat's
        # output); the other stages take their predecessor's output.
        state = select_stage0(read(store, (t + 1) % M), shifted)
        return (state, store), None

    ticks = R * M + S - 1
    state = read(store, 0)  # stage 0 starts on microbatch 0; the idle stages chew on copies of it
    (_, store), _ = jax.lax.scan(tick, (state, store), jnp.arange(ticks))
    return jax.tree.map(lambda b: _unsplit(b[0]), store)
