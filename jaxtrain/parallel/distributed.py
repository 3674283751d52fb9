"""Multi-process start-up (decides how to call `jax.distributed.initialize`, then calls it once), and agreement.

Each of coordinator ("host:port"), process count and process id comes from the first of these that sets it:
the config's `distributed` group; JAXTRAIN_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID; then, with auto=True, the
first cluster detected: Cloud TPU (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID, MEGASCALE_*), SLURM (inside srun:
SLURM_PROCID, SLURM_STEP_NUM_TASKS, the node list's first host as coordinator) or Kubernetes (JobSet or an
Indexed Job; Kubernetes never tells a pod the pod count, so JAXTRAIN_NUM_PROCESSES is required there).
JAXTRAIN_COORDINATOR_PORT overrides a derived coordinator's port (SLURM 61440 + job id % 4096, Kubernetes
8476). A count of 1, or nothing set and nothing detected, is a single process. Every variable each path reads
is listed in BUILD.md (Multi-host). Afterwards the processes agree on small decisions (`allgather`,
`any_process`, `from_process_0`) through the coordination service, not the devices.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from absl import logging

from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group

# Kubernetes pods own their network namespace, so a fixed port cannot collide with another job.
K8S_PORT = 8476
# SLURM jobs may share the coordinator's node: derive the port from the job id (as JAX's own SLURM
# detection does) in 61440-65535, above Linux's default ephemeral range (32768-60999).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 61440, 4096

FIELDS = ("coordinator", "num_processes", "process_id")
_ENV = {"coordinator": "JAXTRAIN_COORDINATOR", "num_processes": "JAXTRAIN_NUM_PROCESSES",
        "process_id": "JAXTRAIN_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class Settings:
    coordinator_address: str | None  # "host:port"; None only for source == "tpu" (JAX finds it itself)
    num_processes: int
    process_id: int
    source: str  # "config", "env", "slurm", "kubernetes", "tpu": the lowest layer that set a field
    local_device_ids: tuple[int, ...] | None = None


# The config's `distributed` group: empty/0/-1 = from JAXTRAIN_* env vars, or auto-detected on Cloud TPU, SLURM and
# Kubernetes when `auto`; a single process needs nothing.
CONFIG = dict(coordinator="", num_processes=0, process_id=-1, auto=True, timeout_s=300)


# --- Validation ------------------------------------------------------------------------------------

def check_config(d) -> None:
    """The `distributed` group, checked before jax.distributed starts (so before the other groups)."""
    for f in ("coordinator", "num_processes", "process_id", "auto", "timeout_s"):
        if f not in d:
            raise ConfigError(f"distributed.{f}", "missing")
    try:
        check(d.coordinator, d.num_processes, d.process_id)
    except ValueError as e:
        field, _, reason = str(e).partition(": ")
        raise ConfigError(field, reason) from None
    Group(d, "distributed").number("timeout_s", lo=0, lo_open=True)


def _address_problem(address: str) -> str | None:
    host, sep, port = address.rpartition(":")
    if "://" in address:
        return f"expected host:port without a scheme, got {address!r}"
    if not sep or not host or not port.isdigit():
        return f"expected host:port, got {address!r}"
    if not 0 < int(port) < 65536:
        return f"port must be in 1..65535, got {address!r}"
    return None


def check(coordinator: str, num_processes: int, process_id: int) -> None:
    """Validates the explicit (config) values without touching JAX. 0 / -1 / "" mean unset."""
    if num_processes < 0:
        raise ValueError(f"distributed.num_processes: must be >= 0 (0 = from env or cluster), got {num_processes}")
    if process_id < -1:
        raise ValueError(f"distributed.process_id: must be >= -1 (-1 = from env or cluster), got {process_id}")
    if coordinator and (problem := _address_problem(coordinator)):
        raise ValueError(f"distributed.coordinator: {problem}")
    if num_processes > 1 and not coordinator:
        raise ValueError(f"distributed.coordinator: required when distributed.num_processes={num_processes} > 1")
    if num_processes and process_id >= num_processes:
        raise ValueError(f"distributed.process_id: must be < num_processes={num_processes}, got {process_id}")


def _env_int(env: Mapping[str, str], name: str, minimum: int = 0, required: bool = True) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        if required:
            raise ValueError(f"{name}: not set")
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def _port(env: Mapping[str, str], default: int) -> int:
    port = _env_int(env, "JAXTRAIN_COORDINATOR_PORT", minimum=1, required=False)
    if port is not None and port > 65535:
        raise ValueError(f"JAXTRAIN_COORDINATOR_PORT: must be <= 65535, got {port}")
    return default if port is None else port


# --- SLURM -----------------------------------------------------------------------------------------

def _split_top(text: str) -> list[str]:
    """Splits on commas outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(body: str) -> list[str]:
    out = []
    for item in body.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {item!r}")
        # Zero padding is part of the name: "gpu[003-005]" -> gpu003, gpu004, gpu005.
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list in order, e.g. "gpu[003-005,009],cpu01" -> gpu003, gpu004, gpu005,
    gpu009, cpu01. Several bracket groups in one name expand as a product, as in Slurm's hostlist."""
    hosts = []
    for part in _split_top(nodelist.strip()):
        pieces = re.split(r"\[([^\]]*)\]", part)  # literal, range, literal, range, ..., literal
        if "[" in "".join(pieces[::2]) or "]" in "".join(pieces[::2]):
            raise ValueError(f"unbalanced brackets in {part!r}")
        choices = [[p] if i % 2 == 0 else _expand_range(p) for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def _slurm(env: Mapping[str, str]) -> dict:
    count = _env_int(env, "SLURM_STEP_NUM_TASKS", minimum=1)
    found = {"num_processes": count, "process_id": _env_int(env, "SLURM_PROCID")}
    if count == 1:
        return found
    list_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(v)), None)
    if list_var is None:
        raise ValueError("SLURM_STEP_NODELIST: not set (nor SLURM_JOB_NODELIST); cannot find the coordinator")
    try:
        hosts = expand_nodelist(env[list_var])
    except ValueError as e:
        raise ValueError(f"{list_var}: {e}") from None
    if not hosts:
        raise ValueError(f"{list_var}: no hosts in {env[list_var]!r}")
    job_id = _env_int(env, "SLURM_JOB_ID")
    found["coordinator"] = f"{hosts[0]}:{_port(env, SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN)}"
    # Several tasks on a node means one process per GPU (as JAX's own SLURM detection assumes), each
    # keeping the GPU at its local rank. With --gpus-per-task Slurm already hides the other GPUs, and
    # with one task per node that task drives all of them: leave visibility alone.
    if count > len(hosts) and not env.get("SLURM_GPUS_PER_TASK"):
        found["local_device_ids"] = (_env_int(env, "SLURM_LOCALID"),)
    return found


# --- Kubernetes ------------------------------------------------------------------------------------

def _need_count(what: str) -> ValueError:
    return ValueError(f"JAXTRAIN_NUM_PROCESSES: required on Kubernetes ({what} detected; pods are not told how "
                      "many there are): set it to the total pod count, 1 for independent pods")


def _kubernetes(env: Mapping[str, str], num: int | None) -> dict:
    pod = _env_int(env, "JOB_COMPLETION_INDEX")
    if not env.get("JOBSET_NAME"):
        if num is None:
            raise _need_count(f"Indexed Job pod {env.get('HOSTNAME', '?')}")
        return {"process_id": pod}  # the coordinator must come from JAXTRAIN_COORDINATOR (see resolve)
    jobset = env["JOBSET_NAME"]
    if num is None:
        raise _need_count(f"JobSet {jobset!r}")
    if not env.get("REPLICATED_JOB_NAME"):
        raise ValueError(f"REPLICATED_JOB_NAME: not set (JobSet {jobset!r} detected)")
    job = _env_int(env, "JOB_INDEX")
    rjob = env["REPLICATED_JOB_NAME"]
    pid = pod
    if job > 0:  # pods of job j follow those of jobs 0..j-1, each with num / replicas pods
        replicas = _env_int(env, "REPLICATED_JOB_REPLICAS", minimum=1)
        if num % replicas or job >= replicas:
            raise ValueError(f"REPLICATED_JOB_REPLICAS: {replicas} does not fit JOB_INDEX={job} and "
                             f"JAXTRAIN_NUM_PROCESSES={num} (total pods = replicas x pods per job)")
        pid = job * (num // replicas) + pod
    # Pod hostnames are <jobset>-<replicated job>-<job index>-<pod index> under the subdomain <jobset>.
    return {"coordinator": f"{jobset}-{rjob}-0-0.{jobset}:{_port(env, K8S_PORT)}", "process_id": pid}


# --- TPU -------------------------------------------------------------------------------------------

def _tpu(env: Mapping[str, str]) -> dict:
    var = "TPU_PROCESS_ADDRESSES" if env.get("TPU_PROCESS_ADDRESSES") else "TPU_WORKER_HOSTNAMES"
    hosts = [h for h in env[var].split(",") if h.strip()]
    slices = _env_int(env, "MEGASCALE_NUM_SLICES", minimum=1, required=False) or 1
    count = len(hosts) * slices
    if count <= 1:
        return {"num_processes": 1}  # a single-host TPU VM: nothing to initialise
    worker = _env_int(env, "TPU_WORKER_ID")
    slice_id = _env_int(env, "MEGASCALE_SLICE_ID", required=False) or 0
    if worker >= len(hosts) or slice_id >= slices:
        raise ValueError(f"TPU_WORKER_ID: {worker} (slice {slice_id}) out of range for {len(hosts)} hosts "
                         f"x {slices} slices")
    # Same numbering as JAX's TPU detection: slice-major.
    return {"num_processes": count, "process_id": slice_id * len(hosts) + worker}


def _detect(env: Mapping[str, str], num: int | None) -> tuple[str, dict] | None:
    if env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES"):
        return "tpu", _tpu(env)
    if env.get("SLURM_JOB_ID") and env.get("SLURM_PROCID") and env.get("SLURM_STEP_NUM_TASKS"):
        return "slurm", _slurm(env)
    if env.get("JOB_COMPLETION_INDEX") or env.get("JOBSET_NAME"):
        return "kubernetes", _kubernetes(env, num)
    return None


# --- Resolution ------------------------------------------------------------------------------------

def _given(coordinator: str, num_processes: int, process_id: int, env: Mapping[str, str]) -> dict:
    """Layers 1 and 2: field -> (value, name of the setting it came from, source)."""
    check(coordinator, num_processes, process_id)
    out = {}
    if coordinator:
        out["coordinator"] = (coordinator, "distributed.coordinator", "config")
    elif text := env.get(_ENV["coordinator"], "").strip():
        if problem := _address_problem(text):
            raise ValueError(f"{_ENV['coordinator']}: {problem}")
        out["coordinator"] = (text, _ENV["coordinator"], "env")
    for field, explicit, minimum in (("num_processes", num_processes, 1), ("process_id", process_id, 0)):
        if explicit >= minimum:
            out[field] = (explicit, f"distributed.{field}", "config")
        elif (value := _env_int(env, _ENV[field], minimum=minimum, required=False)) is not None:
            out[field] = (value, _ENV[field], "env")
    return out


def _local_device_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
    text = env.get("JAX_LOCAL_DEVICE_IDS", "").strip()
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"JAX_LOCAL_DEVICE_IDS: expected comma-separated integers, got {text!r}") from None


def resolve(coordinator: str = "", num_processes: int = 0, process_id: int = -1, *, auto: bool = True,
            env: Mapping[str, str] = os.environ) -> Settings | None:
    """Pure: decides how to initialise. None = single process (nothing to initialise). Raises ValueError
    with one line naming the setting when the values are partial or inconsistent."""
    given = _given(coordinator, num_processes, process_id, env)
    values = {f: v[0] for f, v in given.items()}
    names = {f: v[1] for f, v in given.items()}
    sources = {v[2] for v in given.values()}
    extra = {}
    complete = values.get("num_processes") == 1 or len(values) == 3
    if not complete and auto and (found := _detect(env, values.get("num_processes"))):
        source, extra = found
        for field in FIELDS:
            if field not in values and extra.get(field) is not None:
                values[field], names[field] = extra[field], f"{source} detection"
                sources.add(source)
    if not values:
        return None
    num = values.get("num_processes")
    if num is None:
        first = next(iter(names.values()))
        raise ValueError(f"{_ENV['num_processes']}: not set, but {first} is (or set distributed.num_processes)")
    if num == 1:
        return None
    source = next(s for s in ("tpu", "slurm", "kubernetes", "env", "config") if s in sources)
    if "coordinator" not in values and source != "tpu":
        hint = ""
        if env.get("JOB_COMPLETION_INDEX") and not env.get("JOBSET_NAME"):
            job = env.get("HOSTNAME", "<job>-0").rsplit("-", 1)[0]
            hint = f"; on an Indexed Job use {job}-0.<headless service>:{_port(env, K8S_PORT)}"
        raise ValueError(f"{_ENV['coordinator']}: not set, but {names['num_processes']}={num} asks for several "
                         f"processes (or set distributed.coordinator){hint}")
    if "process_id" not in values:
        raise ValueError(f"{_ENV['process_id']}: not set, but {names['num_processes']}={num} asks for "
                         "several processes (or set distributed.process_id)")
    if not 0 <= values["process_id"] < num:
        raise ValueError(f"{names['process_id']}: process id {values['process_id']} out of range for "
                         f"{num} processes ({names['num_processes']})")
    local = _local_device_ids(env) or extra.get("local_device_ids")
    return Settings(values.get("coordinator"), num, values["process_id"], source, local)


# --- Initialisation --------------------------------------------------------------------------------

_UNSET = object()
_done: object = _UNSET  # the Settings (or None) of this process's first initialize()


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1, *, auto: bool = True,
               timeout_s: int = 300, env: Mapping[str, str] = os.environ) -> Settings | None:
    """Resolves the settings and, unless single-process, calls `jax.distributed.initialize`. Must run
    before anything touches a JAX backend. A second call is a no-op returning the first call's result."""
    global _done
    if _done is not _UNSET:
        return _done
    settings = resolve(coordinator, num_processes, process_id, auto=auto, env=env)
    if settings is not None and not jax.distributed.is_initialized():
        # Without a collectives implementation a multi-process CPU client cannot run cross-process
        # ops. The option only configures the CPU client, so setting it on GPU/TPU hosts is harmless;
        # an explicit choice (e.g. "mpi") is kept.
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if settings.source == "tpu":
            # JAX's TPU detection also reads the metadata server (multislice); pass only what a layer
            # above the cluster set and let it find the rest.
            given = {f: v[0] for f, v in _given(coordinator, num_processes, process_id, env).items()}
            jax.distributed.initialize(coordinator_address=given.get("coordinator"),
                                       num_processes=given.get("num_processes"),
                                       process_id=given.get("process_id"), initialization_timeout=int(timeout_s))
        else:
            # "deactivate": everything is decided; otherwise JAX's SLURM detection would still restrict
            # each process to the GPU at its local rank even with one process per node.
            jax.distributed.initialize(
                coordinator_address=settings.coordinator_address, num_processes=settings.num_processes,
                process_id=settings.process_id,
                local_device_ids=list(settings.local_device_ids) if settings.local_device_ids else None,
                cluster_detection_method="deactivate", initialization_timeout=int(timeout_s))
        logging.info("distributed: process %d of %d via %s, coordinator %s", settings.process_id,
                     settings.num_processes, settings.source, settings.coordinator_address or "(JAX's TPU detection)")
    _done = settings
    return settings


# --- Agreement between processes ---------------------------------------------------------------------
# Through the coordination service's key-value store, not a device collective: one of those is a program to
# trace and compile at its first use in a process, and on CPU a process other than 0 compiles it at every start
# (jaxtrain.compile_cache), while the others wait for it.

_AGREE = "jaxtrain/agree"
_AGREE_TIMEOUT_MS = 24 * 3600 * 1000  # a peer that never arrives is the watchdog's (faults.step_timeout_s)
_rounds = itertools.count()  # every process makes the same agreements, in the same order


def _client():
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return jax_distributed.global_state.client


def allgather(values) -> np.ndarray:
    """(processes, len(values)) int64: every process's `values` (as many on each), on every process. Three
    RPCs to the coordination service: a key, a barrier, the directory of the round's keys."""
    row = np.asarray(values, np.int64).reshape(-1)
    if jax.process_count() == 1:
        return row[None]
    client, n, me = _client(), next(_rounds), jax.process_index()
    client.key_value_set(f"{_AGREE}/{n}/{me}", ",".join(str(v) for v in row.tolist()))
    client.wait_at_barrier(f"jaxtrain_agree_{n}", _AGREE_TIMEOUT_MS)
    rows = dict(client.key_value_dir_get(f"{_AGREE}/{n}/"))
    if me == 0 and n:  # everyone has read round n - 1 before reaching this round's barrier
        client.key_value_delete(f"{_AGREE}/{n - 1}/")
    return np.array([[int(v) for v in rows[f"{_AGREE}/{n}/{p}"].split(",") if v]
                     for p in range(jax.process_count())], np.int64).reshape(jax.process_count(), row.size)


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process (every process gets the same answer)."""
    return bool(allgather([flag]).max())


def from_process_0(flag: bool) -> bool:
    """Process 0's `flag`, on every process."""
    return bool(allgather([flag])[0, 0])


class KeyValueStore:
    """jax.distributed's key-value store (its coordination service, on process 0's host): small strings between
    processes without the devices, e.g. step times (hooks.StragglerHook). Every call is one RPC."""

    def __init__(self):
        self._client = _client()

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def dir(self, prefix: str) -> dict[str, str]:
        """Every key under `prefix` (a directory: ends with "/"), without the prefix, and its value."""
        return {key.removeprefix(prefix): value for key, value in self._client.key_value_dir_get(prefix)}

    def delete(self, key: str) -> None:
        """The key, or with a trailing "/" every key under it."""
        self._client.key_value_delete(key)
