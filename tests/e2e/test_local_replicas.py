"""Node-local checkpoints (`checkpoint.local_mode=node`) on two processes (gloo, 2 CPU devices each).

A process that comes back with an empty local dir (a replaced machine) gets its shards from its peer's replica
and reads nothing from the persistent tier; a flipped bit in one process's copy is found, that copy is taken
from the peer and the damaged one is moved aside. In-process tests cover the fallback to the persistent tier
and the config checks. Each process gets a local_dir of its own (`<local>/node<i>`), as on two machines: one
they share is refused (exit 2 naming checkpoint.local_dir).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from helpers import cpu_flags, read_jsonl
from jaxtrain import checkpoint, checkpoint_local
from jaxtrain.errors import ConfigError
from test_multihost import finish, free_port, wait_for_step

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
# The worker, with every read of an Orbax checkpoint directory (the persistent tier) written to reads.<process>.
WORKER = """
import os, sys
sys.path.insert(0, {tests!r})
import multihost_worker
from jaxtrain import checkpoint

load = checkpoint._Dir.load
def counted(self, step, *args, **kwargs):
    with open(os.path.join({out!r}, "reads." + os.environ["JAXTRAIN_PROCESS_ID"]), "a") as f:
        f.write(f"{{self.path}} {{step}}\\n")
    return load(self, step, *args, **kwargs)
checkpoint._Dir.load = counted
sys.exit(multihost_worker.main(*sys.argv[1:3]))
"""


def node_config(tiny_config, tmp_path, across: str, **overrides):
    """Two processes x 2 devices, `across` ("fsdp" or "data") spanning the processes, the other inside each."""
    return tiny_config(**{
        "train.steps": STEPS, "eval.every_steps": 0, "eval.at_start": False, "mesh.data": 2, "mesh.fsdp": 2,
        f"mesh.dcn_{across}": 2, "checkpoint.every_steps": 4, "checkpoint.local_dir": str(tmp_path / "local"),
        "checkpoint.local_every_steps": 1, "checkpoint.local_mode": "node", **overrides})


def start(config, tmp_path, name, shared_local=False, **extra_env):
    """The two processes; each with its own local_dir `<local_dir>/node<i>` unless `shared_local`."""
    for i in range(2):
        own = ConfigDict(config.to_dict())
        if not shared_local:
            own.checkpoint.local_dir = f"{config.checkpoint.local_dir}/node{i}"
        (tmp_path / f"{name}.{i}.json").write_text(own.to_json())
    (tmp_path / "worker.py").write_text(WORKER.format(tests=str(REPO / "tests"), out=str(tmp_path)))
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, str(tmp_path / "worker.py"), str(tmp_path / f"{name}.{i}.json"),
         str(tmp_path / f"{name}.npz")],
        env={**os.environ, **extra_env, "XLA_FLAGS": cpu_flags(2),
             "JAX_PLATFORMS": "cpu", "JAXTRAIN_COORDINATOR": f"127.0.0.1:{port}", "JAXTRAIN_NUM_PROCESSES": "2",
             "JAXTRAIN_PROCESS_ID": str(i), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]


def run(config, tmp_path, name):
    codes, outputs = finish(start(config, tmp_path, name), timeout=240)
    assert codes == [0, 0], "\n".join(f"--- process {i} exited {c}:\n{o[-3000:]}" for i, (c, o) in
                                      enumerate(zip(codes, outputs)))
    return outputs


def summary(config):
    return json.loads((Path(config.workdir) / "summary.json").read_text())


def last_restore(config):
    return [r for r in read_jsonl(Path(config.workdir) / "goodput.jsonl") if r.get("event") == "phases"][-1]


def persistent_reads(tmp_path):
    return [line for p in (0, 1) if (tmp_path / f"reads.{p}").exists()
            for line in (tmp_path / f"reads.{p}").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tiny_config, tmp_path_factory):
    """The state checksum of an uninterrupted run with fsdp across the processes."""
    tmp_path = tmp_path_factory.mktemp("reference")
    config = node_config(tiny_config, tmp_path, "fsdp")
    run(config, tmp_path, "reference")
    return summary(config)["state_checksum"]


def test_replaced_machine_restores_from_its_peer_bit_identical(reference, tiny_config, tmp_path):
    config = node_config(tiny_config, tmp_path, "fsdp")
    procs = start(config, tmp_path, "killed", JAXTRAIN_TEST_SLOW="1:0.4")  # time to kill it between saves
    try:
        wait_for_step(config.workdir, 6, procs)
        procs[1].send_signal(signal.SIGKILL)
    finally:  # the job restarts as a whole: process 0 goes too
        procs[0].send_signal(signal.SIGKILL)
        finish(procs, timeout=30)
    local = tmp_path / "local"
    assert [sorted(os.listdir(local / f"node{i}")) for i in (0, 1)] == [["process-0"], ["process-1"]]
    # fsdp spans the processes: each holds half of every sharded array, and its buddy a copy of that half.
    newest = max(int(n) for n in os.listdir(local / "node0/process-0") if n.isdigit())
    assert (local / "node0/process-0" / str(newest) / "replica.bin").stat().st_size > 0
    shutil.rmtree(local / "node1")  # the replaced machine comes back without its disk
    (local / "node0/.jaxtrain-node-1").write_text("12345")  # a marker a killed run left: not another process's
    persistent = [int(n) for n in os.listdir(Path(config.workdir) / "checkpoints") if n.isdigit()]
    assert persistent == [4]  # a restorable older step, which the restore must not need

    outputs = run(config, tmp_path, "resumed")
    # Process 1 loads its step from its own entry in the compile cache (jax's key names the process on CPU).
    assert re.search(r"process 1/2 .* compile cache \{'hits': [1-9]", outputs[1]), outputs[1][-500:]
    restore = last_restore(config)
    assert restore["restore_tier"] == "peer" and restore["step"] >= 5, restore
    assert persistent_reads(tmp_path) == []  # no checkpoint in checkpoint.dir was opened
    assert summary(config)["state_checksum"] == reference
    assert [sorted(os.listdir(local / f"node{i}")) for i in (0, 1)] == [[".jaxtrain-node-1", "process-0"],
                                                                      ["process-1"]]


def test_a_local_dir_the_processes_share_exits_2_naming_it(tiny_config, tmp_path):
    """Node mode with one local_dir for both processes (one disk, as an NFS path would be): each process exits
    2 with one line naming checkpoint.local_dir, before any checkpoint is read or written or anything compiles,
    and leaves no marker behind."""
    config = node_config(tiny_config, tmp_path, "fsdp")
    codes, outputs = finish(start(config, tmp_path, "shared", shared_local=True), timeout=120)
    local = tmp_path / "local"
    assert codes == [2, 2], [o[-3000:] for o in outputs]
    for out in outputs:
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert errors == [f"error: checkpoint.local_dir: {local} is shared by processes 0, 1 (each sees another's "
                          f"marker file there): local_mode=node needs each node's own disk or /dev/shm; use "
                          f"checkpoint.local_mode=shared for a directory every process sees"], out[-3000:]
        assert "Traceback" not in out and "compiled train step" not in out
    assert os.listdir(local) == [] and not (Path(config.workdir) / "checkpoints").exists()


# Two processes saving and restoring through the Checkpointer alone (no model to compile): for each layout, steps
# 1..4 saved to the node-local tier, a bit flipped in process 1's copy of step 4, and step 4 restored.
DAMAGE_WORKER = """
import json, os, sys
import jax
from jaxtrain.parallel import distributed
distributed.initialize()
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtrain import checkpoint

root, p = sys.argv[1], jax.process_index()
devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(2, 2)
for across in ("data", "fsdp"):
    mesh = Mesh(devices if across == "data" else devices.T, ("data", "fsdp"))
    def state(step):
        def put(x, *spec):
            return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P(*spec)), lambda i: x[i])
        w = np.random.default_rng(step).standard_normal((64, 16)).astype(np.float32)
        return {"step": put(np.int32(step)), "w": put(w, "fsdp"), "b": put(np.arange(8, dtype=np.float32) * step)}
    logs = []
    kw = dict(keep=2, every_steps=100, local_directory=f"{root}/{across}/local{p}", local_every_steps=1,
              local_mode="node", log=logs.append)
    ckpt = checkpoint.Checkpointer(f"{root}/{across}/dir", **kw)
    for step in range(1, 5):
        ckpt.should_save(step) and ckpt.save(step, state(step), {"pos": step})
    ckpt.close()
    mine = f"{root}/{across}/local{p}/process-{p}/4"
    replica_bytes = os.path.getsize(f"{mine}/replica.bin")
    multihost_utils.sync_global_devices("saved " + across)
    if p == 1:
        with open(f"{mine}/own.bin", "r+b") as f:
            f.seek(300)
            byte = f.read(1)
            f.seek(300)
            f.write(bytes([byte[0] ^ 0x20]))
    multihost_utils.sync_global_devices("damaged " + across)
    ckpt = checkpoint.Checkpointer(f"{root}/{across}/dir", **kw)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(4))
    step, restored, data = ckpt.restore_latest(abstract)
    ckpt.close()
    print(json.dumps({"across": across, "step": step, "data": data, "restored_from": ckpt.restored_from,
                      "equal": checkpoint.checksums(restored) == checkpoint.checksums(state(4)), "logs": logs,
                      "replica_bytes": replica_bytes, "listing": sorted(os.listdir(os.path.dirname(mine)))}),
          flush=True)
"""


def test_flipped_bit_in_a_local_shard_is_replaced_from_the_peer_and_kept(tmp_path):
    (tmp_path / "worker.py").write_text(DAMAGE_WORKER)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(tmp_path / "worker.py"), str(tmp_path)],
        env={**os.environ, "XLA_FLAGS": cpu_flags(2), "JAX_PLATFORMS": "cpu",
             "JAXTRAIN_COORDINATOR": f"127.0.0.1:{port}", "JAXTRAIN_NUM_PROCESSES": "2",
             "JAXTRAIN_PROCESS_ID": str(i), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    codes, outputs = finish(procs, timeout=180)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    results = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outputs]
    for p in (0, 1):
        by_layout = {r["across"]: r for r in results[p]}
        # data spans the processes: the peer holds the same shards already, so nothing is copied; fsdp does not.
        assert by_layout["data"]["replica_bytes"] == 0 and by_layout["fsdp"]["replica_bytes"] > 0
        for r in by_layout.values():
            assert (r["step"], r["data"], r["equal"]) == (4, {"pos": 4}, True), r
            assert r["restored_from"]["tier"] == "peer" and r["restored_from"]["sources"] == ["local_dir", "peer"]
            damaged = [line for line in r["logs"] if "process 1's node-local copy of step 4 is damaged" in line]
            assert len(damaged) == 1 and "checksum mismatch in" in damaged[0], r["logs"]
            assert "its shards came from process 0" in damaged[0]
            # Found by the integrity record first; the sha256 of the shards are read only then.
            assert any("step 4" in line and "does not match its integrity record" in line for line in r["logs"])
            aside = [n for n in r["listing"] if n.startswith("4.corrupt-")]
            assert r["listing"] == (["3", "4"] if p == 0 else ["3", *aside]) and len(aside) == p, r
    # The damaged copy is kept as it was: the flipped bit is still there.
    kept = next((tmp_path / "fsdp/local1/process-1").glob("4.corrupt-*"))
    assert (kept / "own.bin").stat().st_size > 300


# ===== In one process ===============================================================================================


def make_state(step):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    return {"step": put(np.int32(step)), "w": put(np.arange(256, dtype=np.float32).reshape(32, 8) * step, "fsdp")}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_without_a_good_local_copy_the_persistent_tier_is_used(tmp_path):
    logs = []
    kw = dict(keep=3, every_steps=2, local_directory=tmp_path / "local", local_every_steps=1, local_mode="node",
              log=logs.append)
    ckpt = checkpoint.Checkpointer(tmp_path / "dir", **kw)
    for step in range(1, 6):
        if ckpt.should_save(step):
            ckpt.save(step, make_state(step), {"pos": step})
    ckpt.close()
    mine = tmp_path / "local" / "process-0"
    assert sorted(os.listdir(mine)) == ["4", "5"] and ckpt.latest_step() == 5
    for step in ("4", "5"):  # every local copy is damaged, step 4's too, which the persistent tier holds
        blob = bytearray((mine / step / "own.bin").read_bytes())
        blob[5] ^= 1
        (mine / step / "own.bin").write_bytes(bytes(blob))

    ckpt = checkpoint.Checkpointer(tmp_path / "dir", **kw)
    step, state, data = ckpt.restore_latest(abstract(make_state(5)))
    assert (step, data, ckpt.restored_from["tier"]) == (4, {"pos": 4}, "dir")
    assert checkpoint.checksums(state) == checkpoint.checksums(make_state(4))
    # The integrity record finds the damage; the shards' sha256, read only then, name the copy.
    step5 = [line for line in logs if "step 5" in line]
    assert len(step5) == 2 and "does not match its integrity record (checksum mismatch in w)" in step5[0], logs
    assert "process 0's node-local copy of step 5 is damaged (checksum mismatch in w)" in step5[1], logs
    assert sorted(n.split("-")[0] for n in os.listdir(mine)) == ["4.corrupt", "5.corrupt"]


def test_a_clean_local_copy_is_verified_by_its_record_without_hashing_its_shards(tmp_path, monkeypatch):
    """The integrity record verifies the restored state; the shards' sha256 (a second pass over every byte) are
    for finding a damaged copy, so a clean restore computes none."""
    ckpt = checkpoint.Checkpointer(tmp_path / "dir", keep=1, every_steps=10, local_directory=tmp_path / "local",
                                   local_every_steps=1, local_mode="node")
    assert ckpt.should_save(1)
    ckpt.save(1, make_state(1), {"pos": 1})
    ckpt.close()
    assert os.listdir(tmp_path / "local" / "process-0") == ["1"]
    hashed = []
    sha = checkpoint_local._sha
    monkeypatch.setattr(checkpoint_local, "_sha", lambda data: hashed.append(data.size) or sha(data))
    ckpt = checkpoint.Checkpointer(tmp_path / "dir", keep=1, local_directory=tmp_path / "local",
                                   local_every_steps=1, local_mode="node")
    step, state, data = ckpt.restore_latest(abstract(make_state(1)))
    assert (step, data, ckpt.restored_from["tier"]) == (1, {"pos": 1}, "local_dir") and hashed == []
    assert checkpoint.checksums(state) == checkpoint.checksums(make_state(1))


@pytest.mark.parametrize("field, value, message", [
    ("local_mode", "nodes", "unknown value 'nodes'"),
    ("local_replica", "buddy", "unknown value 'buddy'"),
    ("local_dir", "gs://bucket/local", "local_mode=node writes to each machine's own disk"),
])
def test_bad_node_local_settings_name_their_field(field, value, message):
    c = ConfigDict(dict(checkpoint.CONFIG, local_dir="/tmp/x", local_every_steps=1, local_mode="node"))
    c[field] = value
    with pytest.raises(ConfigError, match=message) as e:
        checkpoint.check_config(c)
    assert e.value.field == f"checkpoint.{field}"


def test_an_unwritable_node_local_dir_names_its_field(tmp_path):
    """Written, not asked: os.access says yes to root, which cannot create a directory in /sys either."""
    if not os.path.isdir("/sys"):
        pytest.skip("no /sys")
    with pytest.raises(ConfigError, match=r"^checkpoint.local_dir: /sys/jaxtrain-test/local: not writable by "
                                          r"process 0 \(") as e:
        checkpoint.Checkpointer(tmp_path / "dir", keep=1, local_directory="/sys/jaxtrain-test/local",
                                local_every_steps=1, local_mode="node")
    assert e.value.field == "checkpoint.local_dir" and not os.path.exists("/sys/jaxtrain-test")
