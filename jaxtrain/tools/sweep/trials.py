"""Running trials: one trial trained in this process (`run_trial`), and a worker's loop (`work`).

A trial is an ordinary `jaxtrain.train.run` of its config in its own workdir, its output in log.txt;
`PruningWriter` reports the metric at every eval so the pruner can stop it. A failed trial is a result
(recorded with its one-line reason); an interrupted one (Ctrl-C, SIGTERM) propagates and is retried.
"""

from __future__ import annotations

import gc
import math
import time
import traceback
from pathlib import Path

import optuna
from optuna.trial import TrialState

from jaxtrain import errors
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.observe import tracking
from jaxtrain.tools.sweep.spec import Sweep, format_point, trial_config
from jaxtrain.tools.sweep.study import Heartbeat, claim, counts


class PruningWriter(metrics_lib.MetricWriter):
    """Reports `metric` to the trial at every eval and raises optuna.TrialPruned when the pruner says so.
    Steps in `reported` (a retry's values from before its checkpoint) are not reported twice."""

    def __init__(self, trial, metric: str, reported=()):
        self.trial, self.metric, self.reported = trial, metric, set(reported)

    def write_scalars(self, step, scalars):
        if self.metric not in scalars or int(step) in self.reported:
            return
        value = float(scalars[self.metric])
        self.trial.report(value, int(step))
        self.reported.add(int(step))
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {step}: {self.metric} {value:.4f}")

def metric_history(workdir, metric: str) -> dict[int, float]:
    """{step: value} of `metric` in a workdir's metrics.jsonl; for a step logged twice (a run killed after
    its last checkpoint, then resumed) the later record wins."""
    path = Path(workdir) / "metrics.jsonl"
    records = metrics_lib.read_records(path) if path.is_file() else []
    return {r["step"]: float(r[metric]) for r in records if r.get(metric) is not None}

def objective(history: dict[int, float], spec: Sweep) -> float:
    if spec.objective == "final":
        return history[max(history)]
    return (min if spec.direction == "minimize" else max)(history.values())

def _one_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, errors.ConfigError) else f"{type(e).__name__}: {e}"
    return tracking.redact((text.strip().splitlines() or [type(e).__name__])[0])

def run_trial(study, spec: Sweep, base, sweep_dir: Path, trial, params: dict) -> optuna.trial.FrozenTrial:
    """Trains one trial in this process and tells the study how it ended. KeyboardInterrupt and SIGTERM
    (errors.Preempted) mark it interrupted (retried by the next run) and propagate."""
    from jaxtrain import compile_cache, train

    workdir = sweep_dir / trial.user_attrs["workdir"]
    workdir.mkdir(parents=True, exist_ok=True)
    prior = metric_history(workdir, spec.metric)  # a retry: what the interrupted attempt already reported
    for step, value in sorted(prior.items()):
        trial.report(value, step)
    t0 = time.perf_counter()
    state, error = TrialState.COMPLETE, None
    with open(workdir / "log.txt", "a", buffering=1) as log, Heartbeat(trial):
        def say(*args, **kwargs):
            print(*args, file=log, **{k: v for k, v in kwargs.items() if k != "file"})

        try:
            config = trial_config(base, params, workdir)
            # Trials' workdirs share a parent, so "auto" is one cache for them all; jax opens it at the first compile.
            compile_cache.install(config, warn=say)
            summary = train.run(config, print_fn=say, writers=[PruningWriter(trial, spec.metric, prior)])
        except optuna.TrialPruned as e:
            state = TrialState.PRUNED
            say(str(e))
        except (KeyboardInterrupt, errors.Preempted):
            trial.set_user_attr("wall_s", round(time.perf_counter() - t0, 1))
            study.tell(trial, state=TrialState.FAIL)  # no "error": retried in this workdir by the next run
            raise
        except Exception as e:  # noqa: BLE001 - a failed trial is a result; the sweep goes on
            state, error = TrialState.FAIL, _one_line(e)
            say(traceback.format_exc())
        else:
            if not summary.get("finished") and summary.get("step", 0) < config.train.steps:
                say(f"stopped at step {summary.get('step')} (train.stop_at)")
    history = metric_history(workdir, spec.metric)
    trial.set_user_attr("wall_s", round(time.perf_counter() - t0, 1))
    if history:
        trial.set_user_attr("steps", max(history))
    value = None
    if state == TrialState.COMPLETE:
        if not history:
            state, error = TrialState.FAIL, f"no {spec.metric!r} in {workdir / 'metrics.jsonl'}"
        else:
            value = objective(history, spec)
            if not math.isfinite(value):
                state, error = TrialState.FAIL, f"{spec.metric} is {value}"
    if error:
        trial.set_user_attr("error", error)
    frozen = study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
    _release_compiled()
    return frozen

def _release_compiled():
    """Each trial compiles its own steps; drop them so a long sweep's memory stays flat."""
    import jax

    gc.collect()
    jax.clear_caches()

def work(study: optuna.Study, spec: Sweep, base, sweep_dir: Path, print_fn=print) -> int:
    """One worker: claims and runs trials until the budget is spent. Returns the number it ran."""
    ran = 0
    while (claimed := claim(study, spec, sweep_dir)) is not None:
        trial, params = claimed
        print_fn(f"trial {trial.number} started: {format_point(params)} -> {sweep_dir / trial.user_attrs['workdir']}"
                 + (f" (retry of trial {trial.user_attrs['retry_of']})" if "retry_of" in trial.user_attrs else ""))
        frozen = run_trial(study, spec, base, sweep_dir, trial, params)
        ran += 1
        done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (counts(t) and t.state == TrialState.FAIL)
                   for t in study.get_trials(deepcopy=False))
        print_fn(f"[{done}/{spec.trials}] trial {frozen.number} {_outcome(frozen, spec)} | {format_point(params)} | "
                 f"{frozen.user_attrs.get('wall_s', 0):.1f}s")
    return ran

def _outcome(t, spec: Sweep) -> str:
    metric = f"{spec.metric}{'' if spec.objective == 'final' else ' (best)'}"
    if t.state == TrialState.COMPLETE:
        return f"complete {metric} {t.value:.4f}"
    if t.state == TrialState.PRUNED:
        return f"pruned at step {t.last_step} {spec.metric} {t.value:.4f}" if t.value is not None else "pruned"
    return f"failed: {t.user_attrs.get('error', 'interrupted')}"
