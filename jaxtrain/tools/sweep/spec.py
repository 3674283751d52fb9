"""The sweep file format: `get_sweep()`'s dict, checked into a `Sweep`, and a sweep's checks against a config.

`uniform`, `loguniform`, `integer` and `choice` are what sweep files call (re-exported by the package).
Everything bad in a sweep file raises SweepError naming its key, so `jaxtrain sweep` exits 2 with one
line before any trial runs. The format is documented in docs/experiments.md (Sweeps).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import optuna

from jaxtrain import config as config_lib
from jaxtrain import errors, files
from jaxtrain.errors import ConfigError, SweepError

SAMPLERS = ("grid", "random", "tpe")
PRUNERS = ("none", "median", "hyperband")
OBJECTIVES = ("final", "best")
DIRECTIONS = ("minimize", "maximize")
KEYS = ("space", "sampler", "sampler_args", "trials", "metric", "objective", "direction", "pruner", "pruner_args",
        "seed", "name")


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
        try:
            raw = files.run_python_file(path, "get_sweep", field="--sweep")
        except ConfigError as e:
            raise SweepError(e.field, e.reason) from None
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
            raise SweepError(field, "expected a list of values or uniform/loguniform/integer/choice(...), "
                             f"got {value!r}")
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
            raise SweepError(field, f"step must be a positive {'integer' if p.kind == 'int' else 'number'}, "
                             f"got {p.step!r}")
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
    return optuna.samplers.RandomSampler(seed=seed)  # grid points are queued explicitly (see study.claim)

def make_pruner(spec: Sweep):
    kind = {"none": optuna.pruners.NopPruner, "median": optuna.pruners.MedianPruner,
            "hyperband": optuna.pruners.HyperbandPruner}[spec.pruner]
    try:
        return kind(**spec.pruner_args)
    except (TypeError, ValueError) as e:
        raise SweepError("pruner_args", str(e).splitlines()[0]) from None

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
    if config.checkpoint.dir:  # trials share the config's checkpoint.dir: each its own dir under it
        config.checkpoint.dir = f"{config.checkpoint.dir.rstrip('/')}/{os.path.basename(str(workdir))}"
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
            raise SweepError(f"space.{path}",
                             f"is a group; name one of its fields, e.g. {path}.{next(iter(node.keys()))}")
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
            raise SweepError(f"space.{named}" if named else "space",
                             f"{values} fails the config's validation: {e}") from None

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

def format_value(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)

def format_point(params: dict) -> str:
    """A point of the space as the progress lines and the table show it."""
    return " ".join(f"{k}={format_value(v)}" for k, v in params.items())
