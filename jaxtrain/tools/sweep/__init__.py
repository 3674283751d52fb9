"""Hyperparameter sweeps: `jaxtrain sweep --config configs/tiny.py --sweep configs/sweeps/lr_grid.py`

    jaxtrain sweep --config CONFIG --sweep SWEEP [--workers N] [--sweep_dir DIR] [--storage URL]
        [--trials N] [--config.a.b=v ...]

Every trial is an ordinary run of CONFIG (with the CLI overrides) plus the trial's values, in its own workdir
SWEEP_DIR/trial_NNNN: it has the usual config.json, metrics.jsonl, checkpoints and run.json, and can be
inspected, resumed or sampled like any run; the trainer's own output goes to its log.txt. The search is
Optuna's; from a notebook call `run(config, "configs/sweeps/x.py", sweep_dir, workers=1)`.

The sweep file: `get_sweep()` returns a dict (or ConfigDict) with these keys:

    space        {config path: values}, at least one. Values: a list or `choice(...)` (categorical),
                 `uniform(lo, hi, step=None)`, `loguniform(lo, hi)`, `integer(lo, hi, step=1, log=False)`.
                 Paths are leaves of the config ("optim.lr"), flat or as nested dicts; `workdir` and
                 `distributed.*` belong to the sweep, not to a trial.
    sampler      "grid" (every combination, in the order listed; categorical/integer/stepped values only),
                 "random" or "tpe" (Optuna's TPE, Bayesian). `sampler_args`: extra keyword arguments for
                 optuna's TPESampler (e.g. {"n_startup_trials": 5}).
    trials       the budget: trials that count (below). Required for random/tpe; for grid it defaults to,
                 and is capped at, the number of grid points. `--trials N` overrides it.
    metric       default "eval_loss" (or "eval_loss/<set>", or any key of metrics.jsonl's records).
    objective    "final" (default: the metric's last value) or "best" (its best value over the run).
    direction    "minimize" (default) or "maximize".
    pruner       "none" (default), "median" or "hyperband": Optuna's MedianPruner / HyperbandPruner on the
                 metric as each eval reports it (steps are training steps). `pruner_args`: their keyword
                 arguments, e.g. {"n_startup_trials": 3, "n_warmup_steps": 10}.
    seed         default 0: the samplers' seed (trial n draws with seed + n, so a rerun never repeats a draw).
    name         default: the sweep file's name. The study name, and part of the default sweep dir.

The sweep dir (default `<parent of config.workdir>/sweeps/<workdir name>_<name>`, e.g. runs/sweeps/tiny_lr_grid)
holds the study (study.journal, Optuna's JournalFileBackend), sweep.json (the sweep and base config), the
trial dirs and, at the end, results.csv, results.md and results.png (the objective against each parameter).

Workers and storage: `--workers N` starts N-1 more worker processes on this machine (`--worker`, fed the
config through stdin); all share the study, and each runs trials in-process through `jaxtrain.train.run`.
Local workers share this machine's devices: right for CPU; on an accelerator run one worker per machine (or
give each its own devices). With `--storage URL` (an RDB URL such as postgresql://user:PASS@host/db, or a
journal file path) the study lives there, and the same command on any machine adds a worker; give every
machine the same --sweep_dir on a shared file system so that retries find their checkpoints.

Budget and resume: trials that count are complete, pruned, failed with an error (a ConfigError or any other
exception: recorded with its one-line reason, the sweep goes on), running and queued. Rerunning the same
command continues the study: finished trials are never redone. A trial whose worker died (its pid is gone on
this machine, or its heartbeat is older than STALE_AFTER_S) or was interrupted (Ctrl-C, SIGTERM) is marked
failed ("interrupted") and its values are queued again as a new trial in the SAME workdir, so the retry
resumes from that trial's last checkpoint; interrupted trials do not count. Workers claim trials under a
file lock in the sweep dir, so local workers never overshoot the budget; workers on several machines may
overshoot by up to one trial per extra machine (and, for grid, run a point twice).

A changed sweep file or base config in an existing study is refused (exit 2), except `trials`.

Exit codes: 0 done (whatever the trials' states: see the results); 2 bad input, before any trial runs (one
`error: ...` line on stderr: the sweep file, the space, a value the config's validation rejects, the storage);
75 SIGTERM (the running trials saved a checkpoint and are retried by the next run of the same command).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import fcntl
import gc
import importlib.util
import itertools
import json
import math
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

import optuna
from optuna.trial import TrialState

from jaxtrain import config as config_lib
from jaxtrain import errors
from jaxtrain.errors import SweepError
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.observe import tracking

SAMPLERS = ("grid", "random", "tpe")
PRUNERS = ("none", "median", "hyperband")
OBJECTIVES = ("final", "best")
DIRECTIONS = ("minimize", "maximize")
KEYS = ("space", "sampler", "sampler_args", "trials", "metric", "objective", "direction", "pruner", "pruner_args",
        "seed", "name")
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0  # a RUNNING trial whose heartbeat is this old is taken for dead (other machines)
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


# ===== The sweep file ==================================================================================

@dataclasses.dataclass(frozen=True)
class Param:
    """One dimension of the space: kind "float", "int" or "categorical"."""
    kind: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple = ()

    def grid(self) -> list | None:
        """Every value, or None for a continuous range."""
        if self.kind == "categorical":
            return list(self.choices)
        if self.kind == "int":
            return list(range(self.low, self.high + 1, self.step))
        if self.step is None:
            return None
        n = int(math.floor((self.high - self.low) / self.step + 1e-9))
        return [round(self.low + k * self.step, 12) for k in range(n + 1)]

    def extremes(self) -> list:
        return list(self.choices) if self.kind == "categorical" else [self.low, self.high]

    def suggest(self, trial, name):
        if self.kind == "float":
            return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)
        if self.kind == "int":
            return trial.suggest_int(name, self.low, self.high, step=self.step, log=self.log)
        return trial.suggest_categorical(name, list(self.choices))

    def log_axis(self) -> bool:
        """Whether a plot should use a log axis (numeric choices spanning a factor of 10 count as log)."""
        if self.kind != "categorical":
            return self.log
        nums = [v for v in self.choices if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return len(nums) == len(self.choices) and min(nums) > 0 and max(nums) / min(nums) >= 10


def uniform(low, high, step=None) -> Param:
    """Floats in [low, high]; with `step`, only low + k * step (then grid can enumerate them)."""
    return Param("float", low, high, step=step)


def loguniform(low, high) -> Param:
    """Floats in [low, high], uniform in log space (learning rates, weight decay)."""
    return Param("float", low, high, log=True)


def integer(low, high, step=1, log=False) -> Param:
    """Integers low, low + step, ..., high (inclusive)."""
    return Param("int", low, high, step=step, log=log)


def choice(*values) -> Param:
    """One of `values` (None, bool, int, float or str); the same as a plain list."""
    return Param("categorical", choices=tuple(values))


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A checked sweep file. `trials` is the effective budget (grid: capped at the grid size)."""
    name: str
    space: dict
    sampler: str = "tpe"
    sampler_args: dict = dataclasses.field(default_factory=dict)
    trials: int = 0
    metric: str = "eval_loss"
    objective: str = "final"
    direction: str = "minimize"
    pruner: str = "none"
    pruner_args: dict = dataclasses.field(default_factory=dict)
    seed: int = 0

    def identity(self) -> dict:
        """Everything a study is tied to (the budget may change between invocations)."""
        d = dataclasses.asdict(self)
        d.pop("trials")
        d["space"] = {k: dataclasses.asdict(p) for k, p in self.space.items()}
        return json.loads(json.dumps(d, default=list))

    def grid_points(self) -> list[dict]:
        paths = list(self.space)
        return [dict(zip(paths, values)) for values in itertools.product(*(self.space[p].grid() for p in paths))]


def load(sweep, trials: int | None = None) -> Sweep:
    """A Sweep from a sweep file path, a get_sweep() dict/ConfigDict, or a Sweep; `trials` overrides the budget."""
    if isinstance(sweep, Sweep):
        spec = sweep
        if trials is not None:
            spec = dataclasses.replace(spec, trials=_budget(trials, spec.sampler, spec.space, "--trials"))
        return spec
    if isinstance(sweep, (str, os.PathLike)):
        path = Path(sweep)
        if not path.is_file():
            raise SweepError("--sweep", f"{path}: file not found")
        module_spec = importlib.util.spec_from_file_location(f"_jaxtrain_sweep_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any error in the user's file is bad input
            raise SweepError("--sweep", f"{path}: {type(e).__name__}: {e}".splitlines()[0]) from None
        if not callable(getattr(module, "get_sweep", None)):
            raise SweepError("--sweep", f"{path}: no get_sweep() function")
        try:
            raw = module.get_sweep()
        except Exception as e:  # noqa: BLE001
            raise SweepError("--sweep", f"{path}: get_sweep() raised {type(e).__name__}: {e}".splitlines()[0]) from None
        return parse(raw, default_name=path.stem, trials=trials)
    return parse(sweep, trials=trials)


def parse(raw, default_name: str = "sweep", trials: int | None = None) -> Sweep:
    """Checks a get_sweep() result; raises SweepError naming the first bad key."""
    if hasattr(raw, "to_dict"):  # ml_collections.ConfigDict
        raw = raw.to_dict()
    if not isinstance(raw, Mapping):
        raise SweepError("get_sweep", f"must return a dict or ConfigDict, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise SweepError(str(unknown[0]), f"unknown key; choose from {list(KEYS)}")
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SweepError("name", f"must be letters, digits, '_', '-' or '.', got {name!r}")
    sampler = _one_of(raw, "sampler", SAMPLERS, "tpe")
    space = _space(raw.get("space"), sampler)
    pruner = _one_of(raw, "pruner", PRUNERS, "none")
    metric = raw.get("metric", "eval_loss")
    if not isinstance(metric, str) or not metric:
        raise SweepError("metric", f"must be the name of a logged metric such as 'eval_loss', got {metric!r}")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SweepError("seed", f"must be a non-negative integer, got {seed!r}")
    budget = trials if trials is not None else raw.get("trials")
    spec = Sweep(name=name, space=space, sampler=sampler, sampler_args=_args(raw, "sampler_args"),
                 trials=_budget(budget, sampler, space, "--trials" if trials is not None else "trials"),
                 metric=metric, objective=_one_of(raw, "objective", OBJECTIVES, "final"),
                 direction=_one_of(raw, "direction", DIRECTIONS, "minimize"), pruner=pruner,
                 pruner_args=_args(raw, "pruner_args"), seed=seed)
    if spec.sampler_args and sampler != "tpe":
        raise SweepError("sampler_args", f"only the 'tpe' sampler takes arguments, not {sampler!r}")
    if spec.pruner_args and pruner == "none":
        raise SweepError("pruner_args", "given, but pruner is 'none'")
    make_sampler(spec, seed)  # bad sampler_args / pruner_args fail here, not in a worker
    make_pruner(spec)
    return spec


def _one_of(raw, key, choices, default):
    value = raw.get(key, default)
    if value not in choices:
        raise SweepError(key, f"unknown value {value!r}; choose one of {list(choices)}")
    return value


def _args(raw, key) -> dict:
    value = raw.get(key) or {}
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise SweepError(key, f"must be a dict of keyword arguments, got {value!r}")
    return dict(value)


def _budget(value, sampler, space, field) -> int:
    grid_size = math.prod(len(p.grid()) for p in space.values()) if sampler == "grid" else None
    if value is None and grid_size:
        return grid_size
    if value is None:
        raise SweepError(field, f"required for the {sampler!r} sampler: the number of trials to run")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SweepError(field, f"must be an integer >= 1, got {value!r}")
    return min(value, grid_size) if grid_size else value


def _flatten_space(space, prefix="") -> dict:
    out = {}
    for key, value in space.items():
        if isinstance(value, Mapping):
            out.update(_flatten_space(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _space(space, sampler) -> dict:
    if hasattr(space, "to_dict"):
        space = space.to_dict()
    if not isinstance(space, Mapping):
        raise SweepError("space", f"must be a dict {{config path: values}}, got {space!r}")
    flat = _flatten_space(space)
    if not flat:
        raise SweepError("space", "empty: name at least one config path to search, e.g. {'optim.lr': [1e-3, 3e-3]}")
    out = {}
    for path, value in flat.items():
        field = f"space.{path}"
        param = choice(*value) if isinstance(value, (list, tuple)) else value
        if not isinstance(param, Param):
            raise SweepError(field, f"expected a list of values or uniform/loguniform/integer/choice(...), got {value!r}")
        _check_param(field, param)
        if sampler == "grid" and param.grid() is None:
            raise SweepError(field, f"the grid sampler needs discrete values; {_describe(param)} is continuous "
                             f"(use a list, integer(...) or uniform(..., step=...), or sampler 'random'/'tpe')")
        out[path] = param
    return out


def _describe(p: Param) -> str:
    if p.kind == "categorical":
        return f"choice{p.choices}"
    name = {"float": "loguniform" if p.log else "uniform", "int": "integer"}[p.kind]
    return f"{name}({p.low}, {p.high})"


def _check_param(field, p: Param):
    if p.kind == "categorical":
        if not p.choices:
            raise SweepError(field, "no values to choose from")
        for v in p.choices:
            if v is not None and not isinstance(v, (bool, int, float, str)):
                raise SweepError(field, f"values must be None, bool, int, float or str, got {v!r}")
        if len(set(map(repr, p.choices))) != len(p.choices):
            raise SweepError(field, f"repeated values in {list(p.choices)}")
        return
    number = int if p.kind == "int" else (int, float)
    for what, v in (("low", p.low), ("high", p.high)):
        if isinstance(v, bool) or not isinstance(v, number) or (isinstance(v, float) and not math.isfinite(v)):
            raise SweepError(field, f"{what} must be a finite {'integer' if p.kind == 'int' else 'number'}, got {v!r}")
    if not p.low < p.high:
        raise SweepError(field, f"low must be < high, got {_describe(p)}")
    if p.log and p.low <= 0:
        raise SweepError(field, f"a log scale needs low > 0, got {_describe(p)}")
    if p.step is not None:
        if isinstance(p.step, bool) or not isinstance(p.step, number) or p.step <= 0:
            raise SweepError(field, f"step must be a positive {'integer' if p.kind == 'int' else 'number'}, got {p.step!r}")
        if p.log and p.step != 1:
            raise SweepError(field, "a log scale takes no step")
        if p.step > p.high - p.low:
            raise SweepError(field, f"step {p.step} is larger than the range {p.high - p.low}")


def make_sampler(spec: Sweep, seed: int):
    if spec.sampler == "tpe":
        try:
            return optuna.samplers.TPESampler(seed=seed, **spec.sampler_args)
        except (TypeError, ValueError) as e:
            raise SweepError("sampler_args", str(e).splitlines()[0]) from None
    return optuna.samplers.RandomSampler(seed=seed)  # grid points are queued explicitly (see _claim)


def make_pruner(spec: Sweep):
    kind = {"none": optuna.pruners.NopPruner, "median": optuna.pruners.MedianPruner,
            "hyperband": optuna.pruners.HyperbandPruner}[spec.pruner]
    try:
        return kind(**spec.pruner_args)
    except (TypeError, ValueError) as e:
        raise SweepError("pruner_args", str(e).splitlines()[0]) from None


# ===== Trial configs and checks before anything runs ====================================================

def trial_config(base, params: dict, workdir):
    """A copy of `base` with the trial's values and workdir; TypeError if a value does not fit its field."""
    config = copy.deepcopy(base)
    for path, value in params.items():
        *groups, leaf = path.split(".")
        node = config
        for g in groups:
            node = node[g]
        node[leaf] = value
    config.workdir = str(workdir)
    config.distributed.auto = False  # a trial is one process, even inside a SLURM/K8s allocation
    return config


def check(config, spec: Sweep) -> None:
    """Raises SweepError/ConfigError for a space that names unknown paths or values the config rejects.

    Validated: the base config; every grid point; for random/tpe each parameter's extremes one at a time
    (the others at the base values) and the all-low and all-high corners."""
    import jax

    for path in spec.space:
        node, parts = config, path.split(".")
        for i, part in enumerate(parts):
            if not hasattr(node, "keys") or part not in node:
                raise SweepError(f"space.{path}", "unknown config path (not in the base config, "
                                 "jaxtrain.config.base_config)")
            node = node[part]
        if hasattr(node, "keys"):
            raise SweepError(f"space.{path}", f"is a group; name one of its fields, e.g. {path}.{next(iter(node.keys()))}")
        if parts[0] in ("workdir", "distributed"):
            raise SweepError(f"space.{path}", "set by the sweep (each trial is one process in its own workdir)")
    d = config.distributed
    if d.coordinator or d.num_processes not in (0, 1):
        raise SweepError("distributed", "a sweep runs each trial in one process; leave distributed.* unset")
    devices = jax.device_count()
    config_lib.validate(trial_config(config, {}, "sweep_check"), devices, 1)  # the base config alone

    if spec.sampler == "grid":
        points = spec.grid_points()
    else:
        points = [{path: value} for path, p in spec.space.items() for value in p.extremes()]
        points += [{path: p.extremes()[i] for path, p in spec.space.items()} for i in (0, -1)]
    for point in points:
        try:
            cfg = trial_config(config, point, "sweep_check")
        except TypeError:
            path, value = next((k, v) for k, v in point.items() if not _fits(config, k, v))
            raise SweepError(f"space.{path}", f"{value!r} does not fit the config field's type "
                             f"({type(_get(config, path)).__name__})") from None
        try:
            config_lib.validate(cfg, devices, 1)
        except errors.ConfigError as e:
            named = e.field if e.field in point else None
            values = ", ".join(f"{k}={v!r}" for k, v in point.items())
            raise SweepError(f"space.{named}" if named else "space", f"{values} fails the config's validation: {e}") from None


def _get(config, path):
    for part in path.split("."):
        config = config[part]
    return config


def _fits(config, path, value) -> bool:
    try:
        trial_config(config, {path: value}, "x")
        return True
    except TypeError:
        return False


# ===== The study ========================================================================================

def default_sweep_dir(config, name: str) -> Path:
    workdir = Path(config.workdir)
    return workdir.parent / "sweeps" / f"{workdir.name}_{name}"


def _storage(sweep_dir: Path, storage: str | None):
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
        study = optuna.create_study(storage=_storage(sweep_dir, storage), study_name=spec.name,
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


def _params(t) -> dict:
    """A trial's values, also for one that died before suggesting them (queued values)."""
    return dict(t.params) or dict(t.system_attrs.get("fixed_params", {}))


def _interrupted(t) -> bool:
    return t.state == TrialState.FAIL and "error" not in t.user_attrs


def _counts(t) -> bool:
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
        if _interrupted(t) and t.number not in retried and _params(t):
            workdir = t.user_attrs.get("workdir", f"trial_{t.number:04d}")
            study.enqueue_trial(_params(t), user_attrs={"workdir": workdir, "retry_of": t.number})
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


def _claim(study: optuna.Study, spec: Sweep, sweep_dir: Path):
    """The next trial for this worker, with its values suggested, or None once the budget is spent."""
    with _claim_lock(sweep_dir):
        recover(study)
        trials = study.get_trials(deepcopy=False)
        if not any(t.state == TrialState.WAITING for t in trials):
            if sum(map(_counts, trials)) >= spec.trials:
                return None
            if spec.sampler == "grid":
                taken = {_key(_params(t), spec) for t in trials if _counts(t)}
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


# ===== Running one trial ================================================================================

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


class _Heartbeat:
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
    from jaxtrain import train

    workdir = sweep_dir / trial.user_attrs["workdir"]
    workdir.mkdir(parents=True, exist_ok=True)
    prior = metric_history(workdir, spec.metric)  # a retry: what the interrupted attempt already reported
    for step, value in sorted(prior.items()):
        trial.report(value, step)
    t0 = time.perf_counter()
    state, error = TrialState.COMPLETE, None
    with open(workdir / "log.txt", "a", buffering=1) as log, _Heartbeat(trial):
        def say(*args, **kwargs):
            print(*args, file=log, **{k: v for k, v in kwargs.items() if k != "file"})

        try:
            config = trial_config(base, params, workdir)
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
    while (claimed := _claim(study, spec, sweep_dir)) is not None:
        trial, params = claimed
        print_fn(f"trial {trial.number} started: {_fmt(params)} -> {sweep_dir / trial.user_attrs['workdir']}"
                 + (f" (retry of trial {trial.user_attrs['retry_of']})" if "retry_of" in trial.user_attrs else ""))
        frozen = run_trial(study, spec, base, sweep_dir, trial, params)
        ran += 1
        done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (_counts(t) and t.state == TrialState.FAIL)
                   for t in study.get_trials(deepcopy=False))
        print_fn(f"[{done}/{spec.trials}] trial {frozen.number} {_outcome(frozen, spec)} | {_fmt(params)} | "
                 f"{frozen.user_attrs.get('wall_s', 0):.1f}s")
    return ran


def _fmt(params: dict) -> str:
    return " ".join(f"{k}={_num(v)}" for k, v in params.items())


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _outcome(t, spec: Sweep) -> str:
    metric = f"{spec.metric}{'' if spec.objective == 'final' else ' (best)'}"
    if t.state == TrialState.COMPLETE:
        return f"complete {metric} {t.value:.4f}"
    if t.state == TrialState.PRUNED:
        return f"pruned at step {t.last_step} {spec.metric} {t.value:.4f}" if t.value is not None else "pruned"
    return f"failed: {t.user_attrs.get('error', 'interrupted')}"


# ===== Results ==========================================================================================

def result_rows(study: optuna.Study, spec: Sweep, sweep_dir: Path) -> list[dict]:
    """One row per trial, sorted by objective (best first); trials without a value last, by number."""
    trials = study.get_trials(deepcopy=False)
    retries = {t.user_attrs["retry_of"]: t.number for t in trials if "retry_of" in t.user_attrs}
    rows = []
    for t in trials:
        state, note = t.state.name.lower(), t.user_attrs.get("error", "")
        if _interrupted(t):
            state = "interrupted"
            note = f"retried as trial {retries[t.number]}" if t.number in retries else "retried by the next run"
        elif t.state == TrialState.PRUNED:
            note = f"pruned at step {t.last_step}"
        params = _params(t)
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
        cells = [f"{r[c]:.4f}" if c == "objective" and r[c] is not None else _num(r[c]) if r[c] is not None else ""
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


# ===== The sweep ========================================================================================

def run(config, sweep, sweep_dir=None, *, workers: int = 1, storage: str | None = None, trials: int | None = None,
        print_fn=print) -> dict:
    """Runs (or continues) a sweep of `config` and writes the results. `sweep`: a sweep file path, a
    get_sweep() dict or a Sweep. Raises SweepError/ConfigError/DataError before any trial for bad input.

    Returns {"rows", "best" (row or None), "csv", "markdown", "plot", "sweep_dir"}."""
    from jaxtrain.data import layout, prepare

    spec = load(sweep, trials)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SweepError("--workers", f"must be an integer >= 1, got {workers!r}")
    check(config, spec)
    sweep_dir = Path(sweep_dir) if sweep_dir else default_sweep_dir(config, spec.name)
    # The corpus once, here: N workers' first trials would otherwise all build it; a DataError is bad input.
    ddir = layout.default_dir(config.data)
    if not layout.prepared_from_sources(ddir):
        prepare.prepare_default_corpus(ddir, config.data.vocab_size, config.data.heldout_docs)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our one line per trial replaces Optuna's
    study = open_study(spec, config, sweep_dir, storage)
    (sweep_dir / "sweep.json").write_text(json.dumps(
        {"sweep": spec.identity(), "trials": spec.trials, "storage": describe_storage(sweep_dir, storage),
         "config": tracking.redact(config.to_dict())}, indent=1, default=str))
    have = [t for t in study.get_trials(deepcopy=False) if _counts(t) and t.state != TrialState.RUNNING]
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
                 f"{_fmt({p: best[p] for p in spec.space})} | {best['workdir']}")
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
                             stdout=subprocess.PIPE, text=False, env={**os.environ, "JAXTRAIN_SWEEP_WORKER": str(index)})
    child.stdin.write(pickle.dumps({"config": config, "spec": spec, "sweep_dir": str(sweep_dir), "storage": storage}))
    child.stdin.close()

    def forward():
        for line in child.stdout:
            print_fn(f"[worker {index}] {line.decode(errors='replace').rstrip()}")

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    return child, reader


def _worker_main() -> int:

    job = pickle.load(sys.stdin.buffer)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep_dir = Path(job["sweep_dir"])
    study = optuna.load_study(study_name=job["spec"].name, storage=_storage(sweep_dir, job["storage"]),
                              sampler=make_sampler(job["spec"], job["spec"].seed), pruner=make_pruner(job["spec"]))
    try:
        work(study, job["spec"], job["config"], sweep_dir, lambda *a: print(*a, flush=True))
    except errors.Preempted:
        return errors.EXIT_PREEMPTED
    return errors.EXIT_OK


def main(argv: list[str] | None = None):
    """`jaxtrain sweep ...`: `argv` without the program name (default: sys.argv[1:]); exits."""
    from absl import app, flags, logging

    from jaxtrain import main as main_cli  # main defines --config (a config file + overrides)

    flags.DEFINE_string("sweep", None, "Path to a sweep file (configs/sweeps/*.py) with get_sweep().")
    flags.DEFINE_integer("workers", 1, "Worker processes on this machine (this one plus N-1 more).")
    flags.DEFINE_string("sweep_dir", None, "Where the study, trial dirs and results go "
                        "(default: <parent of config.workdir>/sweeps/<workdir name>_<sweep name>).")
    flags.DEFINE_string("storage", None, "An RDB URL (workers on many machines) or a journal file path; "
                        "default SWEEP_DIR/study.journal.")
    flags.DEFINE_integer("trials", None, "Override the sweep file's trial budget.")
    flags.DEFINE_boolean("worker", False, "Internal: an extra worker started by --workers (job on stdin).")
    FLAGS = flags.FLAGS

    def run_sweep(argv):
        del argv
        if not FLAGS["verbosity"].present:  # Orbax logs every file operation at INFO
            logging.set_verbosity(logging.WARNING)
        if FLAGS.worker:
            sys.exit(_worker_main())
        if main_cli.CONFIG_FLAG.value is None:
            print("error: --config: required (e.g. --config configs/tiny.py)", file=sys.stderr)
            sys.exit(errors.EXIT_BAD_INPUT)
        if not FLAGS.sweep:
            print("error: --sweep: required (e.g. --sweep configs/sweeps/lr_grid.py)", file=sys.stderr)
            sys.exit(errors.EXIT_BAD_INPUT)
        try:
            run(main_cli.CONFIG_FLAG.value, FLAGS.sweep, FLAGS.sweep_dir, workers=FLAGS.workers, storage=FLAGS.storage,
                trials=FLAGS.trials, print_fn=lambda *a: print(*a, flush=True))
        except (errors.ConfigError, errors.DataError) as e:
            print(f"error: {e}".splitlines()[0], file=sys.stderr)
            sys.exit(errors.EXIT_BAD_INPUT)
        except errors.Preempted:
            print("preempted: running trials saved a checkpoint; rerun the same command to resume", file=sys.stderr)
            sys.exit(errors.EXIT_PREEMPTED)
        sys.exit(errors.EXIT_OK)

    app.run(run_sweep, argv=["jaxtrain sweep", *(sys.argv[1:] if argv is None else argv)],
            flags_parser=main_cli.parse_flags)
