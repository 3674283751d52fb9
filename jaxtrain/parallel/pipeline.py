"""Pipeline parallelism over the `pipeline` mesh axis, in plain jit/GSPMD style.

The stacked layers are split into `stages` and the batch into `microbatches`; a stage-major buffer holds what
every stage works on. Each tick runs all stages at once (a vmap over the stage axis, each stage a scan over its
layers), then shifts the outputs one stage along with a roll that XLA lowers to a collective-permute. The ticks
are a scan, so autodiff gives the backward pass; the result equals every layer run in order on the whole batch.
`gpipe`: stage s runs layers [s*L/S, (s+1)*L/S), M + S - 1 ticks. `circular`: S*R chunks of layers, chunk c on
stage c % S, R*M + S - 1 ticks; the training state then keeps the layers stage-major (`layer_order`) so that no
weight moves between stages. Each data replica runs its rows on its own copy of the stage weights, so layer
gradients cross `data` once a step. Idle stage-ticks compute on real data whose results never reach the
output, so gradients stay free of NaNs. Under one jit their activation memory is GPipe's whatever the order;
the EXPLICIT schedules (1F1B, interleaved, zero bubble) run in jaxtrain.parallel.pipeline_exec instead.
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
from jaxtrain.parallel import schedules

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")
# Run by the explicit executor (jaxtrain.parallel.pipeline_exec: jax.vjp per stage, the loss in the last stage),
# through the model's hidden_loss; gpipe and circular by `run` below under autodiff.
EXPLICIT = ("1f1b", "interleaved_1f1b", "zero_bubble")
# The config's `pipeline` group: `stages` (1 = off) splits the layers into that many stages over the mesh's
# `pipeline` axis (which must divide it); each batch (or gradient-accumulation microbatch) runs as `microbatches`
# pipeline microbatches; `schedule` "gpipe", or "circular" with `repeats` chunks of layers per stage, or one of
# EXPLICIT ("interleaved_1f1b" with `repeats`).
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


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1, schedule: str = "gpipe") -> float:
    """Fraction of stage-ticks idle: gpipe's and circular's (S - 1) / (R*M + S - 1); an EXPLICIT schedule's its
    table's (schedules' time model: ZB-H1 fills the drain with weight gradients)."""
    if schedule in EXPLICIT and stages > 1:
        return schedules.bubble_fraction(schedules.build(schedule, stages, microbatches, repeats))
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
    if schedule in EXPLICIT:  # ConfigError is a ValueError, its text '<field>: <reason>'
        schedules.check(schedule, stages, microbatches, repeats, n_layers)
    if schedule in ("gpipe", "1f1b", "zero_bubble") and repeats != 1:
        raise ValueError(f"pipeline.repeats: only circular and interleaved_1f1b repeat; {schedule} needs 1, "
                         f"got {repeats}")
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
    if schedule in EXPLICIT:
        raise ValueError(f"pipeline.schedule: {schedule} runs in pipeline_exec (the model's hidden_loss), "
                         f"not under autodiff here")
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

    run_stages = mesh_lib.spmd_vmap(stage_fn, _stage_axis(S))

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
