"""The Optuna study a sweep's workers share: its storage, claiming trials, heartbeats and recovery.

Workers claim the next trial under a file lock in the sweep dir, so local workers never overshoot the
budget. A trial whose worker died (its pid is gone on this machine, or its heartbeat is older than
STALE_AFTER_S) or was interrupted is failed without an "error" and its values are queued again in the
same workdir, so the retry resumes from that trial's last checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from jaxtrain.errors import SweepError
from jaxtrain.observe import tracking
from jaxtrain.tools.sweep.spec import Sweep, make_pruner, make_sampler

HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0  # a RUNNING trial whose heartbeat is this old is taken for dead (other machines)
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"

def default_sweep_dir(config, name: str) -> Path:
    workdir = Path(config.workdir)
    return workdir.parent / "sweeps" / f"{workdir.name}_{name}"

def open_storage(sweep_dir: Path, storage: str | None):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if storage and "://" in storage:
        return storage  # an RDB URL: optuna opens it (and creates its tables)
    path = Path(storage) if storage else sweep_dir / "study.journal"
    if not path.parent.is_dir():
        raise SweepError("--storage", f"directory {path.parent} does not exist")
    return JournalStorage(JournalFileBackend(str(path)))

def describe_storage(sweep_dir: Path, storage: str | None) -> str:
    if storage and "://" in storage:
        return tracking.redact(storage)
    return f"journal {Path(storage) if storage else sweep_dir / 'study.journal'}"

def open_study(spec: Sweep, config, sweep_dir: Path, storage: str | None = None) -> optuna.Study:
    """Creates or loads the study; refuses one made with another sweep file or base config."""
    try:
        study = optuna.create_study(storage=open_storage(sweep_dir, storage), study_name=spec.name,
                                    direction=spec.direction, load_if_exists=True,
                                    sampler=make_sampler(spec, spec.seed), pruner=make_pruner(spec))
    except SweepError:
        raise
    except Exception as e:  # noqa: BLE001 - a bad URL, an unreachable database, an unreadable journal
        raise SweepError("--storage", f"{describe_storage(sweep_dir, storage)}: {type(e).__name__}: "
                         f"{tracking.redact(str(e).splitlines()[0] if str(e) else '')}") from None
    identity = {"sweep": spec.identity(), "config": _config_identity(config)}
    saved = study.user_attrs.get("jaxtrain")
    if saved is None:
        study.set_user_attr("jaxtrain", identity)
    elif json.dumps(saved, sort_keys=True) != json.dumps(identity, sort_keys=True):
        what = next(f"{part}.{k}" for part in ("sweep", "config")
                    for k in sorted(set(_flat(saved.get(part, {}))) | set(_flat(identity[part])))
                    if _flat(saved.get(part, {})).get(k, "<unset>") != _flat(identity[part]).get(k, "<unset>"))
        raise SweepError("--sweep_dir", f"study {spec.name!r} in {describe_storage(sweep_dir, storage)} was made with "
                         f"a different {what}; rerun with the same sweep file and config (only `trials` may "
                         f"change), or use another --sweep_dir / study name")
    return study

def _config_identity(config) -> dict:
    d = tracking.redact(config.to_dict())
    d.pop("workdir", None)
    return json.loads(json.dumps(d, default=str))

def _flat(tree, prefix="") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out

def trial_params(t) -> dict:
    """A trial's values, also for one that died before suggesting them (queued values)."""
    return dict(t.params) or dict(t.system_attrs.get("fixed_params", {}))

def interrupted(t) -> bool:
    """Failed without an "error": its worker died or was stopped. Retried, and not counted in the budget."""
    return t.state == TrialState.FAIL and "error" not in t.user_attrs

def counts(t) -> bool:
    """Whether a trial counts toward the budget: every one but the interrupted."""
    return t.state != TrialState.FAIL or "error" in t.user_attrs

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

def _stale(t, now: float) -> bool:
    host, _, pid = str(t.user_attrs.get("worker", "")).rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
        return True
    started = t.datetime_start.timestamp() if t.datetime_start else now
    return now - float(t.user_attrs.get("heartbeat", started)) > STALE_AFTER_S

def recover(study: optuna.Study) -> list[int]:
    """Fails RUNNING trials whose worker is gone and queues every interrupted trial's values again, in its
    workdir. Returns the numbers of the trials queued for a retry."""
    now = time.time()
    trials = study.get_trials(deepcopy=False)
    for t in trials:
        if t.state == TrialState.RUNNING and _stale(t, now):
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    queued = []
    for t in trials:
        if interrupted(t) and t.number not in retried and trial_params(t):
            workdir = t.user_attrs.get("workdir", f"trial_{t.number:04d}")
            study.enqueue_trial(trial_params(t), user_attrs={"workdir": workdir, "retry_of": t.number})
            queued.append(t.number)
    return queued


@contextlib.contextmanager
def _claim_lock(sweep_dir: Path):
    """Serializes 'count the trials, then start one' among this machine's workers (flock: a killed
    holder releases it)."""
    with open(sweep_dir / ".claim.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

def claim(study: optuna.Study, spec: Sweep, sweep_dir: Path):
    """The next trial for this worker, with its values suggested, or None once the budget is spent."""
    with _claim_lock(sweep_dir):
        recover(study)
        trials = study.get_trials(deepcopy=False)
        if not any(t.state == TrialState.WAITING for t in trials):
            if sum(map(counts, trials)) >= spec.trials:
                return None
            if spec.sampler == "grid":
                taken = {_key(trial_params(t), spec) for t in trials if counts(t)}
                point = next((p for p in spec.grid_points() if _key(p, spec) not in taken), None)
                if point is None:
                    return None
                study.enqueue_trial(point)
            else:  # trial n draws with seed + n: reruns and other workers never repeat a draw
                study.sampler = make_sampler(spec, spec.seed + len(trials))
        trial = study.ask()
        trial.set_user_attr("worker", WORKER_ID)
        trial.set_user_attr("heartbeat", time.time())
        if "workdir" not in trial.user_attrs:
            trial.set_user_attr("workdir", f"trial_{trial.number:04d}")
        params = {path: p.suggest(trial, path) for path, p in spec.space.items()}
        return trial, params

def _key(params: dict, spec: Sweep) -> str:
    return json.dumps([params.get(p) for p in spec.space])

class Heartbeat:
    """Refreshes the trial's `heartbeat` attr so workers on other machines can tell it is alive."""

    def __init__(self, trial):
        self.trial, self.stop_event = trial, threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True, name="sweep-heartbeat")

    def _beat(self):
        while not self.stop_event.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed beat is harmless unless it lasts STALE_AFTER_S
                self.trial.set_user_attr("heartbeat", time.time())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join()
