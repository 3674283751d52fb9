"""A whole sweep: `run` checks the input, opens the study, works in this process beside N-1 spawned worker
processes, then writes the results; `worker_main` is such a worker (`jaxtrain sweep --worker`).

The job (config, Sweep, sweep dir, storage) goes to a worker pickled on its stdin, so no secret is in its
argv; its lines come back on its stdout, prefixed `[worker i]`.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import optuna
from optuna.trial import TrialState

from jaxtrain import errors, files
from jaxtrain.errors import SweepError
from jaxtrain.observe import tracking
from jaxtrain.tools.sweep.results import write_results
from jaxtrain.tools.sweep.spec import Sweep, check, format_point, load, make_pruner, make_sampler
from jaxtrain.tools.sweep.study import counts, default_sweep_dir, describe_storage, open_storage, open_study
from jaxtrain.tools.sweep.trials import work


def run(config, sweep, sweep_dir=None, *, workers: int = 1, storage: str | None = None, trials: int | None = None,
        print_fn=print) -> dict:
    """Runs (or continues) a sweep of `config` and writes the results. `sweep`: a sweep file path, a
    get_sweep() dict or a Sweep. Raises SweepError/ConfigError/DataError before any trial for bad input.

    Returns {"rows", "best" (row or None), "csv", "markdown", "plot", "sweep_dir"}."""
    from jaxtrain.data import corpus, layout, pipeline

    spec = load(sweep, trials)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SweepError("--workers", f"must be an integer >= 1, got {workers!r}")
    check(config, spec)
    sweep_dir = Path(sweep_dir) if sweep_dir else default_sweep_dir(config, spec.name)
    # The corpus once, here: N workers' first trials would otherwise all build it; a DataError is bad input.
    pipeline.check_data_dir(config.data)
    ddir = layout.default_dir(config.data)
    if not layout.prepared_from_sources(ddir):
        corpus.prepare_default_corpus(ddir, config.data.vocab_size, config.data.heldout_docs)
    files.make_dir(sweep_dir, "--sweep_dir")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our one line per trial replaces Optuna's
    study = open_study(spec, config, sweep_dir, storage)
    (sweep_dir / "sweep.json").write_text(json.dumps(
        {"sweep": spec.identity(), "trials": spec.trials, "storage": describe_storage(sweep_dir, storage),
         "config": tracking.redact(config.to_dict())}, indent=1, default=str))
    have = [t for t in study.get_trials(deepcopy=False) if counts(t) and t.state != TrialState.RUNNING]
    print_fn(f"sweep {spec.name}: {spec.sampler} over {', '.join(spec.space)} | budget {spec.trials} trials "
             f"({len(have)} done) | {spec.objective} {spec.metric} ({spec.direction}) | pruner {spec.pruner} | "
             f"{workers} worker(s) | storage {describe_storage(sweep_dir, storage)} | {sweep_dir}")

    children = [_spawn(config, spec, sweep_dir, storage, i, print_fn) for i in range(1, workers)]
    preempted = None
    try:
        work(study, spec, config, sweep_dir, print_fn)
        for child, _ in children:
            child.wait()
        # A worker that died left its trial RUNNING: retry it now rather than on the next invocation.
        work(study, spec, config, sweep_dir, print_fn)
    except errors.Preempted as e:  # the table is still worth writing; then the caller sees the preemption
        preempted = e
    finally:
        for child, reader in children:
            if child.poll() is None:
                child.terminate()  # SIGTERM: the child's trial saves a checkpoint and is retried next time
            child.wait()
            reader.join()
            if child.returncode not in (0, None):
                print_fn(f"warning: worker pid {child.pid} exited with code {child.returncode}")
    results = write_results(study, spec, sweep_dir)
    best = results["best"]
    if best:
        print_fn(f"best: trial {best['trial']} {spec.objective} {spec.metric} {best['objective']:.4f} | "
                 f"{format_point({p: best[p] for p in spec.space})} | {best['workdir']}")
    else:
        print_fn("no trial completed; see the table for why")
    print_fn(f"results: {results['csv']} {results['markdown']} {results['plot']}")
    if preempted:
        raise preempted
    return results

def _spawn(config, spec: Sweep, sweep_dir: Path, storage, index: int, print_fn):
    """A worker process (`jaxtrain sweep --worker`); the config arrives on stdin (no secrets in argv)
    and its lines come back through print_fn."""
    child = subprocess.Popen([sys.executable, "-m", "jaxtrain", "sweep", "--worker"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=False,
                             env={**os.environ, "JAXTRAIN_SWEEP_WORKER": str(index)})
    child.stdin.write(pickle.dumps({"config": config, "spec": spec, "sweep_dir": str(sweep_dir), "storage": storage}))
    child.stdin.close()

    def forward():
        for line in child.stdout:
            print_fn(f"[worker {index}] {line.decode(errors='replace').rstrip()}")

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    return child, reader

def worker_main() -> int:
    """An extra worker started by `_spawn`: runs the pickled job from stdin; returns its exit code."""
    job = pickle.load(sys.stdin.buffer)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep_dir = Path(job["sweep_dir"])
    study = optuna.load_study(study_name=job["spec"].name, storage=open_storage(sweep_dir, job["storage"]),
                              sampler=make_sampler(job["spec"], job["spec"].seed), pruner=make_pruner(job["spec"]))
    try:
        work(study, job["spec"], job["config"], sweep_dir, lambda *a: print(*a, flush=True))
    except errors.Preempted:
        return errors.EXIT_PREEMPTED
    return errors.EXIT_OK
