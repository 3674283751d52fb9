"""Metric writers, peak FLOP/s and MFU.

Writers: JSONL and TensorBoard always; MLflow and Weights & Biases when `log.trackers` names them (optional
extras). Every writer gets the same records; the config they log is redacted (jaxtrain.observe.tracking).

MFU = model FLOPs per second achieved / peak FLOP/s of the devices used. Model FLOPs per token are
`jaxtrain.models.transformer.train_flops_per_token` (6 * N_matmul + causal attention). The peak comes
from a table by device kind; on CPU it is a 2048x2048 matmul in the compute dtype, measured once and cached,
because "peak" of a CPU depends on the machine. Simulated CPU devices share the same cores, so on CPU the peak
is the machine's, not multiplied by the device count.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import sys
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import files
from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group
from jaxtrain.observe import profiling, tracking

# Dense bf16 peak FLOP/s per device (vendor figures).
PEAK_FLOPS = {
    "h100": 989e12, "h200": 989e12, "b200": 2250e12, "a100": 312e12, "l4": 121e12,
    "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12, "tpu v5p": 459e12, "tpu v5": 459e12,
    "tpu v6 lite": 918e12, "tpu v6e": 918e12,
}


class MetricWriter:
    """The interface every writer implements."""

    def write_scalars(self, step: int, scalars: dict) -> None: ...
    def write_hparams(self, hparams: dict) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class JsonlWriter(MetricWriter):
    def __init__(self, path: str | os.PathLike):
        self._file = open(path, "a", buffering=1)

    def write_scalars(self, step, scalars):
        # Wall time (unix seconds) lets reports plot against time and see gaps between invocations.
        record = {"step": int(step), "time": round(time.time(), 3), **{k: _plain(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(record) + "\n")

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()


class TensorBoardWriter(MetricWriter):
    def __init__(self, logdir: str | os.PathLike):
        # Imported here: only process 0 writes. Entry points import it first without torch (jaxtrain.compat).
        from tensorboardX import SummaryWriter  # noqa: PLC0415

        self._writer = SummaryWriter(str(logdir))

    def write_scalars(self, step, scalars):
        for k, v in scalars.items():
            if (value := _plain(v)) is not None:
                self._writer.add_scalar(k, value, int(step))

    def write_hparams(self, hparams):
        self._writer.add_text("config", "```\n" + json.dumps(hparams, indent=1, default=str) + "\n```")

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()


class MultiWriter(MetricWriter):
    def __init__(self, writers):
        self.writers = list(writers)

    def write_scalars(self, step, scalars):
        for w in self.writers:
            w.write_scalars(step, scalars)

    def write_hparams(self, hparams):
        for w in self.writers:
            w.write_hparams(hparams)

    def flush(self):
        for w in self.writers:
            w.flush()

    def close(self):
        for w in self.writers:
            w.close()


# ===== Reading metrics.jsonl back ========================================================================

def read_records(metrics: Path) -> list[dict]:
    """A metrics.jsonl's records with an integer step, in file order (a line a kill cut short, or damaged so that
    it does not parse, is skipped)."""
    records = []
    with open(metrics, encoding="utf-8", errors="replace") as f:  # a stray byte damages its line only
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # the line a kill cut short
                continue
            if isinstance(r, dict) and isinstance(r.get("step"), int):
                records.append(r)
    return records


def lineage(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, eval) records of the final lineage, in step order. A resumed or rolled-back run logs again
    from an earlier step, so a record at step s ends every earlier record past s: the later record for a
    step wins, and steps an abandoned attempt logged past the resume point drop out."""
    train: list[dict] = []
    evals: list[dict] = []
    for r in records:
        is_eval = any(k.startswith("eval_") for k in r)
        # A step's eval record follows its train record, so an eval at s ends only the train records after s.
        while train and (train[-1]["step"] > r["step"] or (train[-1]["step"] == r["step"] and not is_eval)):
            train.pop()
        while evals and evals[-1]["step"] >= r["step"]:
            evals.pop()
        if is_eval or "loss" in r:
            (evals if is_eval else train).append(r)
    return train, evals


def earlier_evals(workdir, up_to: int) -> list[dict]:
    """The eval records of the final lineage at steps <= `up_to`: what a run resumed at that step evaluated
    before (for its summary). [] where there is no metrics.jsonl."""
    metrics = Path(workdir) / "metrics.jsonl"
    return [r for r in lineage(read_records(metrics))[1] if r["step"] <= up_to] if metrics.is_file() else []


TRACKERS = ("mlflow", "wandb")
WANDB_MODES = ("offline", "online", "disabled")
WANDB_FORBIDDEN = "/\\#?%:"
NAME_MAX = 128  # W&B's limit for project and run names; MLflow's are longer
# The config's `log` group. A progress line and a metrics record every `every_steps`. `fingerprints`: also append
# each step's batch hash to WORKDIR/data_fingerprints.<process>.jsonl, an audit trail that proves a resumed run saw
# exactly the batches an uninterrupted one would. `trackers`: also log to "mlflow" and/or "wandb" (comma-separated;
# optional extras). The MLflow/W&B run is named `run_name` (default: the workdir's name) in experiment/project
# `experiment`. `mlflow_uri` empty = $MLFLOW_TRACKING_URI or sqlite:///WORKDIR/mlflow.db. `wandb_mode`: offline
# (WORKDIR/wandb, `wandb sync` later), online or disabled; `wandb_api_key` empty = W&B's own login ($WANDB_API_KEY),
# and is redacted. `profile_steps`: "FIRST,LAST" (or one step) to trace with jax.profiler into WORKDIR/profile.
LOG_CONFIG = dict(every_steps=10, fingerprints=False, trackers="", experiment="jaxtrain", run_name="",
                  mlflow_uri="", wandb_mode="offline", wandb_entity="", wandb_api_key="", profile_steps="")


def check_log_config(log) -> None:
    """ConfigError naming the first bad field of the `log` group. Named trackers must be importable now, not after
    the compile."""
    g = Group(log, "log")
    g.positive_int("every_steps")
    for f in ("trackers", "experiment", "run_name", "mlflow_uri", "wandb_entity", "wandb_api_key"):
        g.string(f)
    try:
        names = parse_trackers(log.trackers)
    except ValueError as e:
        raise ConfigError("log.trackers", str(e)) from None
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ConfigError("log.trackers", f"{name} is not installed: pip install 'jaxtrain[{name}]'")
    if "mlflow" in names and not log.experiment:
        raise ConfigError("log.experiment", "must not be empty with mlflow")
    if "wandb" in names:  # W&B refuses these in project and entity names, with an error that echoes the name
        for f in ("experiment", "wandb_entity"):
            if bad := sorted(set(log[f]) & set(WANDB_FORBIDDEN)):
                raise ConfigError(f"log.{f}", f"W&B names cannot contain {' '.join(bad)} (got {tracking.redact(log[f])!r})")
    for f in ("experiment", "run_name", "wandb_entity"):
        if len(log[f]) > NAME_MAX:
            raise ConfigError(f"log.{f}", f"{len(log[f])} characters; trackers take at most {NAME_MAX}")
    g.choice("wandb_mode", WANDB_MODES)
    profiling.parse_steps(log.profile_steps)


def parse_trackers(spec: str) -> list[str]:
    """`log.trackers` "mlflow,wandb" -> names; ValueError on an unknown one."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if n not in TRACKERS:
            raise ValueError(f"unknown tracker {n!r}; choose from {list(TRACKERS)} (jsonl and tensorboard always write)")
    return names


class _TrackerIds:
    """WORKDIR/trackers.json: the tracker run ids of this workdir, so a resumed run continues the same run."""

    def __init__(self, workdir):
        self.path = Path(workdir) / "trackers.json"

    def get(self, name: str) -> dict:
        try:
            return json.loads(self.path.read_text()).get(name, {})
        except (OSError, ValueError):
            return {}

    def put(self, name: str, value: dict) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        data[name] = value
        files.write_json(self.path, data)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


class MLflowWriter(MetricWriter):
    """One MLflow run per workdir (resumed runs continue it), through MlflowClient: no global active run,
    so several runs in one process (a sweep) don't interfere. Params are the flattened, redacted config."""

    def __init__(self, workdir, *, uri: str, experiment: str, run_name: str):
        from mlflow import MlflowClient  # optional extra: pip install 'jaxtrain[mlflow]'

        self._client = MlflowClient(tracking_uri=uri)
        ids = _TrackerIds(workdir)
        known = ids.get("mlflow")
        self._new = not (known.get("uri") == uri and known.get("run_id"))
        if self._new:
            exp = self._client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self._client.create_experiment(experiment)
            self.run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id
            ids.put("mlflow", {"uri": uri, "run_id": self.run_id})
        else:
            self.run_id = known["run_id"]
            self._client.update_run(self.run_id, status="RUNNING")
        self._status = "FINISHED"

    def write_scalars(self, step, scalars):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = {k: _plain(v) for k, v in scalars.items()}
        metrics = [Metric(k, float(v), now, int(step)) for k, v in values.items() if isinstance(v, (int, float))]
        self._client.log_batch(self.run_id, metrics=metrics)

    def write_hparams(self, hparams):
        if not self._new:  # MLflow params are immutable; the resumed run keeps the first invocation's
            return
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flat(hparams).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self._client.log_batch(self.run_id, params=params[i:i + 100])

    def close(self):
        self._client.set_terminated(self.run_id, self._status)


class WandbWriter(MetricWriter):
    """A W&B run in `WORKDIR/wandb/` (offline by default: `wandb sync` uploads it later); its id is kept in
    trackers.json so a resumed run appends to the same W&B run."""

    def __init__(self, workdir, *, project: str, run_name: str, mode: str, entity: str = "", api_key: str = ""):
        import wandb  # optional extra: pip install 'jaxtrain[wandb]'

        ids = _TrackerIds(workdir)
        run_id = ids.get("wandb").get("id") or uuid.uuid4().hex[:8]
        ids.put("wandb", {"id": run_id})
        if api_key and mode == "online":
            wandb.login(key=api_key, verify=False)
        argv, sys.argv = sys.argv, tracking.redact_argv(sys.argv)  # W&B records the command line from here
        try:
            self._run = wandb.init(project=project, entity=entity or None, name=run_name, id=run_id, resume="allow",
                                   dir=str(workdir), mode=mode, reinit="create_new",
                                   settings=wandb.Settings(silent=True, console="off"))
        finally:
            sys.argv = argv

    def write_scalars(self, step, scalars):
        values = {k: _plain(v) for k, v in scalars.items()}
        self._run.log({k: v for k, v in values.items() if v is not None}, step=int(step))

    def write_hparams(self, hparams):
        self._run.config.update(hparams, allow_val_change=True)

    def close(self):
        self._run.finish()


def tracker_writers(log_cfg, workdir) -> list[MetricWriter]:
    """The optional writers `log.trackers` names (process 0 only)."""
    workdir = Path(workdir)
    # Names leave the process as they are: redacted like everything else a run logs.
    run_name = tracking.redact(log_cfg.run_name or workdir.resolve().name)
    experiment = tracking.redact(log_cfg.experiment)
    out = []
    for name in parse_trackers(log_cfg.trackers):
        if name == "mlflow":
            uri = log_cfg.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{workdir.resolve()}/mlflow.db"
            out.append(MLflowWriter(workdir, uri=uri, experiment=experiment, run_name=run_name))
        else:
            out.append(WandbWriter(workdir, project=experiment, run_name=run_name, mode=log_cfg.wandb_mode,
                                   entity=log_cfg.wandb_entity, api_key=log_cfg.wandb_api_key))
    return out


def _plain(v):
    """A JSON-safe Python scalar; non-finite floats (e.g. MFU on an unknown device) become None."""
    v = v if isinstance(v, (int, float, str)) else np.asarray(v).item()
    return None if isinstance(v, float) and not math.isfinite(v) else v


# --- Peak FLOP/s -----------------------------------------------------------------------------------

def measure_matmul_flops(n: int = 2048, reps: int = 9, dtype=jnp.float32) -> float:
    """FLOP/s of an n x n matmul in `dtype` on the default device, accumulated in f32 (as the model's matmuls
    are; XLA:CPU runs a bf16 matmul with a bf16 result at f32 speed), from its fastest repeat: other work on the
    machine only slows a repeat, and the figure is cached for good. n=2048 reads the same peak as 4096 in a
    fraction of the time, which a first run on a new machine spends before its first step (docs/performance.md,
    "MFU")."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    mm(a).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mm(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


def _cpu_cache_key() -> str:
    return f"{platform.node()}|{platform.processor() or platform.machine()}|{os.cpu_count()}|jax{jax.__version__}"


def peak_flops(cache_dir: str | os.PathLike | None = None, dtype="float32") -> tuple[float, str]:
    """Total peak FLOP/s of the devices this run uses, and where the figure came from. On CPU: a matmul in the
    compute `dtype`, measured once per machine and dtype (cached); elsewhere the vendor's dense bf16 figure."""
    devices = jax.devices()
    kind = devices[0].device_kind.lower()
    if devices[0].platform != "cpu":
        for name, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
            if name in kind:
                return flops * len(devices), f"table:{name}"
        return float("nan"), f"unknown device kind {kind!r}"
    cache = Path(cache_dir or files.user_cache()) / "cpu_peak.json"
    dtype = jnp.dtype(dtype).name
    key = f"{_cpu_cache_key()}|{dtype}"
    cached = {}
    try:
        cached = json.loads(cache.read_text()).get("flops_by_key", {})
        cached = cached if isinstance(cached, dict) else {}
        if key in cached:
            return float(cached[key]), f"measured {dtype} matmul (cached)"
    except (OSError, ValueError, AttributeError):
        pass
    flops = measure_matmul_flops(dtype=dtype)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        files.write_json(cache, {"flops_by_key": {**cached, key: flops}})
    except OSError:
        pass  # a read-only home only costs a re-measure next time
    return flops, f"measured {dtype} matmul"
