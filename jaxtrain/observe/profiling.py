"""Where a profiled step's time goes: wall time per compiled op, read from a `log.profile_steps` trace.

`--config.log.profile_steps=FIRST,LAST` traces those steps into WORKDIR/profile, saves the compiled step's HLO
beside the trace and writes this module's table to summary.txt; `jaxtrain profile WORKDIR/profile` prints it
again. XLA:CPU records one event per HLO instruction it runs; ops running at the same time share the cores, so
each instant's wall time is split evenly between them and the per-op times add up to the busy time. Matmuls
also get their FLOP rate, and every op the rate at which it moved its operands and result. Tested on CPU only:
GPU traces name their kernels differently (docs/performance.md).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

from jaxtrain.errors import ConfigError
from jaxtrain.observe import hlo as hlo_lib

HLO_FILE = "train_step.hlo.txt"
SUMMARY_FILE = "summary.txt"
# Ops that only run other ops (their events span their bodies' events).
_CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}
_PASS_THROUGH = {"bitcast", "reshape", "tuple", "get-tuple-element"}


def latest_trace(logdir) -> Path:
    """The newest Perfetto trace under `logdir` (jax.profiler writes plugins/profile/<timestamp>/)."""
    traces = sorted(Path(logdir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {logdir} (written by --config.log.profile_steps)")
    return traces[-1]


def split_wall_time(events: list[dict]) -> tuple[collections.Counter, collections.Counter]:
    """({name: microseconds}, {name: events}) with each instant's wall time split evenly between the events
    running then."""
    times, counts = collections.Counter(), collections.Counter()
    edges = []
    for i, e in enumerate(events):
        counts[e["name"]] += 1
        edges += [(e["ts"], 1, i), (e["ts"] + e["dur"], 0, i)]
    active, last = set(), None
    for t, starts, i in sorted(edges):  # at equal times ends (0) sort before starts (1)
        if active and t > last:
            share = (t - last) / len(active)
            for j in active:
                times[events[j]["name"]] += share
        last = t
        (active.add if starts else active.discard)(i)
    return times, counts


def _describe(module, instr, fused: dict) -> tuple[str, float, str]:
    """(kind, FLOPs per run, what) of an executed instruction: kind "matmul", "collective" or the op (a fusion's
    root op). `fused`: {fusion name: its computation's instructions}."""
    body = fused.get(instr["name"], [instr])
    dots = [d for d in body if d["op"] in ("dot", "convolution")]
    if dots:
        shapes = module["shapes"]
        what = "; ".join(" x ".join(shapes.get(o, "?").split("{")[0] for o in hlo_lib.operands(d)[:2])
                         + " -> " + d["shape"].split("{")[0] for d in dots)
        return "matmul", sum(hlo_lib.instruction_flops(module, d) for d in dots), what
    root = next((d for d in body if d["root"]), instr)
    by_name = {d["name"]: d for d in body}
    while root["op"] in _PASS_THROUGH and hlo_lib.operands(root) and hlo_lib.operands(root)[0] in by_name:
        root = by_name[hlo_lib.operands(root)[0]]  # name the fusion by what it computes, not its last reshape
    kind = "collective" if root["op"].startswith(hlo_lib.COLLECTIVES) else root["op"]
    op_name = re.search(r'op_name="([^"]+)"', instr["rest"]) or re.search(r'op_name="([^"]+)"', root["rest"])
    where = re.sub(r"^jit\([^)]*\)/", "", op_name.group(1))[-60:] if op_name else ""
    return kind, 0.0, f"{instr['shape'].split('{')[0]}  {where}".rstrip()


def summarize(trace_path, hlo_text: str, steps: int) -> dict:
    """{"steps", "span_ms", "busy_ms", "kinds": [...], "ops": [...]}, times per step (an op's "flops" and "bytes",
    its operands' and result's: per run):
    every event of the trace that names an instruction of the compiled module `hlo_text` (containers such as while
    loops excluded). Events are matched by name only: another computation run inside the traced steps (an eval)
    adds its ops of the same names."""
    module = hlo_lib.parse_hlo(hlo_text)
    events = json.load(gzip.open(trace_path))["traceEvents"]
    events = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None
              and e["name"] in module["by_name"] and module["by_name"][e["name"]]["op"] not in _CONTAINERS]
    if not events:
        raise ValueError(f"{trace_path}: no event names an instruction of the compiled step")
    times, counts = split_wall_time(events)
    fused = {f["name"]: module["computations"][comp] for comp, f in module["fusion_of"].items()}
    ops, kinds = [], collections.defaultdict(lambda: {"ms": 0.0, "flops": 0.0})
    for name, us in times.items():
        instr = module["by_name"][name]
        kind, flops, what = _describe(module, instr, fused)
        runs = counts[name] / steps
        moved = hlo_lib.shape_bytes(instr["shape"]) + sum(hlo_lib.shape_bytes(module["shapes"].get(o, ""))
                                                       for o in hlo_lib.operands(instr))
        ops.append({"op": name, "ms": us / 1e3 / steps, "runs": runs, "kind": kind, "what": what, "flops": flops,
                    "bytes": moved, "gflops_per_s": flops * runs / (us / 1e3 / steps) / 1e6 if flops and us else None,
                    "gbytes_per_s": moved * runs / (us / 1e3 / steps) / 1e6 if us else None})
        kinds[kind]["ms"] += us / 1e3 / steps
        kinds[kind]["flops"] += flops * runs
    busy = sum(op["ms"] for op in ops)
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3 / steps
    return {"steps": steps, "span_ms": span, "busy_ms": busy,
            "kinds": sorted(({"kind": k, "ms": v["ms"], "gflops_per_s": v["flops"] / v["ms"] / 1e6 if v["flops"]
                              else None} for k, v in kinds.items()), key=lambda r: -r["ms"]),
            "ops": sorted(ops, key=lambda r: -r["ms"])}


def format_summary(s: dict, top: int = 30, kinds: int | None = None) -> str:
    """The summary as text: the kinds (the first `kinds` of them; all by default), then the `top` ops (none if 0)."""
    rate = lambda r: f"{r['gflops_per_s']:8.0f}" if r["gflops_per_s"] else " " * 8  # noqa: E731
    lines = [f"{s['steps']} step(s): {s['span_ms']:.1f} ms per step from the first op to the last, ops busy "
             f"{s['busy_ms']:.1f} ms (wall time split between ops running at once)",
             f"{'kind':<24} {'ms/step':>9} {'share':>6} {'GFLOP/s':>8}"]
    lines += [f"{r['kind']:<24} {r['ms']:9.2f} {r['ms'] / s['busy_ms']:6.1%} {rate(r)}" for r in s["kinds"][:kinds]]
    if not top:
        return "\n".join(lines)
    moved = lambda r: f"{r['gbytes_per_s']:6.1f}" if r.get("gbytes_per_s") else " " * 6  # noqa: E731
    lines += ["", f"{'op':<32} {'ms/step':>9} {'share':>6} {'runs':>5} {'GFLOP/s':>8} {'GB/s':>6}  what"]
    lines += [f"{r['op']:<32} {r['ms']:9.2f} {r['ms'] / s['busy_ms']:6.1%} {r['runs']:5.0f} {rate(r)} {moved(r)}  "
              f"{r['kind']}: {r['what']}" for r in s["ops"][:top]]
    return "\n".join(lines)


def traced_steps(logdir) -> int:
    """The step count the run's summary.txt starts with ("3 step(s): ..."), else 1."""
    try:
        return int(re.match(r"(\d+) step", (Path(logdir) / SUMMARY_FILE).read_text()).group(1))
    except (OSError, AttributeError):
        return 1


def write_summary(logdir, hlo_text: str, steps: int) -> dict:
    """Saves the compiled step's HLO and the table of the newest trace under `logdir`; returns the summary."""
    logdir = Path(logdir)
    (logdir / HLO_FILE).write_text(hlo_text)
    summary = summarize(latest_trace(logdir), hlo_text, steps)
    (logdir / SUMMARY_FILE).write_text(format_summary(summary, top=60) + "\n")
    return summary



def parse_steps(spec) -> tuple[int, int] | None:
    """log.profile_steps "FIRST,LAST" or "STEP" -> (first, last), "" -> None; ConfigError otherwise."""
    if spec == "":
        return None
    parts = str(spec).split(",")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if not 1 <= first <= last:
        raise ConfigError("log.profile_steps", f"expected \"FIRST,LAST\" or \"STEP\" with 1 <= FIRST <= LAST, "
                          f"got {spec!r}")
    return first, last
