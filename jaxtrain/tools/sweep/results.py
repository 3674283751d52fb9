"""A sweep's results: one row per trial, best first, written as results.csv, results.md and results.png."""

from __future__ import annotations

import csv
from pathlib import Path

import optuna
from optuna.trial import TrialState

from jaxtrain.tools.sweep.spec import Sweep, format_value
from jaxtrain.tools.sweep.study import interrupted, trial_params


def result_rows(study: optuna.Study, spec: Sweep, sweep_dir: Path) -> list[dict]:
    """One row per trial, sorted by objective (best first); trials without a value last, by number."""
    trials = study.get_trials(deepcopy=False)
    retries = {t.user_attrs["retry_of"]: t.number for t in trials if "retry_of" in t.user_attrs}
    rows = []
    for t in trials:
        state, note = t.state.name.lower(), t.user_attrs.get("error", "")
        if interrupted(t):
            state = "interrupted"
            note = f"retried as trial {retries[t.number]}" if t.number in retries else "retried by the next run"
        elif t.state == TrialState.PRUNED:
            note = f"pruned at step {t.last_step}"
        params = trial_params(t)
        rows.append({"trial": t.number, "state": state, **{p: params.get(p) for p in spec.space},
                     "objective": t.value, "steps": t.user_attrs.get("steps"), "wall_s": t.user_attrs.get("wall_s"),
                     "workdir": str(sweep_dir / t.user_attrs.get("workdir", f"trial_{t.number:04d}")), "note": note})
    sign = 1 if spec.direction == "minimize" else -1
    return sorted(rows, key=lambda r: (r["objective"] is None, sign * (r["objective"] or 0), r["trial"]))

def best_row(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["state"] == "complete"), None)

def write_results(study: optuna.Study, spec: Sweep, sweep_dir: Path) -> dict:
    """results.csv, results.md and results.png in the sweep dir; returns their paths, the rows and the best."""
    rows = result_rows(study, spec, sweep_dir)
    columns = ["trial", "state", *spec.space, "objective", "steps", "wall_s", "workdir", "note"]
    paths = {"csv": sweep_dir / "results.csv", "markdown": sweep_dir / "results.md", "plot": sweep_dir / "results.png"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    what = f"objective: {spec.objective} {spec.metric} ({spec.direction}); sampler {spec.sampler}, pruner {spec.pruner}"
    lines = [f"# Sweep {spec.name}", "", what, "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    for r in rows:
        cells = [f"{r[c]:.4f}" if c == "objective" and r[c] is not None
                 else format_value(r[c]) if r[c] is not None else ""
                 for c in columns]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    paths["markdown"].write_text("\n".join(lines) + "\n")
    plot(rows, spec, paths["plot"])
    return {**paths, "rows": rows, "best": best_row(rows), "sweep_dir": sweep_dir}

def plot(rows: list[dict], spec: Sweep, path: Path) -> None:
    """The objective against each parameter, one panel each: complete trials as dots, pruned as crosses
    (their value at the step they stopped), the best as a star."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas for PNG

    params = list(spec.space)
    fig = Figure(figsize=(4 * len(params), 3.4), layout="constrained")
    axes = fig.subplots(1, len(params), squeeze=False)[0]
    best = best_row(rows)
    for ax, name in zip(axes, params):
        p = spec.space[name]
        numeric = p.kind != "categorical" or all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in p.choices)
        labels = [str(v) for v in p.choices]

        def x(v):
            return v if numeric else labels.index(str(v))

        for state, marker, color in (("complete", "o", "tab:blue"), ("pruned", "x", "tab:gray")):
            pts = [(x(r[name]), r["objective"]) for r in rows if r["state"] == state and r["objective"] is not None]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, color=color, label=state)
        if best:
            ax.scatter([x(best[name])], [best["objective"]], marker="*", s=160, color="tab:red", label="best")
        if p.log_axis():
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(name)
        ax.set_ylabel(f"{spec.objective} {spec.metric}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"sweep {spec.name} ({spec.direction})")
    fig.savefig(path, dpi=100)
