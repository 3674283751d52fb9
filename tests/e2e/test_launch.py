"""The launchers in scripts/launch/ on 2 and 16 nodes, without SLURM, Kubernetes, gcloud or a network.

Each launcher is run (SLURM, TPU VM) or rendered (JobSet) against fakes: an `srun` that starts its tasks
with the variables real srun sets, `scontrol`, `gcloud` and `curl` recorders, the metadata server as
files, the downward API as a dict. `python` is a recorder that writes its arguments and environment,
so nothing trains; the environment each trainer would get goes through `jaxtrain.parallel.distributed.resolve`.
"""

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jaxtrain.parallel import distributed
from jaxtrain.parallel.distributed import Settings

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "scripts" / "launch"
JOB_ID = 4242
SLURM_PORT = 61440 + JOB_ID % 4096
TRAIN = ["-m", "jaxtrain.main", "--config", "configs/tiny.py", "--config.train.steps=7"]

# `python` stand-in: one file pair per call, named so that a sort gives the calls in order; .args
# appears last (renamed into place), so a reader never sees half a call.
RECORDER = """#!/bin/bash
f="$RECORD_DIR/call.$(date +%s%N).$$"
env -0 > "$f.env"
printf '%s\\0' "$@" > "$f.tmp" && mv "$f.tmp" "$f.args"
exit "${FAKE_RC:-0}"
"""

# srun stand-in: parses the options the batch script passes, then starts every task itself with what
# real srun sets in a task (block distribution: ranks fill node 0 first).
FAKE_SRUN = """#!{python}
import json, os, signal, subprocess, sys, time
opts, argv = {{}}, sys.argv[1:]
while argv and argv[0].startswith("-"):
    key, _, value = argv.pop(0).partition("=")
    opts[key] = value
got_term = []
signal.signal(signal.SIGTERM, lambda *_: got_term.append(True))
if os.environ.get("FAKE_USR1"):  # the warning --signal=B:USR1@T sends the batch shell before the limit
    os.kill(os.getppid(), signal.SIGUSR1)
    deadline = time.time() + 10
    while not got_term and time.time() < deadline:
        time.sleep(0.01)
hosts = os.environ["FAKE_HOSTS"].split(",")[: int(opts["--nodes"])]
per_node, ntasks = int(opts["--ntasks-per-node"]), int(opts["--ntasks"])
assert ntasks == per_node * len(hosts), (ntasks, per_node, hosts)
tasks = []
for rank in range(ntasks):
    node = rank // per_node
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(node),
               SLURMD_NODENAME=hosts[node], SLURM_STEP_ID="0", SLURM_NTASKS=str(ntasks),
               SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEP_NUM_NODES=str(len(hosts)),
               SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
               SLURM_STEP_TASKS_PER_NODE=f"{{per_node}}(x{{len(hosts)}})")
    tasks.append(subprocess.Popen(argv, env=env))
codes = [t.wait() for t in tasks]
with open(os.path.join(os.environ["RECORD_DIR"], "srun.json"), "w") as f:
    json.dump({{"opts": opts, "argv": argv, "got_term": bool(got_term)}}, f)
sys.exit(max(codes))
"""

# gcloud / scontrol stand-in: records its arguments, does nothing.
ARGS_RECORDER = """#!/bin/bash
printf '%s\\0' "$@" > "$RECORD_DIR/{name}.args"
"""

METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
# curl stand-in for the metadata server: insists on the header and the URL, serves files.
FAKE_CURL = f"""#!/bin/bash
url="${{@: -1}}"
[[ " $* " == *" -H Metadata-Flavor: Google "* ]] || {{ echo "fake curl: no Metadata-Flavor header" >&2; exit 99; }}
[[ "$url" == "{METADATA}"* ]] || {{ echo "fake curl: unexpected URL $url" >&2; exit 98; }}
cat "$FAKE_METADATA/${{url#{METADATA}}}" 2>/dev/null || exit 22
"""


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def shims(tmp_path):
    """A PATH directory of fakes and the record directory they write to."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name in ("python", "python3"):
        _write(bin_dir / name, RECORDER)
    _write(bin_dir / "srun", FAKE_SRUN.format(python=sys.executable))
    _write(bin_dir / "curl", FAKE_CURL)
    for name in ("scontrol", "gcloud"):
        _write(bin_dir / name, ARGS_RECORDER.format(name=name))
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "RECORD_DIR": str(record)}
    return base, record


def _calls(record: Path) -> list[tuple[list[str], dict]]:
    """(arguments, environment) of each recorded `python` call, in order."""
    out = []
    for args_file in sorted(record.glob("call.*.args")):
        args = args_file.read_bytes().split(b"\0")[:-1]
        env = args_file.with_suffix(".env").read_bytes().split(b"\0")[:-1]
        out.append(([a.decode() for a in args], dict(e.decode().partition("=")[::2] for e in env)))
    return out


def _nul_args(path: Path) -> list[str]:
    return [a.decode() for a in path.read_bytes().split(b"\0")[:-1]]


# --- SLURM -----------------------------------------------------------------------------------------

def _sbatch_options(path: Path) -> dict[str, str]:
    """The #SBATCH lines (not the ##SBATCH ones, commented out) as {option: value}."""
    opts = {}
    for line in path.read_text().splitlines():
        if m := re.match(r"#SBATCH\s+(--[\w-]+)(?:=(\S+))?", line):
            opts[m.group(1)] = m.group(2) or ""
    return opts


def _run_sbatch(shims, nodes, args=(), **env):
    """Runs slurm.sbatch as sbatch would start it on the first of `nodes` nodes gpu001..."""
    base, record = shims
    hosts = [f"gpu{i:03d}" for i in range(1, nodes + 1)]
    batch_env = {**base, "FAKE_HOSTS": ",".join(hosts), "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NAME": "jaxtrain",
                 "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(nodes),
                 "SLURM_JOB_NODELIST": f"gpu[001-{nodes:03d}]", "SLURM_SUBMIT_DIR": str(REPO),
                 "SLURM_CPUS_ON_NODE": "64", **env}
    proc = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), *args], env=batch_env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    srun = json.loads((record / "srun.json").read_text()) if (record / "srun.json").exists() else None
    return proc, srun, _calls(record)


def test_sbatch_header():
    opts = _sbatch_options(LAUNCH / "slurm.sbatch")
    assert opts["--nodes"] == "2"
    assert opts["--signal"] == "B:USR1@180"  # the batch shell gets the warning, and forwards SIGTERM
    assert "--requeue" in opts and opts["--open-mode"] == "append" and "%j" in opts["--output"]
    assert "--ntasks-per-node" not in opts and "--gpus-per-node" not in opts  # decided in the script


@pytest.mark.parametrize("nodes", [2, 16])
def test_slurm_one_process_per_node(shims, nodes):
    if nodes == 2:  # plain `sbatch slurm.sbatch`: the #SBATCH default, config and flags from the env
        assert _sbatch_options(LAUNCH / "slurm.sbatch")["--nodes"] == str(nodes)
        args, env = (), {"CONFIG": "configs/tiny.py", "ARGS": "--config.train.steps=7"}
    else:  # `sbatch --nodes=16 slurm.sbatch CONFIG FLAGS...`
        args, env = ("configs/tiny.py", "--config.train.steps=7"), {}
    # A stale count in the submitting shell must not reach the tasks (env beats cluster detection).
    proc, srun, calls = _run_sbatch(shims, nodes, args, WORKDIR="/shared/runs/t", JAXTRAIN_NUM_PROCESSES="99",
                                    JAXTRAIN_PROCESS_ID="0", **env)
    assert proc.returncode == 0, proc.stderr
    assert srun["opts"] == {"--nodes": str(nodes), "--ntasks": str(nodes), "--ntasks-per-node": "1",
                            "--kill-on-bad-exit": "0", "--cpus-per-task": "64"}
    assert len(calls) == nodes
    seen = set()
    for argv, env in calls:
        assert argv == [*TRAIN, "--config.workdir=/shared/runs/t"]
        assert "JAXTRAIN_NUM_PROCESSES" not in env and "JAXTRAIN_PROCESS_ID" not in env
        s = distributed.resolve(env=env)
        assert s == Settings(f"gpu001:{SLURM_PORT}", nodes, int(env["SLURM_PROCID"]), "slurm", None)
        seen.add(s.process_id)
    assert seen == set(range(nodes))


@pytest.mark.parametrize("nodes,gpus", [(2, 8), (16, 2)])
def test_slurm_one_process_per_gpu(shims, nodes, gpus):
    proc, srun, calls = _run_sbatch(shims, nodes, ("configs/tiny.py", "--config.train.steps=7"),
                                    PROCS_PER_NODE="gpu", SLURM_GPUS_ON_NODE=str(gpus))
    assert proc.returncode == 0, proc.stderr
    assert srun["opts"]["--ntasks"] == str(nodes * gpus) and srun["opts"]["--ntasks-per-node"] == str(gpus)
    assert srun["opts"]["--cpus-per-task"] == str(64 // gpus)
    assert len(calls) == nodes * gpus
    by_rank = {}
    for argv, env in calls:
        assert argv == TRAIN
        s = distributed.resolve(env=env)
        rank = int(env["SLURM_PROCID"])
        # Each task keeps the GPU at its local rank; node = rank // gpus.
        assert s == Settings(f"gpu001:{SLURM_PORT}", nodes * gpus, rank, "slurm", (rank % gpus,))
        assert env["SLURMD_NODENAME"] == f"gpu{rank // gpus + 1:03d}"
        by_rank[rank] = s
    assert sorted(by_rank) == list(range(nodes * gpus))


def test_slurm_gpu_mode_needs_a_gpu_count(shims):
    proc, srun, calls = _run_sbatch(shims, 2, PROCS_PER_NODE="gpu")
    assert proc.returncode == 2 and "GPU count per node is unknown" in proc.stderr
    assert srun is None and not calls


@pytest.mark.parametrize("case,env,requeued", [
    ("time limit", {"FAKE_USR1": "1"}, True),
    ("time limit, requeues used up", {"FAKE_USR1": "1", "SLURM_RESTART_COUNT": "50"}, False),
    ("time limit, REQUEUE=0", {"FAKE_USR1": "1", "REQUEUE": "0"}, False),
    ("SIGTERM from elsewhere", {}, False),
])
def test_slurm_exit_75_requeues_only_after_the_time_limit_warning(shims, case, env, requeued):
    # Every trainer "saved and exited 75"; only our own USR1 (the time limit) means requeue.
    proc, srun, calls = _run_sbatch(shims, 2, FAKE_RC="75", **env)
    record = shims[1]
    assert proc.returncode == 75, proc.stderr
    assert len(calls) == 2
    assert srun["got_term"] == ("FAKE_USR1" in env)  # USR1 became a SIGTERM to srun, forwarded to the tasks
    if requeued:
        assert _nul_args(record / "scontrol.args") == ["requeue", str(JOB_ID)]
    else:
        assert not (record / "scontrol.args").exists()


def test_slurm_outside_a_job_says_so(shims):
    proc = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch")], env=shims[0], capture_output=True, text=True)
    assert proc.returncode == 2 and "submit it with sbatch" in proc.stderr


# --- Kubernetes JobSet -----------------------------------------------------------------------------

ANNOTATIONS = {
    "JOBSET_NAME": "jobset.sigs.k8s.io/jobset-name",
    "REPLICATED_JOB_NAME": "jobset.sigs.k8s.io/replicatedjob-name",
    "JOB_INDEX": "jobset.sigs.k8s.io/job-index",
    "REPLICATED_JOB_REPLICAS": "jobset.sigs.k8s.io/replicatedjob-replicas",
    "JOB_COMPLETION_INDEX": "batch.kubernetes.io/job-completion-index",
}


def _renderer():
    spec = importlib.util.spec_from_file_location("render_jobset", LAUNCH / "render_jobset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render(capsys, *argv) -> dict:
    """Runs the renderer's CLI and parses what it prints, as `kubectl apply -f -` would."""
    assert _renderer().main(list(argv)) == 0
    return yaml.safe_load(capsys.readouterr().out)


def _parts(doc):
    (rjob,) = doc["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    pod = job["template"]["spec"]
    (box,) = pod["containers"]
    return rjob, job, pod, box


def _pod_env(box, annotations: dict) -> dict:
    """The container's environment as the kubelet would fill it: values, and fieldRefs to annotations."""
    env = {}
    for e in box["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            key = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path).group(1)
            env[e["name"]] = annotations[key]
    return env


def _annotations(name, rjob, job_index, replicas, pod_index) -> dict:
    """What the JobSet controller (and the Job controller, for the index) puts on a pod."""
    return {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": rjob,
            "jobset.sigs.k8s.io/job-index": str(job_index), "jobset.sigs.k8s.io/replicatedjob-replicas": str(replicas),
            "batch.kubernetes.io/job-completion-index": str(pod_index)}


def test_jobset_template_is_consistent():
    doc = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())
    rjob, job, pod, box = _parts(doc)
    env = {e["name"]: e for e in box["env"]}
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert env["JAXTRAIN_NUM_PROCESSES"]["value"] == str(job["parallelism"] * rjob["replicas"])
    assert job["parallelism"] == job["completions"]


@pytest.mark.parametrize("nodes", [2, 16])
def test_jobset_gpu(capsys, nodes):
    name = "llm"
    doc = _render(capsys, "--nodes", str(nodes), "--image", "reg/jaxtrain:1", "--config", "configs/tiny.py",
                  "--name", name, "--gpus-per-node", "8", "--", "--config.train.steps=7")
    rjob, job, pod, box = _parts(doc)
    assert doc["metadata"]["name"] == name and rjob["replicas"] == 1
    assert job["parallelism"] == job["completions"] == nodes and job["completionMode"] == "Indexed"
    assert box["image"] == "reg/jaxtrain:1"
    assert box["command"] == ["python", *TRAIN[:4], f"--config.workdir=/workdir/{name}", *TRAIN[4:]]
    assert box["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert {m["mountPath"] for m in box["volumeMounts"]} == {"/workdir"}

    # Exactly the downward-API mappings jaxtrain reads, plus the count Kubernetes never tells a pod.
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in box["env"] if "valueFrom" in e}
    assert refs == {k: f"metadata.annotations['{v}']" for k, v in ANNOTATIONS.items()}
    assert {e["name"]: e["value"] for e in box["env"] if "value" in e} == {"JAXTRAIN_NUM_PROCESSES": str(nodes)}

    # Exit 75 (saved on SIGTERM) restarts every pod without using up maxRestarts.
    job_rules = job["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": box["name"], "operator": "In", "values": [75]}} \
        in job_rules
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    (rule,) = doc["spec"]["failurePolicy"]["rules"]
    assert rule["action"] == "RestartJobSetAndIgnoreMaxRestarts" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]

    # The coordinator jaxtrain derives is pod 0's DNS name: <jobset>-<rjob>-<job>-<pod>.<subdomain>.
    network = doc["spec"]["network"]
    assert network["enableDNSHostnames"] is True and network.get("subdomain", name) == name
    pod0 = f"{name}-{rjob['name']}-0-0.{network.get('subdomain', name)}"
    for index in sorted({0, 1, nodes - 1}):
        env = _pod_env(box, _annotations(name, rjob["name"], 0, rjob["replicas"], index))
        assert distributed.resolve(env=env) == Settings(f"{pod0}:8476", nodes, index, "kubernetes")


@pytest.mark.parametrize("nodes,topology", [(2, "2x2x2"), (16, "4x4x4")])
def test_jobset_tpu(capsys, nodes, topology):
    doc = _render(capsys, "--nodes", str(nodes), "--image", "img", "--tpu-topology", topology)
    rjob, job, pod, box = _parts(doc)
    assert job["parallelism"] == nodes
    assert box["resources"]["limits"] == {"google.com/tpu": 4}  # v5p: 4 chips per host
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": topology}
    # GKE injects the TPU variables into TPU pods; jaxtrain then prefers them and lets JAX find the
    # coordinator, with the JobSet's count.
    hosts = ",".join(f"jaxtrain-trainer-0-{i}.jaxtrain" for i in range(nodes))
    for index in (0, nodes - 1):
        env = _pod_env(box, _annotations("jaxtrain", rjob["name"], 0, 1, index))
        env.update(TPU_WORKER_HOSTNAMES=hosts, TPU_WORKER_ID=str(index))
        assert distributed.resolve(env=env) == Settings(None, nodes, index, "tpu")


def test_jobset_cpu_pods_and_bad_sizes(capsys):
    _, _, pod, box = _parts(_render(capsys, "--nodes", "2", "--image", "img", "--gpus-per-node", "0"))
    assert "resources" not in box and "nodeSelector" not in pod
    with pytest.raises(SystemExit):
        _renderer().render(["--nodes", "3", "--image", "img", "--tpu-topology", "2x2x2"])  # 8 chips / 3
    with pytest.raises(SystemExit):
        _renderer().render(["--nodes", "2", "--image", "img", "--name", "x" * 60])  # hostname > 63 chars
    assert "do not split evenly" in capsys.readouterr().err


# --- Cloud TPU VM ----------------------------------------------------------------------------------

def _metadata(directory: Path, worker: int, endpoints: str, tpu_env: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "agent-worker-number").write_text(str(worker))
    (directory / "worker-network-endpoints").write_text(endpoints)
    (directory / "tpu-env").write_text(tpu_env or "ACCELERATOR_TYPE: 'v5p-32'\nWORKER_ID: '%d'\n" % worker)
    return directory


@pytest.fixture
def checkout(tmp_path):
    """The jaxtrain checkout on a worker: this repo's scripts, logs kept out of the repo."""
    path = tmp_path / "checkout"
    path.mkdir()
    (path / "scripts").symlink_to(REPO / "scripts")
    return path


def _launch_tpu(shims, args, **env) -> str:
    """Runs tpu_vm.sh on "your machine"; returns the command gcloud would run on every worker."""
    base, record = shims
    proc = subprocess.run(["bash", str(LAUNCH / "tpu_vm.sh"), *args], env={**base, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    gcloud = _nul_args(record / "gcloud.args")
    assert gcloud[:4] == ["compute", "tpus", "tpu-vm", "ssh"]
    assert gcloud[4:8] == ["t1", "--zone=us-east5-a", "--project=proj", "--worker=all"]
    assert gcloud[-1].startswith("--command=")
    return gcloud[-1].removeprefix("--command=")


def _on_worker(shims, command, metadata: Path, **env):
    """Runs the per-worker command as the worker's login shell would (in this checkout)."""
    base, record = shims
    for f in record.glob("call.*"):
        f.unlink()
    proc = subprocess.run(["bash", "-c", command], env={**base, "FAKE_METADATA": str(metadata), **env},
                          cwd=base["HOME"], capture_output=True, text=True, timeout=30)
    return proc, _calls(record)


@pytest.mark.parametrize("workers", [2, 16])
def test_tpu_vm(shims, checkout, tmp_path, workers):
    if workers == 2:  # the new format: hostnames
        addresses = [f"t1v-n-abc-w-{i}" for i in range(workers)]
        endpoints = ",".join(addresses)
    else:  # the old format: name:id:ip
        addresses = [f"10.0.0.{i + 2}" for i in range(workers)]
        endpoints = ",".join(f"w{i}:{i}:{ip}" for i, ip in enumerate(addresses))
    command = _launch_tpu(shims, ["configs/tiny.py", "--config.train.steps=7", "--config.note=two words"],
                          TPU_NAME="t1", ZONE="us-east5-a", PROJECT="proj", REMOTE_DIR=str(checkout),
                          WORKDIR="/mnt/shared/run 1", INSTALL="1" if workers == 16 else "")
    assert command.startswith(f"cd {checkout} && ")
    for worker in (0, workers - 1):
        proc, calls = _on_worker(shims, command, _metadata(tmp_path / f"md{worker}", worker, endpoints))
        assert proc.returncode == 0, proc.stderr
        if workers == 16:  # INSTALL=1: jax[tpu] and the checkout first
            assert [c[0][:3] for c in calls[:2]] == [["-m", "pip", "install"]] * 2
            calls = calls[2:]
        ((argv, env),) = calls
        assert argv == [*TRAIN, "--config.note=two words", "--config.workdir=/mnt/shared/run 1"]
        assert env["TPU_WORKER_ID"] == str(worker) and env["TPU_WORKER_HOSTNAMES"] == ",".join(addresses)
        assert "MEGASCALE_NUM_SLICES" not in env
        assert distributed.resolve(env=env) == Settings(None, workers, worker, "tpu")


def test_tpu_vm_multislice_detach_and_clone(shims, checkout, tmp_path):
    command = _launch_tpu(shims, [], TPU_NAME="t1", ZONE="us-east5-a", PROJECT="proj", REMOTE_DIR=str(checkout),
                          REPO_URL="https://example.com/jaxtrain.git", DETACH="1",
                          ARGS="--config.train.steps=7", CONFIG="configs/tiny.py")
    assert "git clone" in command and command.index("git clone") < command.index(f"cd {checkout}")
    tpu_env = "MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\nMEGASCALE_COORDINATOR_ADDRESS: '10.9.0.2'\n"
    proc, _ = _on_worker(shims, command, _metadata(tmp_path / "md", 1, "h0,h1", tpu_env))
    assert proc.returncode == 0, proc.stderr
    for _ in range(500):  # the detached trainer records itself a moment later
        if calls := _calls(shims[1]):
            break
        time.sleep(0.01)
    ((argv, env),) = calls
    assert argv == TRAIN and (checkout / "logs" / "jaxtrain-worker-1.log").exists()
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "10.9.0.2"
    # Slice-major numbering, 2 hosts x 2 slices: worker 1 of slice 1 is process 3 of 4.
    assert distributed.resolve(env=env) == Settings(None, 4, 3, "tpu")


def test_tpu_vm_needs_a_name(shims):
    proc = subprocess.run(["bash", str(LAUNCH / "tpu_vm.sh")], env=shims[0], capture_output=True, text=True)
    assert proc.returncode != 0 and "TPU_NAME" in proc.stderr
