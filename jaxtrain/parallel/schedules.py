"""Pipeline schedules as data: pure functions from (stages S, microbatches M, repeats R) to a table of actions.

A table has one row per stage and one cell per tick: an `Action` or None (idle). `F(mb, c)` runs chunk c's
forward on microbatch mb; `B` its input gradient and `W` its weight gradient (split backward, zero_bubble);
`BW` the whole backward (the other schedules). The layers form S*R chunks, chunk c on stage c % S.
Time model: an action takes `costs[kind]` ticks (default F = B = W = 1, BW = 2; measured transformer ratios are
near F:B:W = 1:1:1, and full remat adds a forward to B). A result is usable by the neighbouring stage from the
tick after it ends: sends overlap compute, zero latency. Each builder fixes every stage's order of actions;
`place` then starts each action as early as its stage and its inputs allow.
Activations of (mb, c) are held on c's stage from its F until its backward ends (BW, or the later W): `validate`
measures each stage's peak, `activation_bound` is the schedule's documented bound (in chunk activations, one
chunk = L/(S*R) layers). `circular` is today's pipeline.run under autodiff (all forwards, then all backwards in
reverse); gpipe and circular train under autodiff (pipeline.run), the others through pipeline_exec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from jaxtrain.errors import ConfigError

COSTS = {"F": 1, "B": 1, "W": 1, "BW": 2}
KINDS = ("F", "B", "W", "BW")


class Action(NamedTuple):
    kind: str  # "F", "B", "W" or "BW"
    mb: int
    chunk: int  # 0..S*R-1, on stage chunk % S


@dataclass(frozen=True)
class Table:
    schedule: str
    stages: int
    microbatches: int
    repeats: int
    costs: dict
    rows: tuple  # rows[s][t]: the Action stage s runs at tick t (one of `costs[kind]` cells), or None


# --- Checks -------------------------------------------------------------------------------------------
def check(schedule: str, stages: int, microbatches: int, repeats: int = 1, n_layers: int | None = None) -> None:
    """ConfigError naming the `pipeline` field a schedule cannot take (the layer count too, when given)."""
    if schedule not in BUILDERS:
        raise ConfigError("pipeline.schedule", f"unknown schedule {schedule!r}; choose one of {list(BUILDERS)}")
    for field, v in (("stages", stages), ("microbatches", microbatches), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"pipeline.{field}", f"must be an integer >= 1, got {v!r}")
    S, M, R = stages, microbatches, repeats
    if R != 1 and schedule not in ("interleaved_1f1b", "circular"):
        raise ConfigError("pipeline.repeats", f"only interleaved_1f1b and circular repeat; {schedule} needs 1, got {R}")
    if n_layers is not None:
        if n_layers % S:
            raise ConfigError("pipeline.stages", f"n_layers={n_layers} is not divisible by stages={S}")
        if n_layers % (S * R):
            raise ConfigError("pipeline.repeats", f"n_layers={n_layers} is not divisible by stages*repeats={S}*{R}")
    if schedule in ("1f1b", "interleaved_1f1b", "zero_bubble") and M < S:
        raise ConfigError("pipeline.microbatches", f"{schedule} needs microbatches >= stages, got {M} < {S}")
    if schedule == "interleaved_1f1b" and M % S:
        # Megatron's order runs the microbatches in groups of S per chunk.
        raise ConfigError("pipeline.microbatches", f"interleaved_1f1b needs microbatches divisible by stages, "
                          f"got {M} and {S}")
    if schedule == "circular" and R > 1 and M < S:
        raise ConfigError("pipeline.microbatches", f"circular with repeats>1 needs microbatches >= stages, "
                          f"got {M} < {S}")


# --- Per-stage orders ---------------------------------------------------------------------------------
def _gpipe(S, M, R):  # all forwards, then the backwards in reverse, as autodiff of the forward loop runs them
    return [[Action("F", m, s) for m in range(M)] + [Action("BW", m, s) for m in reversed(range(M))]
            for s in range(S)]


def _circular(S, M, R):  # today's pipeline.run: every microbatch round the ring R times, then reversed
    orders = []
    for s in range(S):
        fwd = [Action("F", k % M, (k // M) * S + s) for k in range(R * M)]
        orders.append(fwd + [Action("BW", a.mb, a.chunk) for a in reversed(fwd)])
    return orders


def _one_f_one_b(S, M, R, *, split=False):
    """1F1B: S-s-1 warm-up forwards, then one forward and one backward in turn. `split` (ZB-H1): the backward is
    B then W, and stage s defers its W by s microbatches, into the drain's bubble; each stage then holds S."""
    orders = []
    for s in range(S):
        order, warm = [], min(S - s - 1, M)
        order += [Action("F", m, s) for m in range(warm)]
        for b in range(M):
            if warm + b < M:
                order.append(Action("F", warm + b, s))
            if not split:
                order.append(Action("BW", b, s))
                continue
            order.append(Action("B", b, s))
            if b - s >= 0:
                order.append(Action("W", b - s, s))
        order += [Action("W", m, s) for m in range(max(M - s, 0), M)] if split else []
        orders.append(order)
    return orders


def _interleaved(S, M, R):
    """Megatron's interleaved 1F1B: stage s holds chunks r*S + s; microbatches go in groups of S through each
    chunk in turn (backwards through the chunks in reverse); 2(S-s-1) + (R-1)S warm-up forwards."""
    def nth(k, backward):  # the stage's k-th forward (or backward): (microbatch, local chunk)
        r = (k // S) % R
        return (k // (S * R)) * S + k % S, (R - 1 - r if backward else r)

    orders, total = [], M * R
    for s in range(S):
        warm = min(total, 2 * (S - s - 1) + (R - 1) * S)
        order = []
        for k in range(warm):
            m, r = nth(k, False)
            order.append(Action("F", m, r * S + s))
        for k in range(total):
            if warm + k < total:
                m, r = nth(warm + k, False)
                order.append(Action("F", m, r * S + s))
            m, r = nth(k, True)
            order.append(Action("BW", m, r * S + s))
        orders.append(order)
    return orders


BUILDERS = {
    "gpipe": _gpipe,
    "circular": _circular,
    "1f1b": _one_f_one_b,
    "interleaved_1f1b": _interleaved,
    "zero_bubble": lambda S, M, R: _one_f_one_b(S, M, R, split=True),
}


def activation_bound(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> tuple[int, ...]:
    """Each stage's documented peak of held chunk activations: GPipe M, circular R*M, 1F1B min(M, S-s),
    interleaved min(R*M, 2(S-s-1) + (R-1)S + 1), zero_bubble (ZB-H1) S on every stage (1F1B's stage 0)."""
    check(schedule, stages, microbatches, repeats)
    S, M, R = stages, microbatches, repeats
    per_stage = {
        "gpipe": lambda s: M,
        "circular": lambda s: R * M,
        "1f1b": lambda s: min(M, S - s),
        "interleaved_1f1b": lambda s: min(R * M, 2 * (S - s - 1) + (R - 1) * S + 1),
        "zero_bubble": lambda s: min(M, S),
    }[schedule]
    return tuple(per_stage(s) for s in range(S))


# --- Placement ----------------------------------------------------------------------------------------
def _deps(a: Action, n_chunks: int) -> list[Action]:
    """The actions `a` needs, by kind: F the previous chunk's F; B / BW their own F and the next chunk's B / BW;
    W its own B."""
    if a.kind == "F":
        return [Action("F", a.mb, a.chunk - 1)] if a.chunk else []
    if a.kind == "W":
        return [Action("B", a.mb, a.chunk)]
    return [Action("F", a.mb, a.chunk)] + ([Action(a.kind, a.mb, a.chunk + 1)] if a.chunk + 1 < n_chunks else [])


def place(orders, stages: int, costs: dict | None = None) -> tuple:
    """Rows of ticks for per-stage action orders: each action starts once its stage is free and its inputs
    have ended. RuntimeError if the orders deadlock (a builder's bug)."""
    costs = dict(COSTS, **(costs or {}))
    n_chunks = 1 + max(a.chunk for order in orders for a in order)
    end, free, pos, rows = {}, [0] * stages, [0] * stages, [[] for _ in range(stages)]
    left = sum(map(len, orders))
    while left:
        progress = False
        for s, order in enumerate(orders):
            while pos[s] < len(order):
                a = order[pos[s]]
                deps = _deps(a, n_chunks)
                if any(d not in end for d in deps):
                    break
                start = max([free[s]] + [end[d] for d in deps])
                rows[s] += [None] * (start - len(rows[s])) + [a] * costs[a.kind]
                end[a] = free[s] = start + costs[a.kind]
                pos[s], left, progress = pos[s] + 1, left - 1, True
        if not progress:
            raise RuntimeError(f"schedule deadlocks: stage orders stuck at {[o[p:p + 1] for o, p in zip(orders, pos)]}")
    ticks = max(map(len, rows))
    return tuple(tuple(r + [None] * (ticks - len(r))) for r in rows)


def build(schedule: str, stages: int, microbatches: int, repeats: int = 1, *, n_layers: int | None = None,
          costs: dict | None = None) -> Table:
    """The schedule's table (ConfigError for what it cannot run). `costs` overrides COSTS, in ticks."""
    check(schedule, stages, microbatches, repeats, n_layers)
    costs = dict(COSTS, **(costs or {}))
    if any(not isinstance(costs[k], int) or costs[k] < 1 for k in KINDS):
        raise ConfigError("costs", f"each action takes a whole number >= 1 of ticks, got {costs}")
    orders = BUILDERS[schedule](stages, microbatches, repeats)
    return Table(schedule, stages, microbatches, repeats, costs, place(orders, stages, costs))


# --- Reading a table ----------------------------------------------------------------------------------
def spans(table: Table) -> dict:
    """{(stage, action): (start, end)} in ticks; ValueError if an action's cells are split or miscounted."""
    out = {}
    for s, row in enumerate(table.rows):
        t = 0
        while t < len(row):
            a = row[t]
            if a is None:
                t += 1
                continue
            n = table.costs[a.kind]
            if tuple(row[t:t + n]) != (a,) * n or (s, a) in out:
                raise ValueError(f"stage {s} tick {t}: {a} does not fill one run of {n} ticks")
            out[(s, a)] = (t, t + n)
            t += n
    return out


def validate(table: Table) -> tuple[int, ...]:
    """Checks every dependency and that each (mb, chunk) gets one F and one BW, or one B and one W, on stage
    chunk % S; returns each stage's peak of held chunk activations (ValueError on the first violation)."""
    S, M, R = table.stages, table.microbatches, table.repeats
    if len({len(r) for r in table.rows}) > 1 or len(table.rows) != S:
        raise ValueError(f"{len(table.rows)} rows of unequal length for {S} stages")
    at = {}
    for (s, a), span in spans(table).items():
        if a.chunk % S != s or not (0 <= a.mb < M and 0 <= a.chunk < S * R):
            raise ValueError(f"{a} on stage {s}: chunk {a.chunk} lives on stage {a.chunk % S}, M={M}, R={R}")
        at[a] = span
    for m in range(M):
        for c in range(S * R):
            kinds = sorted(a.kind for a in at if a.mb == m and a.chunk == c)
            if kinds not in (["BW", "F"], ["B", "F", "W"]):
                raise ValueError(f"microbatch {m} chunk {c}: actions {kinds}, want F with BW or with B and W")
    for a, (start, _) in at.items():
        deps = _deps(a, S * R)
        if a.kind in ("B", "BW") and a.chunk + 1 < S * R:  # the next chunk's backward may be either kind
            nxt = [Action(k, a.mb, a.chunk + 1) for k in ("B", "BW") if Action(k, a.mb, a.chunk + 1) in at]
            deps = deps[:1] + nxt
        for d in deps:
            if at[d][1] > start:
                raise ValueError(f"{a} starts at tick {start} before {d} ends at tick {at[d][1]}")
    return peak_activations(table)


def peak_activations(table: Table) -> tuple[int, ...]:
    """Each stage's most chunk activations held at once: from the start of F to the end of BW (or W)."""
    peaks = []
    for s in range(table.stages):
        events = []
        for (stage, a), (start, end) in spans(table).items():
            if stage == s and a.kind == "F":
                events.append((start, 1))
            elif stage == s and a.kind in ("W", "BW"):
                events.append((end, -1))
        held = peak = 0
        for _, d in sorted(events):  # at one tick, releases (-1) sort before acquisitions
            held += d
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def bubble_fraction(table: Table) -> float:
    """Idle stage-ticks over all stage-ticks."""
    cells = [c for row in table.rows for c in row]
    return sum(c is None for c in cells) / len(cells)


def format_table(table: Table, width: int = 120, max_blocks: int | None = None) -> str:
    """A text chart, one row per stage: `F3` forward of microbatch 3 (`F3.1`: the stage's chunk 1, when
    repeats > 1), `B`/`W` the split backward, `BW` the whole one, `~` an action's further ticks, `.` idle. Wide
    charts wrap into blocks of ticks (at most `max_blocks`); the last line gives the bubble and the activation
    bound."""
    def cell(a, prev):
        if a is None:
            return "."
        if a == prev:
            return "~"
        return f"{a.kind}{a.mb}" + (f".{a.chunk // table.stages}" if table.repeats > 1 else "")

    cells = [[cell(a, row[t - 1] if t else None) for t, a in enumerate(row)] for row in table.rows]
    w = max(len(c) for row in cells for c in row)
    label = len(f"stage {table.stages - 1} ")
    per_block = max(1, (width - label) // (w + 1))
    ticks = len(cells[0])
    lines = [f"{table.schedule}: {table.stages} stages x {table.microbatches} microbatches"
             + (f" x {table.repeats} repeats" if table.repeats > 1 else "")
             + f", {ticks} ticks (F={table.costs['F']} B={table.costs['B']} W={table.costs['W']} "
               f"BW={table.costs['BW']})"]
    for lo in range(0, ticks, per_block):
        if max_blocks is not None and lo >= max_blocks * per_block:
            lines.append(f"  ... ticks {lo}-{ticks - 1} left out")
            break
        if lo:
            lines.append(f"  ticks {lo}-{min(ticks, lo + per_block) - 1}:")
        for s, row in enumerate(cells):
            lines.append(f"{'stage %d' % s:<{label}}" + " ".join(f"{c:<{w}}" for c in row[lo:lo + per_block]).rstrip())
    bound = activation_bound(table.schedule, table.stages, table.microbatches, table.repeats)
    lines.append(f"bubble {bubble_fraction(table):.1%}; activations held per stage: peak "
                 f"{list(peak_activations(table))}, bound {list(bound)} (chunk activations)")
    return "\n".join(lines)
