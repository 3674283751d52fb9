"""Goodput: the share of wall time that produced the steps the final model is made of.

A run (process 0 only) appends one JSON object a line to WORKDIR/goodput.jsonl:

    {"event": "start",      "attempt": n, "t": unix, "step": s}   training (re)starts after step s
    {"event": "step",       "attempt": n, "t": unix, "step": s, "step_s": dt}
                                          the steps since the previous record, up to s, took dt productive s
    {"event": "checkpoint", "attempt": n, "t": unix, "step": s}   a checkpoint of step s committed
    {"event": "rewind",     "attempt": n, "t": unix, "step": s}   rolled back to step s inside the run

`attempt` is JAXTRAIN_ATTEMPT (set by jaxtrain.tools.supervise; null without it). Every "start" begins a new
attempt, so plain reruns count too. Productive time is that of the steps in the final lineage: when an
attempt resumes from step s, the earlier steps after s were recomputed, and their time is badput.
"""

from __future__ import annotations

import json
import os
import time


class GoodputRecorder:
    """Writes the records above. Each record opens, appends and closes the file (a few per log interval):
    a SIGKILL loses at most the line being written, and `read_records` skips a torn one."""

    def __init__(self, path: str | os.PathLike, attempt: int | None = None):
        if attempt is None and os.environ.get("JAXTRAIN_ATTEMPT"):
            attempt = int(os.environ["JAXTRAIN_ATTEMPT"])
        self.attempt, self.path = attempt, path
        # A line an earlier attempt's kill cut short would swallow our first record: end it first.
        if os.path.exists(path) and os.path.getsize(path):
            with open(path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def _write(self, event: str, step: int, **extra):
        record = {"event": event, "attempt": self.attempt, "t": round(time.time(), 3), "step": int(step), **extra}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def start(self, step: int) -> None:
        self._write("start", step)

    def steps(self, step: int, step_s: float) -> None:
        self._write("step", step, step_s=round(float(step_s), 6))

    def checkpoint(self, step: int) -> None:
        self._write("checkpoint", step)

    def rewind(self, step: int) -> None:
        self._write("rewind", step)


def read_records(path: str | os.PathLike, offset: int = 0) -> list[dict]:
    """The records from byte `offset` on (the supervisor passes the file's size when it started). A line that is
    not one of the records above (cut short by a kill, or garbage) is skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # the line a kill interrupted
                continue
            if _is_record(record):
                records.append(record)
    return records


def _is_record(r) -> bool:
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return (isinstance(r, dict) and r.get("event") in ("start", "step", "checkpoint", "rewind")
            and isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool) and number(r.get("t"))
            and number(r.get("step_s", 0.0)))


def goodput(records: list[dict], wall_s: float) -> dict:
    """Productive seconds of the final lineage over `wall_s`.

    A "step" record covering steps (a, b] with a resume point s inside it is split in proportion: the
    part up to s stays productive, the rest is lost.
    """
    kept: list[list[float]] = []  # [first_step_exclusive, last_step, seconds], in lineage order
    at = 0
    lost_s, steps_lost = 0.0, 0
    attempts: list[dict] = []

    def cut(step):
        nonlocal lost_s, steps_lost
        while kept and kept[-1][1] > step:
            lo, hi, dt = kept.pop()
            keep = max(0.0, (step - lo) / (hi - lo))
            if keep:
                kept.append([lo, step, dt * keep])
            lost_s += dt * (1 - keep)
            steps_lost += hi - max(lo, step)

    for r in records:
        event, step = r.get("event"), r.get("step", 0)
        if event == "start":
            cut(step)
            at = step
            attempts.append({"attempt": r.get("attempt"), "start_step": step, "last_step": step,
                             "last_checkpoint": None, "step_s": 0.0})
        elif not attempts:
            continue  # records before the first start (a file cut at an offset): no lineage to attach to
        elif event == "rewind":
            cut(step)
            at = step
            attempts[-1]["last_step"] = step
        elif event == "step" and step > at:
            kept.append([at, step, float(r.get("step_s", 0.0))])
            attempts[-1]["step_s"] += float(r.get("step_s", 0.0))
            attempts[-1]["last_step"] = at = step
        elif event == "checkpoint":
            attempts[-1]["last_checkpoint"] = step

    productive = sum(dt for _, _, dt in kept)
    return {
        "productive_s": productive,
        "wall_s": wall_s,
        "goodput": productive / wall_s if wall_s > 0 else 0.0,
        "lost_s": lost_s,
        "steps_lost": steps_lost,
        "final_step": at,
        "restarts": max(0, len(attempts) - 1),
        "attempts": attempts,
    }
