"""Goodput: the share of wall time that produced the steps the final model is made of.

A run (process 0 only) appends one JSON object a line to WORKDIR/goodput.jsonl:

    {"event": "start",      "attempt": n, "t": unix, "step": s}   training (re)starts after step s
    {"event": "step",       "attempt": n, "t": unix, "step": s, "step_s": dt}
                                          the steps since the previous record, up to s, took dt productive s
    {"event": "checkpoint", "attempt": n, "t": unix, "step": s}   a checkpoint of step s committed
    {"event": "rewind",     "attempt": n, "t": unix, "step": s}   rolled back to step s inside the run
    {"event": "phases",     "attempt": n, "t": unix, "step": s, "phases": {name: seconds}, "compile": ...,
                            "restore_tier": ...}  where the (re)start's time went, just before it trains (PHASES)

`attempt` is JAXTRAIN_ATTEMPT (set by jaxtrain.tools.supervise; null without it). Every "start" begins a new
attempt, so plain reruns count too. Productive time is that of the steps in the final lineage: when an
attempt resumes from step s, the earlier steps after s were recomputed, and their time is badput.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

# A (re)start's phases, in order (seconds each; absent where unknown). detection: from the previous attempt's last
# record to the supervisor seeing it exit; restart_wait: the supervisor's backoff; process_start: launch (or the
# process's own start) to train.run; setup: train.run's other work before training (checks, model, data, hooks).
PHASES = ("detection", "restart_wait", "process_start", "distributed_init", "setup", "restore", "data_restore",
          "compile")
LAUNCHED_AT_ENV, PREVIOUS_EXIT_AT_ENV = "JAXTRAIN_LAUNCHED_AT", "JAXTRAIN_PREVIOUS_EXIT_AT"  # set by supervise


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

    def phases(self, step: int, phases: dict[str, float], **extra) -> None:
        self._write("phases", step, phases={k: round(v, 4) for k, v in phases.items()}, **extra)


class Phases:
    """Seconds per named phase of a start, summed over each `with phases.time(name)`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


def process_start_time() -> float | None:
    """This process's start (unix seconds) from the kernel (psutil, or /proc on Linux); None if unknown."""
    try:
        import psutil  # noqa: PLC0415 - optional
        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - not installed, or no access: try /proc
        pass
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def start_phases(run_entry_t: float, path: str | os.PathLike, environ=os.environ) -> dict[str, float]:
    """The phases before train.run (detection, restart_wait, process_start) of a start whose train.run began at
    unix time `run_entry_t`; `path`: goodput.jsonl, whose last record before the previous exit dates it."""
    out = {}
    launched = _float(environ.get(LAUNCHED_AT_ENV))
    exited = _float(environ.get(PREVIOUS_EXIT_AT_ENV))
    if exited is not None:
        tail = read_records(path, max(0, _size(path) - (1 << 16)))
        seen = [r["t"] for r in tail if r["t"] <= exited and r["t"] < run_entry_t]  # not this start's own
        if seen:
            out["detection"] = max(0.0, exited - max(seen))
        if launched is not None:
            out["restart_wait"] = max(0.0, launched - exited)
    began = launched if launched is not None else process_start_time()
    if began is not None:
        out["process_start"] = max(0.0, run_entry_t - began)
    return out


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


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
    return (isinstance(r, dict) and r.get("event") in ("start", "step", "checkpoint", "rewind", "phases")
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


def restarts(records: list[dict]) -> list[dict]:
    """One row per "phases" record: {"attempt", "step", "t", "phases": {name: s, in PHASES order}, "total_s",
    "compile", "restore_tier", "first_step_s", "restart"}; first_step_s: to the attempt's first step record when
    it covers only the first step (log.every_steps=1), else None; restart: an earlier start preceded it (each
    "phases" record follows its own "start")."""
    rows, starts = [], 0
    for i, r in enumerate(records):
        starts += r.get("event") == "start"
        if r.get("event") != "phases" or not isinstance(r.get("phases"), dict):
            continue
        phases = {k: float(r["phases"][k]) for k in PHASES if isinstance(r["phases"].get(k), (int, float))}
        nxt = next((q for q in records[i + 1:] if q.get("event") in ("step", "start", "phases")), None)
        first = nxt["t"] - r["t"] if nxt and nxt["event"] == "step" and nxt["step"] == r["step"] + 1 else None
        rows.append({"attempt": r.get("attempt"), "step": r["step"], "t": r["t"], "phases": phases,
                     "total_s": sum(phases.values()), "compile": r.get("compile"),
                     "restore_tier": r.get("restore_tier"), "first_step_s": first, "restart": starts > 1})
    return rows
