"""`jaxtrain report WORKDIR [WORKDIR ...] [--output DIR] [--price_per_device_hour USD] [--names a,b]`

Compares runs: PNG curves (one line per run) and a summary table (summary.md, summary.csv, stdout); where a run
restarted, where each restart's time went (recovery.md, recovery.png: goodput.jsonl's phases). It only
reads what `jaxtrain.train.run` writes into a workdir, and any of it may be missing or stale (a crashed run
has no summary.json, a running one has no end time, older workdirs have no run.json and no record times),
so every figure is taken from the best source at hand (summary.csv's wall_source names wall time's).

From a notebook:

    runs = report.load_runs(["runs/a", "runs/b"])
    report.plot_curves(runs); plt.show()
    report.write_report(["runs/a", "runs/b"], "report", price=2.0)["rows"]
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from pathlib import Path

from jaxtrain import files, objectives
from jaxtrain.errors import ReportError
from jaxtrain.observe import goodput as goodput_lib
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.tools import common

# metric -> (y-axis label, multiplier); "eval_loss" also draws every "eval_loss/<set>", dashed. Then the metrics
# each objective declares (`curves`).
CURVES = {
    "loss": ("train loss", 1.0),
    "eval_loss": ("eval loss", 1.0),
    "lr": ("learning rate", 1.0),
    "tokens_per_sec": ("tokens/s", 1.0),
    "mfu": ("MFU (%)", 100.0),
}


def curves() -> dict[str, tuple[str, float]]:
    """CURVES, then every registered objective's metrics (jaxtrain.objectives: DPO's accuracy and margin)."""
    declared = {name: (m.label, m.scale) for o in objectives.registered() for name, m in o.metrics.items()}
    return {**CURVES, **declared}

# The table: row key -> markdown header. CSV uses the keys and raw numbers (fractions, seconds).
COLUMNS = {
    "name": "run", "status": "status", "steps": "steps", "final_loss": "final loss",
    "best_eval_loss": "best eval", "final_eval_loss": "final eval", "tokens": "tokens", "wall_s": "wall",
    "goodput": "goodput", "tokens_per_sec": "tok/s", "mfu": "MFU", "devices": "devices",
    "device_hours": "device-h", "cost": "cost (USD)",
}
CSV_COLUMNS = ["name", "status", "steps", "total_steps", "final_loss", "best_eval_loss", "final_eval_loss",
               "tokens", "wall_s", "wall_source", "goodput", "tokens_per_sec", "mfu", "devices", "device_kind",
               "device_hours", "cost"]


# ===== Reading a workdir ==================================================================================

def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or cut short by a kill: treated as absent
        return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


@dataclasses.dataclass
class Run:
    name: str
    workdir: Path
    train: list[dict]  # train records of the final lineage (metrics.jsonl), by step
    evals: list[dict]  # eval records likewise
    times: list[float]  # "time" of every record in the file, lineage or not (empty for older workdirs)
    config: dict
    summary: dict | None  # summary.json (the last invocation that ended normally)
    info: dict | None  # run.json
    summary_fresh: bool  # summary.json was written after the last metrics record

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `metric` where it was logged and not null."""
        records = self.evals if metric.startswith("eval_") else self.train
        pairs = [(r["step"], r[metric]) for r in records if isinstance(r.get(metric), (int, float))]
        return [s for s, _ in pairs], [float(v) for _, v in pairs]

    def eval_sets(self) -> list[str]:
        return sorted({k.removeprefix("eval_loss/") for r in self.evals for k in r if k.startswith("eval_loss/")})

    def last_seen(self) -> float | None:
        """Unix time of the run's newest sign of life: its last metrics record."""
        return max(self.times) if self.times else _mtime(self.workdir / "metrics.jsonl")

    # ----- The table's figures ---------------------------------------------------------------------------

    def steps_done(self) -> int:
        """The step of the newest source: the last record, the summary, or run.json's attempts. The newest
        wins (not the largest) because a rollback or a resume from an older checkpoint lowers it."""
        facts = []  # (when, step)
        if self.train:
            facts.append((self.train[-1].get("time") or self.last_seen() or 0.0, self.train[-1]["step"]))
        if self.summary and isinstance(self.summary.get("step"), int):
            written = _mtime(self.workdir / "summary.json") or 0.0
            if self.summary_fresh:  # written after the last record, whatever the mtime's resolution
                written = max(written, facts[-1][0] + 1e-3 if facts else 0.0)
            facts.append((written, self.summary["step"]))
        for a in (self.info or {}).get("attempts") or []:
            start, end = a.get("start_unix") or 0.0, a.get("end_unix")
            if isinstance(a.get("start_step"), int):  # resumed there, perhaps before logging anything
                facts.append((start, a["start_step"]))
            reached = a.get("end_step", a.get("step"))
            if isinstance(reached, int):
                facts.append((end or start, reached))
        return max(facts)[1] if facts else 0

    def status(self) -> str:
        if self.info and self.info.get("status"):
            return self.info["status"]
        if self.summary and self.summary_fresh:
            return "finished" if self.summary.get("finished") else "stopped"
        return "unknown"  # running, or killed before writing a summary

    def wall(self) -> tuple[float | None, str]:
        """(seconds, source): the sum of run.json's attempts; else a whole-run summary.json's wall_s; else the
        spans of goodput.jsonl's attempts (they miss start-up); else the metrics' first-to-last span."""
        attempts = (self.info or {}).get("attempts") or []
        if not attempts and self.info and self.info.get("start_unix"):
            attempts = [self.info]
        if attempts:
            total = 0.0
            for i, a in enumerate(attempts):
                start = a.get("start_unix")
                if start is None:
                    continue
                end = a.get("end_unix")
                if end is None:
                    # Running, or killed before it could record its end: count up to its last record, not to
                    # now, so that a dead attempt does not keep adding hours.
                    nxt = next((b.get("start_unix") for b in attempts[i + 1:] if b.get("start_unix")), math.inf)
                    seen = [t for t in self.times if start <= t < nxt]
                    if not self.times and i == len(attempts) - 1:
                        seen = [self.last_seen() or start]
                    end = max(seen, default=start)
                total += max(0.0, end - start)
            return total, "run.json"
        if self.summary_fresh and self.summary and not self.summary.get("resumed") and "wall_s" in self.summary:
            return float(self.summary["wall_s"]), "summary.json"
        records = goodput_lib.read_records(self.workdir / "goodput.jsonl")
        spans, start, last = 0.0, None, None
        for r in records:
            if r.get("event") == "start":
                spans += (last - start) if start is not None else 0.0
                start = r.get("t")
            last = r.get("t", last)
        if start is not None:
            return spans + last - start, "goodput.jsonl"
        if len(self.times) > 1:
            return max(self.times) - min(self.times), "metrics.jsonl"
        return None, ""

    def goodput(self) -> dict | None:
        """summary.json's goodput if no invocation came after it; else recomputed from goodput.jsonl over
        its first start to its last record (summary.json uses the time of writing as the end)."""
        if self.summary_fresh and self.summary and self.summary.get("goodput"):
            return self.summary["goodput"]
        records = goodput_lib.read_records(self.workdir / "goodput.jsonl")
        starts = [r["t"] for r in records if r.get("event") == "start" and "t" in r]
        if not starts:
            return None
        return goodput_lib.goodput(records, max(r.get("t", 0.0) for r in records) - starts[0])

    def row(self, price: float | None = None) -> dict:
        train_cfg = self.config.get("train") or {}
        steps = self.steps_done()
        per_step = (train_cfg.get("batch_size") or 0) * (train_cfg.get("seq_len") or 0)
        evals = self.series("eval_loss")[1]
        losses = self.series("loss")[1]
        wall_s, wall_source = self.wall()
        devices = (self.info or {}).get("devices") or {}
        count = devices.get("count")
        device_hours = count * wall_s / 3600 if count and wall_s is not None else None
        good = self.goodput()
        return {
            "name": self.name, "status": self.status(), "steps": steps, "total_steps": train_cfg.get("steps"),
            "final_loss": losses[-1] if losses else None,
            "best_eval_loss": min(evals) if evals else None, "final_eval_loss": evals[-1] if evals else None,
            "tokens": steps * per_step if per_step else None,
            "wall_s": wall_s, "wall_source": wall_source,
            "goodput": good.get("goodput") if good else None,
            "tokens_per_sec": _harmonic_mean(self.series("tokens_per_sec")[1]),
            "mfu": _harmonic_mean(self.series("mfu")[1]),
            "devices": count, "device_kind": devices.get("kind"),
            "device_hours": device_hours,
            "cost": device_hours * price if device_hours is not None and price is not None else None,
        }


def _harmonic_mean(rates: list[float]) -> float | None:
    """Each record is the rate over one log interval of equal token count, so tokens / total time is the
    harmonic mean of the rates (the arithmetic mean would overweight fast intervals)."""
    rates = [r for r in rates if r > 0]
    return len(rates) / sum(1 / r for r in rates) if rates else None


def load_run(workdir, name: str | None = None) -> Run:
    """Reads one workdir; raises ReportError if it is not a directory or has no metrics.jsonl."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise ReportError(f"{workdir}: no such directory")
    metrics = workdir / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{metrics}: not found (not a jaxtrain workdir, or the run has not logged yet)")
    records = metrics_lib.read_records(metrics)
    train, evals = metrics_lib.lineage(records)
    times = [float(r["time"]) for r in records if isinstance(r.get("time"), (int, float))]
    summary = _read_json(workdir / "summary.json")
    run = Run(name=name or default_names([workdir])[0], workdir=workdir, train=train, evals=evals,
              times=times, config={}, summary=summary, info=_read_json(workdir / "run.json"), summary_fresh=False)
    run.config = _read_json(workdir / "config.json") or (run.info or {}).get("config") or {}
    if summary is not None:
        # 2 s of slack for filesystems with coarse mtimes; a later invocation takes longer than that to log.
        seen = run.last_seen()
        run.summary_fresh = seen is None or (_mtime(workdir / "summary.json") or 0.0) >= seen - 2.0
    return run


def default_names(workdirs) -> list[str]:
    """The shortest path suffixes that tell the workdirs apart (runs/a/workdir, runs/b/workdir -> a/workdir, ...)."""
    parts = [Path(w).absolute().parts for w in workdirs]
    for k in range(1, max((len(p) for p in parts), default=1) + 1):
        names = ["/".join(p[-k:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(w) for w in workdirs]


def load_runs(workdirs, names=None) -> list[Run]:
    """Every run, or ReportError for the first bad workdir (before anything is written)."""
    workdirs = list(workdirs)
    if names is not None and len(names) != len(workdirs):
        raise ReportError(f"--names: {len(names)} name(s) for {len(workdirs)} workdir(s)")
    return [load_run(w, n) for w, n in zip(workdirs, names or default_names(workdirs))]


# ===== Curves =============================================================================================

def available_curves(runs: list[Run]) -> list[str]:
    """The metrics of `curves()` that at least one run has a value for."""
    def has(run, metric):
        sets = [f"eval_loss/{s}" for s in run.eval_sets()] if metric == "eval_loss" else []
        return any(run.series(m)[0] for m in [metric, *sets])
    return [m for m in curves() if any(has(run, m) for run in runs)]


def plot_metric(ax, runs: list[Run], metric: str) -> None:
    """One line per run on `ax` (a run keeps its colour across plots); eval sets are dashed."""
    label, scale = curves().get(metric, (metric, 1.0))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        steps, values = run.series(metric)
        # Evals are sparse: dots show where they were taken.
        dots = dict(marker="o", markersize=3) if metric == "eval_loss" and len(steps) < 30 else {}
        if steps:
            ax.plot(steps, [v * scale for v in values], color=color, label=run.name, **dots)
        if metric == "eval_loss":
            for s in run.eval_sets():
                steps, values = run.series(f"eval_loss/{s}")
                ax.plot(steps, values, color=color, linestyle="--", label=f"{run.name}: {s}", **dots)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")


def plot_curves(runs: list[Run], fig=None, metrics=None):
    """Every available metric (or `metrics`) in a grid on `fig` (default: a new pyplot figure, so that a
    notebook can `plt.show()` it). Returns the figure."""
    metrics = metrics or available_curves(runs)
    cols = min(len(metrics), 2) or 1
    rows = max(1, math.ceil(len(metrics) / cols))
    if fig is None:
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=(6.5 * cols, 4 * rows))
    for i, metric in enumerate(metrics):
        plot_metric(fig.add_subplot(rows, cols, i + 1), runs, metric)
    fig.tight_layout()
    return fig


# ===== The table ==========================================================================================

def _duration(s: float) -> str:
    s = round(s)
    if s < 60:
        return f"{s}s"
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def _count(n: int) -> str:
    """768, 9,999, 12.3K, 1.50B: 3 significant digits past ten thousand."""
    if n < 10_000:
        return f"{n:,}"
    unit, size = next((u, s) for u, s in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= s)
    value = n / size
    return f"{value:.{max(0, 2 - int(math.log10(value)))}f}{unit}"


def _small(x: float) -> str:
    """Numbers that span orders of magnitude (device-hours, cost): 1,234 / 12.35 / 0.0123."""
    return f"{x:,.0f}" if x >= 1000 else f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def format_row(row: dict) -> dict:
    """The markdown cells of a row; "-" where a figure is unknown."""
    def fmt(value, how):
        return "-" if value is None else how(value)
    total = row["total_steps"]
    return {
        "name": row["name"].replace("|", "\\|"), "status": row["status"],
        "steps": f"{row['steps']}/{total}" if total is not None else str(row["steps"]),
        "final_loss": fmt(row["final_loss"], "{:.4f}".format),
        "best_eval_loss": fmt(row["best_eval_loss"], "{:.4f}".format),
        "final_eval_loss": fmt(row["final_eval_loss"], "{:.4f}".format),
        "tokens": fmt(row["tokens"], _count),
        "wall_s": fmt(row["wall_s"], _duration),
        "goodput": fmt(row["goodput"], lambda g: f"{100 * g:.1f}%"),
        "tokens_per_sec": fmt(row["tokens_per_sec"], "{:,.0f}".format),
        "mfu": fmt(row["mfu"], lambda m: f"{100 * m:.3g}%"),
        "devices": f"{row['devices']} x {row['device_kind'] or '?'}" if row["devices"] else "-",
        "device_hours": fmt(row["device_hours"], _small),
        "cost": fmt(row["cost"], lambda c: "$" + _small(c)),
    }


def markdown_table(rows: list[dict], with_cost: bool = True) -> str:
    """Padded so that the file reads as a table in a terminal too."""
    keys = [k for k in COLUMNS if with_cost or k != "cost"]
    cells = [[COLUMNS[k] for k in keys]] + [[format_row(r)[k] for k in keys] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(keys))]
    left = {"name", "status", "devices"}  # text left, numbers right

    def line(values):
        return "| " + " | ".join(v.ljust(w) if k in left else v.rjust(w)
                                 for k, v, w in zip(keys, values, widths)) + " |"
    rule = "|" + "|".join(("-" * (w + 1) + ":" if k not in left else "-" * (w + 2))
                          for k, w in zip(keys, widths)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(c) for c in cells[1:])]) + "\n"


def csv_table(rows: list[dict]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: "" if row.get(k) is None else row[k] for k in CSV_COLUMNS})
    return out.getvalue()


# ===== Restarts: where the time to train again went ======================================================

PHASE_LABELS = {p: p.replace("_", " ") for p in goodput_lib.PHASES}  # restart_wait -> "restart wait"


def recovery_rows(runs: list[Run]) -> list[dict]:
    """Every restart of every run (each start after a workdir's first, from goodput.jsonl's "phases" records):
    goodput_lib.restarts' rows with the run's name."""
    rows = []
    for run in runs:
        starts = goodput_lib.restarts(goodput_lib.read_records(run.workdir / "goodput.jsonl"))
        rows += [{"name": run.name, **r} for r in starts if r["restart"]]  # the first start recovers nothing
    return rows


def recovery_table(rows: list[dict]) -> str:
    """Seconds per phase of each restart; compile says whether it came from the cache, restore from which tier."""
    def cell(row, phase):
        value = row["phases"].get(phase)
        if value is None:
            return "-"
        note = {"compile": row.get("compile"), "restore": row.get("restore_tier")}.get(phase)
        return f"{value:.2f}" + (f" ({note})" if note else "")

    header = ["run", "attempt", "from step", *PHASE_LABELS.values(), "total", "first step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|"]
    for r in rows:
        first = "-" if r["first_step_s"] is None else f"{r['first_step_s']:.2f}"
        lines.append("| " + " | ".join([r["name"].replace("|", "\\|"), str(r["attempt"] or "-"), str(r["step"]),
                                         *(cell(r, p) for p in PHASE_LABELS), f"{r['total_s']:.2f}", first]) + " |")
    return "\n".join(lines) + "\n"


def plot_recovery(ax, rows: list[dict]) -> None:
    """One horizontal bar per restart, stacked by phase (the same colour per phase), its first step last."""
    labels = [f"{r['name']} #{r['attempt'] or '?'} (step {r['step']})" for r in rows]
    left = [0.0] * len(rows)
    for i, (phase, label) in enumerate([*PHASE_LABELS.items(), ("first_step", "first step")]):
        widths = [(r["first_step_s"] if phase == "first_step" else r["phases"].get(phase)) or 0.0 for r in rows]
        if any(widths):
            ax.barh(labels, widths, left=left, color=f"C{i % 10}", label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()  # the first restart on top
    ax.set_xlabel("seconds from the previous attempt's last record to the restart's first step")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: bars fill the axes


# ===== The report =========================================================================================

def write_report(workdirs, output="report", price: float | None = None, names=None) -> dict:
    """Writes <metric>.png for every available curve, curves.png (all of them), summary.md and summary.csv
    into `output`, and recovery.md and recovery.png if a run restarted. Returns {"paths": {what: path}, "rows":
    [row per run], "table": the markdown, "recovery": the restarts' markdown or ""}. Raises
    ReportError for a bad workdir before writing anything."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend, renders with Agg

    runs = load_runs(workdirs, names)
    output = Path(output)
    files.make_dir(output, "--output")
    paths = {}
    curves = available_curves(runs)
    for metric in curves:
        fig = Figure(figsize=(7, 4.5))
        plot_metric(fig.add_subplot(), runs, metric)
        fig.tight_layout()
        paths[metric] = output / f"{metric.replace('/', '_')}.png"  # dpo/accuracy -> dpo_accuracy.png
        fig.savefig(paths[metric], dpi=110)
    if curves:
        paths["curves"] = output / "curves.png"
        plot_curves(runs, Figure(figsize=(13, 4 * math.ceil(len(curves) / 2)))).savefig(paths["curves"], dpi=90)
    rows = [run.row(price) for run in runs]
    table = markdown_table(rows, with_cost=price is not None)
    paths["summary.md"] = output / "summary.md"
    paths["summary.md"].write_text(table)
    paths["summary.csv"] = output / "summary.csv"
    paths["summary.csv"].write_text(csv_table(rows))
    recovery = recovery_rows(runs)
    if recovery:
        paths["recovery.md"] = output / "recovery.md"
        paths["recovery.md"].write_text(recovery_table(recovery))
        fig = Figure(figsize=(11, max(3.0, 1.5 + 0.45 * len(recovery))))
        plot_recovery(fig.add_subplot(), recovery)
        fig.tight_layout()
        paths["recovery"] = output / "recovery.png"
        fig.savefig(paths["recovery"], dpi=110)
    return {"paths": paths, "rows": rows, "table": table, "recovery": recovery_table(recovery) if recovery else ""}


def _report(argv) -> int:
    parser = common.Parser(prog="jaxtrain report", description=__doc__.split("\n\n")[1])
    parser.add_argument("workdirs", nargs="+", metavar="WORKDIR")
    parser.add_argument("--output", default="report", metavar="DIR",
                        help="directory for the PNGs and tables (default: report)")
    parser.add_argument("--price_per_device_hour", type=float, default=None, metavar="USD",
                        help="adds an estimated cost column: device-hours x this price")
    parser.add_argument("--names", default=None, metavar="a,b", help="comma-separated run names, one per WORKDIR")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.names.split(",")] if args.names is not None else None
    if args.price_per_device_hour is not None and not args.price_per_device_hour >= 0:
        raise ReportError(f"--price_per_device_hour: {args.price_per_device_hour} is not a price")
    result = write_report(args.workdirs, args.output, args.price_per_device_hour, names)
    print(result["table"], end="")
    if result["recovery"]:
        print("\nrestarts (seconds per phase):\n" + result["recovery"], end="")
    print(f"wrote {', '.join(p.name for p in result['paths'].values())} to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return common.run(_report, argv)
