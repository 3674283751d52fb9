"""An explicit pipeline executor (prototype, not wired into train): each stage runs its row of a schedule table.

Inside `jax.shard_map` over the `pipeline` axis, a `lax.scan` over ticks runs every stage's action of that tick
through `lax.switch` (idle, F, B, W, BW): the backward is `jax.vjp` of the stage function, called by the schedule
(each backward recomputes its chunk's forward from the saved input), not autodiff of the loop. After each tick
one `ppermute` sends the forward outputs a stage on and one sends the input gradients a stage back (ring-wise,
for the chunks that wrap from stage S-1 to 0). A stage keeps the inputs and output gradients of its chunks in
buffers whose slots are assigned ahead of time from the table: a slot lives from the tick its input arrives
to the tick of its last backward action, so the buffers hold about the schedule's activation bound.
Ticks are the table's with every action one tick (`UNIT`): the stages run in lockstep.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel import schedules

UNIT = {"F": 1, "B": 1, "W": 1, "BW": 1}
_CODE = {None: 0, "F": 1, "B": 2, "W": 3, "BW": 4}


def program(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> dict:
    """The static per-tick, per-stage instructions ([ticks, S] int32 numpy arrays) and the buffer size `slots`.

    kind (_CODE), chunk (the stage's local chunk r), mb, slot (buffer slot of (mb, chunk)), load (F of chunk 0:
    its input is the data), last (the model's last chunk: the loss), fwd_slot / bwd_slot (where the forward
    output / input gradient that arrives at the tick's start goes; -1 none)."""
    table = schedules.build(schedule, stages, microbatches, repeats, costs=UNIT)
    S, n_chunks = stages, stages * repeats
    ticks = len(table.rows[0])
    # Each (mb, chunk)'s lifetime on its stage: from its input's arrival (the tick after the previous chunk's F,
    # or its own F for chunk 0) to its last backward action.
    when = {a: t for row in table.rows for t, a in enumerate(row) if a is not None}
    life = {}
    for a, t in when.items():
        key = (a.mb, a.chunk)
        if a.kind == "F":
            start = t if a.chunk == 0 else when[schedules.Action("F", a.mb, a.chunk - 1)] + 1
            life[key] = [start, life.get(key, [0, 0])[1]]
        elif a.kind in ("W", "BW"):
            life.setdefault(key, [0, 0])[1] = t
    slot, used = {}, 0
    for s in range(S):  # greedy interval colouring per stage, by start tick
        free_at = []  # per slot: the first tick it is free again
        for key in sorted((k for k in life if k[1] % S == s), key=lambda k: life[k][0]):
            start, end = life[key]
            i = next((i for i, f in enumerate(free_at) if f <= start), len(free_at))
            free_at[i:i + 1] = [end + 1]
            slot[key] = i
        used = max(used, len(free_at))
    prog = {k: np.zeros((ticks, S), np.int32) for k in ("kind", "chunk", "mb", "slot", "load", "last")}
    prog["fwd_slot"] = np.full((ticks, S), -1, np.int32)
    prog["bwd_slot"] = np.full((ticks, S), -1, np.int32)
    for a, t in when.items():
        s = a.chunk % S
        for k, v in (("kind", _CODE[a.kind]), ("chunk", a.chunk // S), ("mb", a.mb), ("slot", slot[a.mb, a.chunk]),
                     ("load", a.kind == "F" and a.chunk == 0), ("last", a.chunk == n_chunks - 1)):
            prog[k][t, s] = v
        if a.kind == "F" and a.chunk + 1 < n_chunks:  # arrives on the next chunk's stage at t + 1
            prog["fwd_slot"][t + 1, (a.chunk + 1) % S] = slot[a.mb, a.chunk + 1]
        if a.kind in ("B", "BW") and a.chunk > 0:
            prog["bwd_slot"][t + 1, (a.chunk - 1) % S] = slot[a.mb, a.chunk - 1]
    prog["slots"] = used
    return prog


def _at(tree, i):
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False), tree)


def _put(buf, i, value, keep):  # buf[i] = value unless `keep`
    old = jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(keep, old, value), i, 0)


def value_and_grad(stage_fn: Callable, loss_fn: Callable, params, xs, targets, *, mesh, schedule: str = "1f1b",
                   repeats: int = 1, axis: str = "pipeline", batch_axes: tuple[str, ...] = ()):
    """(loss, grads) of mean over m of loss_fn(model(xs[m]), targets[m]), the model being the S*R chunks of
    `params` (leaves [S*R, ...], model order) in turn: stage_fn(chunk_params, x) -> y shaped like x.

    xs, targets: [M, rows, ...] microbatches. Runs `schedule`'s table on the mesh's `axis` (S stages); the grads
    come back in model order. Equals jax.value_and_grad of the unpipelined loss. `batch_axes`: mesh axes that
    split the rows, manual here so that each replica sums its own weight gradients and they cross those axes
    once, after the loop (left to XLA, they would be all-reduced on every tick); loss_fn must then be a mean
    over rows."""
    S, M, R = mesh.shape[axis], xs.shape[0], repeats
    prog = program(schedule, S, M, R)
    n_slots = prog.pop("slots")
    rows = {k: jnp.asarray(v) for k, v in prog.items()}
    # Stage-major [S, R, ...]: chunk r*S + s on stage s, as pipeline.layer_order keeps circular's layers.
    staged = jax.tree.map(lambda w: jnp.swapaxes(w.reshape(R, S, *w.shape[1:]), 0, 1), params)

    def loss_grad(y, t):
        return jax.grad(lambda y: loss_fn(y, t) / M)(y)

    def branches():
        def cotangent(y, g, t, last):  # the last chunk's output gradient is the loss's, the others' arrived
            return jnp.where(last, loss_grad(y, t), g)

        def idle(p, x, g, t, last):
            return jnp.zeros_like(x), jnp.zeros_like(x), jax.tree.map(jnp.zeros_like, p), jnp.zeros((), x.dtype)

        def fwd(p, x, g, t, last):
            y = stage_fn(p, x)
            return y, jnp.zeros_like(x), jax.tree.map(jnp.zeros_like, p), jnp.where(last, loss_fn(y, t) / M, 0.0)

        def bwd_input(p, x, g, t, last):
            y, vjp = jax.vjp(lambda x: stage_fn(p, x), x)
            (dx,) = vjp(cotangent(y, g, t, last))
            return jnp.zeros_like(x), dx, jax.tree.map(jnp.zeros_like, p), jnp.zeros((), x.dtype)

        def bwd_weight(p, x, g, t, last):
            y, vjp = jax.vjp(lambda p: stage_fn(p, x), p)
            (dp,) = vjp(cotangent(y, g, t, last))
            return jnp.zeros_like(x), jnp.zeros_like(x), dp, jnp.zeros((), x.dtype)

        def bwd_full(p, x, g, t, last):
            y, vjp = jax.vjp(stage_fn, p, x)
            dp, dx = vjp(cotangent(y, g, t, last))
            return jnp.zeros_like(x), dx, dp, jnp.zeros((), x.dtype)

        return [idle, fwd, bwd_input, bwd_weight, bwd_full]

    fns = branches()
    ahead = [(i, (i + 1) % S) for i in range(S)]
    back = [(i, (i - 1) % S) for i in range(S)]

    def local(stage_params, xs, targets):
        stage_params = jax.tree.map(lambda w: w[0], stage_params)  # [R, ...]: this stage's chunks
        s = jax.lax.axis_index(axis)
        x_buf = jnp.zeros((n_slots, *xs.shape[1:]), xs.dtype)
        carry = (x_buf, jnp.zeros_like(x_buf), jax.tree.map(jnp.zeros_like, stage_params), jnp.zeros((), xs.dtype),
                 jnp.zeros_like(xs[0]), jnp.zeros_like(xs[0]))

        def tick(carry, row):
            x_buf, g_buf, grads, loss, fwd_msg, bwd_msg = carry
            row = {k: v[s] for k, v in row.items()}
            # What arrived at the end of the last tick goes to its slot; chunk 0's F reads the data.
            x_buf = _put(x_buf, jnp.maximum(row["fwd_slot"], 0), fwd_msg, row["fwd_slot"] < 0)
            g_buf = _put(g_buf, jnp.maximum(row["bwd_slot"], 0), bwd_msg, row["bwd_slot"] < 0)
            x_buf = _put(x_buf, row["slot"], _at(xs, row["mb"]), row["load"] == 0)
            args = (_at(stage_params, row["chunk"]), _at(x_buf, row["slot"]), _at(g_buf, row["slot"]),
                    _at(targets, row["mb"]), row["last"] == 1)
            y, dx, dp, dloss = jax.lax.switch(row["kind"], fns, *args)
            grads = jax.tree.map(lambda acc, d: _put(acc, row["chunk"], _at(acc, row["chunk"]) + d, False),
                                 grads, dp)
            fwd_msg = jax.lax.ppermute(y, axis, ahead)
            bwd_msg = jax.lax.ppermute(dx, axis, back)
            return (x_buf, g_buf, grads, loss + dloss, fwd_msg, bwd_msg), None

        (_, _, grads, loss, _, _), _ = jax.lax.scan(tick, carry, rows)
        if batch_axes:  # each replica's rows are an equal share: the mean over rows is the mean of the replicas'
            loss, grads = jax.lax.pmean((loss, grads), batch_axes)
        return jax.lax.psum(loss, axis), jax.tree.map(lambda g: g[None], grads)

    specs = jax.tree.map(lambda _: P(axis), staged)
    rows_spec = P(None, batch_axes or None)
    loss, grads = jax.shard_map(local, mesh=mesh, in_specs=(specs, rows_spec, rows_spec), out_specs=(P(), specs),
                                axis_names={axis, *batch_axes}, check_vma=False)(staged, xs, targets)
    return loss, jax.tree.map(lambda g: jnp.swapaxes(g, 0, 1).reshape(S * R, *g.shape[2:]), grads)
