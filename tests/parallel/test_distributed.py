"""Multi-process start-up: `resolve` on each path (explicit, JAXTRAIN_* env, SLURM, Kubernetes Indexed Job
and JobSet, TPU) with fake environments, every error it names, the arguments `initialize` hands to JAX,
and one real run of 2 local processes x 4 CPU devices that sums a global array across both."""

import os
from pathlib import Path
import socket
import subprocess
import sys
import textwrap
import time

import jax
import pytest

from helpers import cpu_flags
from jaxtrain.parallel import distributed
from jaxtrain.parallel.distributed import Settings

REPO = str(Path(__file__).resolve().parents[2])
SLURM_PORT = 61440 + 4242 % 4096  # job id 4242
ENV3 = {"JAXTRAIN_COORDINATOR": "10.0.0.9:999", "JAXTRAIN_NUM_PROCESSES": "3", "JAXTRAIN_PROCESS_ID": "2"}
SLURM2 = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
          "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu[003-004]", "SLURM_JOB_NODELIST": "gpu[003-004]"}
# 16 tasks on 2 nodes (8 per node); this is task 11, the fourth on the second node.
SLURM16 = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "11", "SLURM_LOCALID": "3", "SLURM_NTASKS": "16",
           "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NODELIST": "node[09-10]"}
JOB = {"JOB_COMPLETION_INDEX": "3", "HOSTNAME": "train-3"}
JOBSET = {"JOBSET_NAME": "llm", "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "2",
          "HOSTNAME": "llm-workers-0-2"}
TPU4 = {"TPU_WORKER_HOSTNAMES": "t1v-w-0,t1v-w-1,t1v-w-2,t1v-w-3", "TPU_WORKER_ID": "2"}

RESOLVED = {
    "nothing": ({}, {}, None),
    "unrelated env": ({"HOME": "/root", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, {}, None),
    "explicit": ({}, {"coordinator": "10.0.0.1:1234", "num_processes": 4, "process_id": 2},
                 Settings("10.0.0.1:1234", 4, 2, "config")),
    "explicit beats env": (ENV3, {"coordinator": "h:1", "num_processes": 2, "process_id": 0},
                           Settings("h:1", 2, 0, "config")),
    "explicit single process": (ENV3, {"num_processes": 1}, None),
    "env": (ENV3, {}, Settings("10.0.0.9:999", 3, 2, "env")),
    "env beats cluster": ({**ENV3, **SLURM16, **TPU4}, {}, Settings("10.0.0.9:999", 3, 2, "env")),
    "config + env per field": ({"JAXTRAIN_PROCESS_ID": "1"}, {"coordinator": "[::1]:80", "num_processes": 2},
                               Settings("[::1]:80", 2, 1, "env")),
    "env count 1": ({"JAXTRAIN_NUM_PROCESSES": "1"}, {}, None),
    "slurm 2 tasks, 1 per node": (SLURM2, {}, Settings(f"gpu003:{SLURM_PORT}", 2, 1, "slurm")),
    "slurm compressed nodelist": ({**SLURM2, "SLURM_STEP_NODELIST": "gpu[003-005,009],cpu01"}, {},
                                  Settings(f"gpu003:{SLURM_PORT}", 2, 1, "slurm")),
    "slurm job nodelist fallback": ({**SLURM2, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": "a1,a2"}, {},
                                    Settings(f"a1:{SLURM_PORT}", 2, 1, "slurm")),
    "slurm 16 tasks, 8 per node": (SLURM16, {}, Settings(f"node09:{SLURM_PORT}", 16, 11, "slurm", (3,))),
    "slurm gpus per task": ({**SLURM16, "SLURM_GPUS_PER_TASK": "1"}, {},
                            Settings(f"node09:{SLURM_PORT}", 16, 11, "slurm")),
    "slurm JAX_LOCAL_DEVICE_IDS": ({**SLURM16, "JAX_LOCAL_DEVICE_IDS": "0,1"}, {},
                                   Settings(f"node09:{SLURM_PORT}", 16, 11, "slurm", (0, 1))),
    "slurm port override": ({**SLURM2, "JAXTRAIN_COORDINATOR_PORT": "1234"}, {},
                            Settings("gpu003:1234", 2, 1, "slurm")),
    "slurm step count, not job count": ({**SLURM2, "SLURM_NTASKS": "16"}, {},
                                        Settings(f"gpu003:{SLURM_PORT}", 2, 1, "slurm")),
    "slurm + config coordinator": (SLURM2, {"coordinator": "head:5"}, Settings("head:5", 2, 1, "slurm")),
    "slurm single task": ({**SLURM2, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, {}, None),
    "slurm allocation shell": ({k: v for k, v in SLURM16.items() if k not in ("SLURM_PROCID", "SLURM_LOCALID")},
                               {}, None),
    "slurm batch script (no srun)": ({k: v for k, v in SLURM16.items() if not k.startswith("SLURM_STEP")}, {}, None),
    "slurm, auto off": (SLURM16, {"auto": False}, None),
    "indexed job": ({**JOB, "JAXTRAIN_NUM_PROCESSES": "4", "JAXTRAIN_COORDINATOR": "train-0.workers:8476"}, {},
                    Settings("train-0.workers:8476", 4, 3, "kubernetes")),
    "indexed job, independent pods": ({**JOB, "JAXTRAIN_NUM_PROCESSES": "1"}, {}, None),
    "jobset": ({**JOBSET, "JAXTRAIN_NUM_PROCESSES": "4"}, {}, Settings("llm-workers-0-0.llm:8476", 4, 2, "kubernetes")),
    "jobset, second job": ({**JOBSET, "JOB_INDEX": "1", "REPLICATED_JOB_REPLICAS": "2", "JOB_COMPLETION_INDEX": "3",
                            "JAXTRAIN_NUM_PROCESSES": "8", "JAXTRAIN_COORDINATOR_PORT": "9000"}, {},
                           Settings("llm-workers-0-0.llm:9000", 8, 7, "kubernetes")),
    "jobset, count from config": (JOBSET, {"coordinator": "c:1", "num_processes": 4},
                                  Settings("c:1", 4, 2, "kubernetes")),
    "tpu multi-host": (TPU4, {}, Settings(None, 4, 2, "tpu")),
    "tpu process addresses win": ({**TPU4, "TPU_PROCESS_ADDRESSES": "a:8471,b:8471", "TPU_WORKER_ID": "1"}, {},
                                  Settings(None, 2, 1, "tpu")),
    "tpu multislice": ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "2",
                        "MEGASCALE_SLICE_ID": "1"}, {}, Settings(None, 4, 3, "tpu")),
    "tpu single host": ({"TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}, {}, None),
    "tpu on a gke jobset": ({**TPU4, **JOBSET}, {}, Settings(None, 4, 2, "tpu")),
}


@pytest.mark.parametrize("name", RESOLVED)
def test_resolve(name):
    env, kwargs, expected = RESOLVED[name]
    assert distributed.resolve(**kwargs, env=env) == expected


ERRORS = {
    "env count without coordinator": ({"JAXTRAIN_NUM_PROCESSES": "2"}, {}, "JAXTRAIN_COORDINATOR: not set"),
    "env coordinator alone": ({"JAXTRAIN_COORDINATOR": "h:1"}, {}, "JAXTRAIN_NUM_PROCESSES: not set"),
    "env process id alone": ({"JAXTRAIN_PROCESS_ID": "0"}, {}, "JAXTRAIN_NUM_PROCESSES: not set"),
    "env without process id": ({"JAXTRAIN_COORDINATOR": "h:1", "JAXTRAIN_NUM_PROCESSES": "2"}, {},
                               "JAXTRAIN_PROCESS_ID: not set"),
    "env process id out of range": ({**ENV3, "JAXTRAIN_PROCESS_ID": "3"}, {}, "JAXTRAIN_PROCESS_ID: process id 3 out"),
    "config id vs env count": ({**ENV3}, {"process_id": 5}, "distributed.process_id: process id 5 out of range"),
    "env count not a number": ({**ENV3, "JAXTRAIN_NUM_PROCESSES": "two"}, {}, "JAXTRAIN_NUM_PROCESSES: expected an"),
    "env count zero": ({**ENV3, "JAXTRAIN_NUM_PROCESSES": "0"}, {}, "JAXTRAIN_NUM_PROCESSES: must be >= 1"),
    "env negative id": ({**ENV3, "JAXTRAIN_PROCESS_ID": "-1"}, {}, "JAXTRAIN_PROCESS_ID: must be >= 0"),
    "env coordinator without port": ({**ENV3, "JAXTRAIN_COORDINATOR": "10.0.0.9"}, {},
                                     "JAXTRAIN_COORDINATOR: expected host:port"),
    "slurm port out of range": ({**SLURM2, "JAXTRAIN_COORDINATOR_PORT": "70000"}, {},
                                "JAXTRAIN_COORDINATOR_PORT: must be <= 65535"),
    "slurm without nodelist": ({**SLURM2, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, {},
                               "SLURM_STEP_NODELIST: not set"),
    "slurm bad nodelist": ({**SLURM2, "SLURM_STEP_NODELIST": "gpu[003-"}, {}, "SLURM_STEP_NODELIST: unbalanced"),
    "slurm bad range": ({**SLURM2, "SLURM_STEP_NODELIST": "gpu[a-b]"}, {}, "SLURM_STEP_NODELIST: bad range"),
    "slurm bad task count": ({**SLURM16, "SLURM_STEP_NUM_TASKS": "0"}, {}, "SLURM_STEP_NUM_TASKS: must be >= 1"),
    "slurm bad local ids": ({**SLURM16, "JAX_LOCAL_DEVICE_IDS": "gpu0"}, {}, "JAX_LOCAL_DEVICE_IDS: expected"),
    "indexed job without count": (JOB, {}, "JAXTRAIN_NUM_PROCESSES: required on Kubernetes (Indexed Job pod train-3"),
    "indexed job without coordinator": ({**JOB, "JAXTRAIN_NUM_PROCESSES": "4"}, {},
                                        ("JAXTRAIN_COORDINATOR: not set, but JAXTRAIN_NUM_PROCESSES=4 asks for several "
                                         "processes (or set distributed.coordinator); on an Indexed Job use "
                                         "train-0.<headless service>:8476")),
    "jobset without count": (JOBSET, {}, "JAXTRAIN_NUM_PROCESSES: required on Kubernetes (JobSet 'llm' detected"),
    "jobset without replicated job name": ({**JOBSET, "REPLICATED_JOB_NAME": "", "JAXTRAIN_NUM_PROCESSES": "4"}, {},
                                           "REPLICATED_JOB_NAME: not set"),
    "jobset without job index": ({**JOBSET, "JOB_INDEX": "", "JAXTRAIN_NUM_PROCESSES": "4"}, {}, "JOB_INDEX: not set"),
    "jobset second job without replicas": ({**JOBSET, "JOB_INDEX": "1", "JAXTRAIN_NUM_PROCESSES": "4"}, {},
                                           "REPLICATED_JOB_REPLICAS: not set"),
    "jobset replicas do not divide": ({**JOBSET, "JOB_INDEX": "1", "REPLICATED_JOB_REPLICAS": "3",
                                       "JAXTRAIN_NUM_PROCESSES": "4"}, {}, "REPLICATED_JOB_REPLICAS: 3 does not fit"),
    "jobset, auto off": ({**JOBSET, "JAXTRAIN_NUM_PROCESSES": "4"}, {"auto": False}, "JAXTRAIN_COORDINATOR: not set"),
    "tpu without worker id": ({**TPU4, "TPU_WORKER_ID": ""}, {}, "TPU_WORKER_ID: not set"),
    "tpu worker id out of range": ({**TPU4, "TPU_WORKER_ID": "4"}, {}, "TPU_WORKER_ID: 4 (slice 0) out of range"),
    "tpu process addresses win": ({**TPU4, "TPU_PROCESS_ADDRESSES": "a:8471,b:8471"}, {},
                                  "TPU_WORKER_ID: 2 (slice 0) out of range for 2 hosts"),
    "config coordinator without count": ({}, {"coordinator": "h:1"}, ("JAXTRAIN_NUM_PROCESSES: not set, but "
                                         "distributed.coordinator is")),
}


@pytest.mark.parametrize("name", ERRORS)
def test_resolve_errors(name):
    env, kwargs, message = ERRORS[name]
    with pytest.raises(ValueError) as e:
        distributed.resolve(**kwargs, env=env)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


CHECK_ERRORS = {
    ("", 2, 0): "distributed.coordinator: required when distributed.num_processes=2 > 1",
    ("h:1", 2, 2): "distributed.process_id: must be < num_processes=2, got 2",
    ("host", 0, -1): "distributed.coordinator: expected host:port, got 'host'",
    ("host:", 0, -1): "distributed.coordinator: expected host:port",
    (":80", 0, -1): "distributed.coordinator: expected host:port",
    ("host:0", 0, -1): "distributed.coordinator: port must be in 1..65535",
    ("grpc://h:1", 0, -1): "distributed.coordinator: expected host:port without a scheme",
    ("", -1, -1): "distributed.num_processes: must be >= 0",
    ("", 0, -2): "distributed.process_id: must be >= -1",
}


@pytest.mark.parametrize("args", CHECK_ERRORS)
def test_check_errors(args):
    with pytest.raises(ValueError, match="^" + CHECK_ERRORS[args].replace(".", r"\.")):
        distributed.check(*args)
    with pytest.raises(ValueError):  # resolve validates its explicit arguments the same way
        distributed.resolve(*args, env={})


@pytest.mark.parametrize("args", [("", 0, -1), ("[::1]:1234", 2, 1), ("h:1", 0, 5), ("", 1, 0), ("", 0, 3)])
def test_check_accepts(args):
    distributed.check(*args)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("gpu[003-005,009],cpu01", ["gpu003", "gpu004", "gpu005", "gpu009", "cpu01"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("a[1-2]-ib[0-1],b", ["a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1", "b"]),
    ("", []),
])
def test_expand_nodelist(nodelist, hosts):
    assert distributed.expand_nodelist(nodelist) == hosts


@pytest.fixture
def fake_jax(monkeypatch):
    """Records jax.distributed.initialize calls instead of starting a runtime; resets the once-only state."""
    calls = []
    monkeypatch.setattr(distributed, "_done", distributed._UNSET)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    return calls


def test_initialize_single_process_touches_nothing(fake_jax):
    assert distributed.initialize(env={}) is None
    assert fake_jax == []


def test_initialize_passes_everything_and_disables_jax_detection(fake_jax):
    s = distributed.initialize(timeout_s=7, env=SLURM16)
    assert fake_jax == [{"coordinator_address": f"node09:{SLURM_PORT}", "num_processes": 16, "process_id": 11,
                         "local_device_ids": [3], "cluster_detection_method": "deactivate",
                         "initialization_timeout": 7}]
    # Once per process: later calls (even with other arguments) return the first result.
    assert distributed.initialize(env=ENV3) is s
    assert len(fake_jax) == 1


def test_initialize_tpu_leaves_detection_to_jax(fake_jax):
    assert distributed.initialize(env=TPU4).source == "tpu"
    assert fake_jax == [{"coordinator_address": None, "num_processes": None, "process_id": None,
                         "initialization_timeout": 300}]


def test_initialize_sets_cpu_collectives_when_unset(fake_jax):
    before = jax.config.jax_cpu_collectives_implementation
    jax.config.update("jax_cpu_collectives_implementation", None)
    try:
        distributed.initialize(env=ENV3)
        assert jax.config.jax_cpu_collectives_implementation == "gloo"
    finally:
        jax.config.update("jax_cpu_collectives_implementation", before)


# --- Two real processes ----------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxtrain.parallel import distributed

    s = distributed.initialize()
    assert distributed.initialize() is s and s.source == "env", s
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices())
    sharding = NamedSharding(mesh, P("data"))
    # Each process holds its own 4 rows of the global [0, 1, ..., 7]; a wrong layout changes the sum of squares.
    local = np.arange(4, dtype=np.float32) + 4 * jax.process_index()
    x = jax.make_array_from_process_local_data(sharding, local, (8,))
    total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(mesh, P()))(x)
    print("RESULT", jax.process_index(), float(total), flush=True)

    # Agreement through the coordination service: every process gets every row, in process order.
    p = jax.process_index()
    for i in range(3):
        assert distributed.allgather([p, 10 * i]).tolist() == [[0, 10 * i], [1, 10 * i]]
    assert distributed.allgather([]).shape == (2, 0)
    assert distributed.any_process(p == 1) and not distributed.from_process_0(p == 1)
    # Process 0 deletes each round's keys once everyone has read them: only the newest round's are left.
    print("AGREE", p, sorted(distributed.KeyValueStore().dir("jaxtrain/agree/")), flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_sum_a_global_array():
    port = _free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("JAXTRAIN_", "SLURM_", "TPU_", "MEGASCALE_", "JOB", "REPLICATED_JOB", "JAX_"))}
    base.update(XLA_FLAGS=cpu_flags(4), JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
                JAXTRAIN_COORDINATOR=f"127.0.0.1:{port}", JAXTRAIN_NUM_PROCESSES="2")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], cwd=REPO, env={**base, "JAXTRAIN_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-3000:]}"
        assert f"RESULT {i} 140.0" in out, out[-3000:]  # sum of squares of 0..7
    assert "AGREE 0 ['5/0', '5/1']" in outputs[0], outputs[0][-3000:]  # rounds 0..5
