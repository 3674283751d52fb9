"""The explicit pipeline schedules (1F1B, interleaved 1F1B, zero bubble) as a plan counts them, read from their
tables (jaxtrain.parallel.schedules) and the executor's program (jaxtrain.parallel.pipeline_exec).

The executor runs the table with every action one tick, the stages in lockstep: each tick a `lax.switch` runs
one branch per stage (idle, F, B, W, BW; the last chunk's with the loss), then one ppermute sends the forward
outputs on and one the input gradients back. A stage holds the inputs and output gradients of its in-flight
(microbatch, chunk) pairs, the table's peak, and recomputes a chunk's layers in each backward. The compiled HLO
holds every branch of that switch once: `work_weights` and `lockstep_weights` say how often each really runs.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=64)
def executor(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> dict:
    """{"ticks": the executor's ticks, "in_flight": the (microbatch, chunk) inputs a device holds at once (the
    table's peak over its stages: every device allocates the busiest stage's slots), "branches": [ticks][stages]
    switch branch indices, "n_branches"}."""
    import numpy as np  # noqa: PLC0415

    from jaxtrain.parallel import pipeline_exec, schedules  # noqa: PLC0415 (imports jax)
    table = schedules.build(schedule, stages, microbatches, repeats)
    prog = pipeline_exec.program(schedule, stages, microbatches, repeats)
    codes = prog["kind"] + 5 * prog["last"]  # pipeline_exec.loss_and_grads: branch = rank of kind + 5 * last
    used = sorted(set(codes.flat))
    branches = np.searchsorted(used, codes)
    return {"ticks": int(codes.shape[0]), "in_flight": max(schedules.peak_activations(table)),
            "branches": tuple(map(tuple, branches.tolist())), "n_branches": len(used)}


def permute_payload(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> int:
    """Microbatch hand-offs the busiest stage sends a step: an output on and an input gradient back per microbatch
    and chunk, but the last chunk's output and the first chunk's gradient (2MR, or 2MR - M on two stages)."""
    S, M, R = stages, microbatches, repeats
    return max(M * (R - (s == S - 1)) + M * (R - (s == 0)) for s in range(S))


def work_weights(schedule: str, stages: int, microbatches: int, repeats: int = 1):
    """hlo.chosen_branches weights for the executor's switch (a conditional of its branch count): each branch's
    share of the (tick, stage) cells, so that a device's count is the mean stage's work. None for others."""
    ex = executor(schedule, stages, microbatches, repeats)
    cells = [b for row in ex["branches"] for b in row]
    shares = [cells.count(b) / len(cells) for b in range(ex["n_branches"])]
    return lambda instr, costs: shares if len(costs) == ex["n_branches"] else None


def lockstep_weights(schedule: str, stages: int, microbatches: int, repeats: int = 1):
    """Like `work_weights`, but each tick runs the costliest of its stages' branches: the stages wait for each
    other at the tick's ppermute, so this is the step's time (the roofline's)."""
    ex = executor(schedule, stages, microbatches, repeats)

    def weights(instr, costs):
        if len(costs) != ex["n_branches"]:
            return None
        out = [0.0] * len(costs)
        for row in ex["branches"]:
            out[max(set(row), key=costs.__getitem__)] += 1 / ex["ticks"]
        return out

    return weights
