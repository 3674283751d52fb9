"""An explicit pipeline executor: each stage runs its row of a schedule table (jaxtrain.parallel.schedules).

Inside `jax.shard_map` over the `pipeline` axis, a `lax.scan` over ticks runs every stage's action of that tick
through `lax.switch` (idle, F, B, W, BW; the last chunk's also run the loss): the backward is `jax.vjp` of the
stage function, called by the schedule (each backward recomputes its chunk's forward from the saved input), not
autodiff of the loop. After each tick one `ppermute` sends the forward outputs a stage on and one sends the input
gradients a stage back (ring-wise, for the chunks that wrap from stage S-1 to 0). A stage keeps the inputs and
output gradients of its chunks in buffers whose slots are assigned ahead of time from the table: a slot lives
from the tick its input arrives to the tick of its last action, so the buffers hold the schedule's activation
bound. Ticks are the table's with every action one tick (`UNIT`): the stages run in lockstep.
`loss_and_grads` runs a whole step's forwards and backwards; `pipelined_loss` wraps it in a `jax.custom_vjp`
(the gradients are its residuals), so that a model's loss under an outer jax.grad runs the schedule.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import schedules

UNIT = {"F": 1, "B": 1, "W": 1, "BW": 1}
_CODE = {None: 0, "F": 1, "B": 2, "W": 3, "BW": 4}
# The forward-only run (no gradient asked: eval, sampling) of each schedule: the one with its layer order.
FORWARD = {"1f1b": "gpipe", "zero_bubble": "gpipe", "interleaved_1f1b": "circular", "gpipe": "gpipe",
           "circular": "circular"}


def program(schedule: str, stages: int, microbatches: int, repeats: int = 1, forward_only: bool = False) -> dict:
    """The static per-tick, per-stage instructions ([ticks, S] int32 numpy arrays) and the buffer size `slots`.

    kind (_CODE), chunk (the stage's local chunk r), mb, slot (buffer slot of (mb, chunk)), load (F of chunk 0:
    its input is the data), first (B or BW of chunk 0: its input gradient is the data's), last (the model's last
    chunk: the loss), fwd_slot / bwd_slot (where the forward output / input gradient that arrives at the tick's
    start goes; -1 none). `forward_only`: FORWARD[schedule]'s forwards alone."""
    if forward_only:
        schedule = FORWARD[schedule]
    table = schedules.build(schedule, stages, microbatches, repeats, costs=UNIT)
    rows = table.rows
    if forward_only:
        rows = tuple(tuple(a if a is not None and a.kind == "F" else None for a in row) for row in rows)
        ticks = 1 + max(t for row in rows for t, a in enumerate(row) if a is not None)
        rows = tuple(row[:ticks] for row in rows)
    S, n_chunks = stages, stages * repeats
    ticks = len(rows[0])
    # Each (mb, chunk)'s lifetime on its stage: from its input's arrival (the tick after the previous chunk's F,
    # or its own F for chunk 0) to its last action.
    when = {a: t for row in rows for t, a in enumerate(row) if a is not None}
    life = {}
    for a, t in when.items():
        key = (a.mb, a.chunk)
        start = t if a.kind != "F" else t if a.chunk == 0 else when[schedules.Action("F", a.mb, a.chunk - 1)] + 1
        old = life.get(key, (start, t))
        life[key] = (min(old[0], start), max(old[1], t))
    slot, used = {}, 0
    for s in range(S):  # greedy interval colouring per stage, by start tick
        free_at = []  # per slot: the first tick it is free again
        for key in sorted((k for k in life if k[1] % S == s), key=lambda k: life[k][0]):
            start, end = life[key]
            i = next((i for i, f in enumerate(free_at) if f <= start), len(free_at))
            free_at[i:i + 1] = [end + 1]
            slot[key] = i
        used = max(used, len(free_at))
    prog = {k: np.zeros((ticks, S), np.int32) for k in ("kind", "chunk", "mb", "slot", "load", "first", "last")}
    prog["fwd_slot"] = np.full((ticks, S), -1, np.int32)
    prog["bwd_slot"] = np.full((ticks, S), -1, np.int32)
    for a, t in when.items():
        s = a.chunk % S
        for k, v in (("kind", _CODE[a.kind]), ("chunk", a.chunk // S), ("mb", a.mb), ("slot", slot[a.mb, a.chunk]),
                     ("load", a.kind == "F" and a.chunk == 0), ("first", a.kind in ("B", "BW") and a.chunk == 0),
                     ("last", a.chunk == n_chunks - 1)):
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


def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _branches(stage_fn: Callable, tail_fn: Callable, aux_shape):
    """The switch's branches, by kind + 5 * last: each (p, frozen, x, g, side, chunk, tail) -> (y, dx, dp,
    d tail, loss, aux). On the last chunk the output gradient is the loss's, not the one that arrived."""
    def out(x, p, tail, y=None, dx=None, dp=None, dtail=None, loss=None, aux=None):
        return (jnp.zeros_like(x) if y is None else y, jnp.zeros_like(x) if dx is None else dx,
                _zeros(p) if dp is None else dp, _zeros(tail) if dtail is None else dtail,
                jnp.zeros((), jnp.float32) if loss is None else loss.astype(jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape) if aux is None else aux)

    def make(kind, last):
        def branch(p, f, x, g, side, c, tail):
            if kind == "idle":
                return out(x, p, tail)
            if kind == "F":
                y, aux = stage_fn(p, f, x, side, c)
                return out(x, p, tail, y=y, aux=aux, loss=tail_fn(tail, y, side) if last else None)
            wrt = {"B": (2,), "W": (0,), "BW": (0, 2)}[kind]

            def run(*diff):
                args = [p, f, x]
                for i, d in zip(wrt, diff):
                    args[i] = d
                return stage_fn(args[0], args[1], args[2], side, c)

            y, vjp, _ = jax.vjp(run, *[(p, f, x)[i] for i in wrt], has_aux=True)
            dtail = None
            if last and kind == "W":  # the loss's gradient: d y, and (once per microbatch: B or BW) d tail
                g = jax.grad(lambda y: tail_fn(tail, y, side))(y)
            elif last:
                g, dtail = jax.grad(lambda y, t: tail_fn(t, y, side), argnums=(0, 1))(y, tail)
            grads = dict(zip(wrt, vjp(g.astype(y.dtype))))
            return out(x, p, tail, dx=grads.get(2), dp=grads.get(0), dtail=dtail)
        return branch

    kinds = ("idle", "F", "B", "W", "BW")
    return [make(k, False) for k in kinds] + [make(k, True) for k in kinds]


def loss_and_grads(stage_fn: Callable, tail_fn: Callable, staged, frozen, tail, xs, side, *, mesh,
                   schedule: str, repeats: int = 1, axis: str = "pipeline", batch_axes: tuple[str, ...] = (),
                   backward: bool = True):
    """Runs `schedule` over microbatches xs [M, rows, ...] (rows split over `batch_axes`, manual here).

    stage_fn(params, frozen, x, side_mb, chunk) -> (y shaped like x, aux): chunk `chunk` (0..S*R-1, traced) of the
    model; `staged`, `frozen` (not differentiated) leaves [S, R, ...]: stage s's chunks r*S + s. aux leaves
    [rows, ...] (e.g. MoE routing stats) are kept from each forward. tail_fn(tail, y, side_mb) -> the summed loss of
    a microbatch's rows after the last chunk. side: per-row inputs [M, rows, ...] (positions, targets, ...).
    Returns (loss, (d staged, d tail, d xs) or None without `backward`, aux [S, R, M, rows, ...]): loss and
    gradients summed over every microbatch and replica."""
    S, M, R = mesh.shape[axis], xs.shape[0], repeats
    prog = program(schedule, S, M, R, forward_only=not backward)
    n_slots = prog.pop("slots")
    # Only the branches the table uses are traced (1F1B has no split backward, ZB-H1 no whole one).
    codes = prog["kind"] + 5 * prog["last"]
    used = sorted(set(codes.flat))
    prog["branch"] = np.searchsorted(used, codes).astype(np.int32)
    rows = {k: jnp.asarray(v) for k, v in prog.items()}
    manual = {axis, *batch_axes}
    # XLA:CPU fails a check on a bf16 all-reduce in a partial-manual shard_map ("Invalid binary instruction
    # opcode copy", jax 0.10.2): there the sums run in f32.
    widen = mesh_lib.compile_platform() == "cpu"

    def psum(tree, axes):
        if not widen:
            return jax.lax.psum(tree, axes)
        dtypes = jax.tree.map(lambda a: a.dtype, tree)
        summed = jax.lax.psum(jax.tree.map(mesh_lib._widened, tree), axes)
        return jax.tree.map(lambda a, d: a.astype(d), summed, dtypes)
    ahead = [(i, (i + 1) % S) for i in range(S)]
    back = [(i, (i - 1) % S) for i in range(S)]

    def local(*args):
        # No activation constraints inside: they name the whole mesh, which a jax.vjp traced in the manual
        # context cannot transpose (jax 0.10.2); the auto axes (tensor) follow the weights.
        token = mesh_lib._ACTIVE.set(None)
        try:
            return body(*args)
        finally:
            mesh_lib._ACTIVE.reset(token)

    def body(staged, frozen, tail, xs, side):
        staged, frozen = (jax.tree.map(lambda w: w[0], t) for t in (staged, frozen))  # [R, ...]: this stage's
        s = jax.lax.axis_index(axis)
        aux_shape = jax.eval_shape(lambda: stage_fn(_at(staged, 0), _at(frozen, 0), xs[0], _at(side, 0), s)[1])
        fns = [_branches(stage_fn, tail_fn, aux_shape)[c] for c in used]
        x_buf = jnp.zeros((n_slots, *xs.shape[1:]), xs.dtype)
        aux_buf = jax.tree.map(lambda a: jnp.zeros((R, M, *a.shape), a.dtype), aux_shape)
        carry = dict(x=x_buf, g=jnp.zeros_like(x_buf) if backward else None, grads=_zeros(staged) if backward else None,
                     dtail=_zeros(tail) if backward else None, dxs=jnp.zeros_like(xs) if backward else None,
                     loss=jnp.zeros((), jnp.float32), aux=aux_buf, fwd=jnp.zeros_like(xs[0]), bwd=jnp.zeros_like(xs[0]))

        def tick(c, row):
            row = {k: v[s] for k, v in row.items()}
            # What arrived at the end of the last tick goes to its slot; chunk 0's F reads the data.
            x_buf = _put(c["x"], jnp.maximum(row["fwd_slot"], 0), c["fwd"], row["fwd_slot"] < 0)
            x_buf = _put(x_buf, row["slot"], _at(xs, row["mb"]), row["load"] == 0)
            g_buf = _put(c["g"], jnp.maximum(row["bwd_slot"], 0), c["bwd"], row["bwd_slot"] < 0) if backward else None
            chunk = row["chunk"]
            args = (_at(staged, chunk), _at(frozen, chunk), _at(x_buf, row["slot"]),
                    _at(g_buf, row["slot"]) if backward else jnp.zeros_like(xs[0]), _at(side, row["mb"]),
                    chunk * S + s, tail)
            y, dx, dp, dtail, dloss, aux = jax.lax.switch(row["branch"], fns, *args)
            new = dict(c, x=x_buf, g=g_buf, loss=c["loss"] + dloss)
            is_f = row["kind"] == _CODE["F"]
            new["aux"] = jax.tree.map(lambda b, a: b.at[chunk, row["mb"]].set(jnp.where(is_f, a, b[chunk, row["mb"]])),
                                      c["aux"], aux)
            if backward:
                new["grads"] = jax.tree.map(lambda acc, d: _put(acc, chunk, _at(acc, chunk) + d, False), c["grads"], dp)
                new["dtail"] = jax.tree.map(jnp.add, c["dtail"], dtail)
                new["dxs"] = _put(c["dxs"], row["mb"], dx, row["first"] == 0)
                new["bwd"] = jax.lax.ppermute(dx, axis, back)
            new["fwd"] = jax.lax.ppermute(y, axis, ahead)
            return new, None

        c, _ = jax.lax.scan(tick, carry, rows)
        loss, grads, dtail, dxs = c["loss"], c["grads"], c["dtail"], c["dxs"]
        if batch_axes:  # each replica summed its own rows: one all-reduce over the replicas, after the loop
            loss, grads, dtail = psum((loss, grads, dtail), batch_axes)
        # Only the last stage has the loss and the tail's gradient, only stage 0 the input gradients.
        loss, dtail, dxs = psum((loss, dtail, dxs), axis)
        aux = jax.tree.map(lambda a: a[None], c["aux"])
        return loss, (jax.tree.map(lambda g: g[None], grads), dtail, dxs) if backward else None, aux

    stage_spec = jax.tree.map(lambda _: P(axis), (staged, frozen))
    rows_spec = P(None, batch_axes or None)
    aux_spec = P(axis, None, None, batch_axes or None)
    grads_spec = (stage_spec[0], P(), rows_spec) if backward else None
    return jax.shard_map(local, mesh=mesh, in_specs=(*stage_spec, P(), rows_spec, rows_spec),
                         out_specs=(P(), grads_spec, aux_spec), axis_names=manual,
                         check_vma=False)(staged, frozen, tail, xs, side)


def pipelined_loss(stage_fn: Callable, tail_fn: Callable, staged, frozen, tail, x, side, *, mesh, schedule: str,
                   microbatches: int, repeats: int = 1, axis: str = "pipeline", batch_axes: tuple[str, ...] = ()):
    """(summed loss, aux) of `loss_and_grads` on x [batch, ...] and side [batch, ...] split into `microbatches`
    (mesh.split_microbatches), differentiable in staged, tail and x: a jax.custom_vjp whose forward runs the whole
    schedule, forwards and backwards, and keeps the gradients for its backward (the cotangent times them). Not
    differentiated (eval), it runs the forwards alone. aux: [S, R, M, rows, ...], not differentiated."""
    M = microbatches
    split = lambda t: jax.tree.map(lambda a: mesh_lib.split_microbatches(a, M), t)  # noqa: E731
    opts = dict(mesh=mesh, schedule=schedule, repeats=repeats, axis=axis, batch_axes=batch_axes)

    @jax.custom_vjp
    def loss(staged, frozen, tail, x, side):
        value, _, aux = loss_and_grads(stage_fn, tail_fn, staged, frozen, tail, split(x), split(side),
                                       backward=False, **opts)
        return value, aux

    def fwd(staged, frozen, tail, x, side):
        value, grads, aux = loss_and_grads(stage_fn, tail_fn, staged, frozen, tail, split(x), split(side), **opts)
        return (value, aux), grads

    def bwd(grads, cotangents):
        ct = cotangents[0]  # aux's are ignored: it is not differentiated
        d_staged, d_tail, dxs = grads
        scale = lambda t: jax.tree.map(lambda g: (g * ct).astype(g.dtype), t)  # noqa: E731
        dx = jnp.swapaxes(dxs, 0, 1).reshape(dxs.shape[0] * dxs.shape[1], *dxs.shape[2:])  # split's inverse
        return scale(d_staged), None, scale(d_tail), scale(dx), None

    loss.defvjp(fwd, bwd)
    return loss(staged, frozen, tail, x, side)


def value_and_grad(stage_fn: Callable, loss_fn: Callable, params, xs, targets, *, mesh, schedule: str = "1f1b",
                   repeats: int = 1, axis: str = "pipeline", batch_axes: tuple[str, ...] = ()):
    """(loss, grads) of mean over m of loss_fn(model(xs[m]), targets[m]), the model being the S*R chunks of
    `params` (leaves [S*R, ...], model order) in turn: stage_fn(chunk_params, x) -> y shaped like x. xs, targets:
    [M, rows, ...] microbatches; loss_fn a mean over rows. Equals jax.value_and_grad of the unpipelined loss."""
    S, M, R = mesh.shape[axis], xs.shape[0], repeats
    replicas = math.prod(mesh.shape[a] for a in batch_axes)
    # Stage-major [S, R, ...]: chunk r*S + s on stage s, as pipeline.layer_order keeps circular's layers.
    staged = jax.tree.map(lambda w: jnp.swapaxes(w.reshape(R, S, *w.shape[1:]), 0, 1), params)
    loss, (grads, _, _), _ = loss_and_grads(
        lambda p, f, x, side, c: (stage_fn(p, x), {}), lambda tail, y, t: loss_fn(y, t) / (M * replicas),
        staged, {}, {}, xs, targets, mesh=mesh, schedule=schedule, repeats=repeats, axis=axis, batch_axes=batch_axes)
    return loss, jax.tree.map(lambda g: jnp.swapaxes(g, 0, 1).reshape(S * R, *g.shape[2:]), grads)
