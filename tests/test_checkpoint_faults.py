"""Checkpointer under faults: damaged checkpoints, a save killed midway, failing writes.

Each bad checkpoint must be detected, named in the log, skipped in favour of the previous good one and kept on
disk (moved aside); a failed write must surface as CheckpointError without losing the last committed step.
"""

import asyncio
import errno
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import cpu_flags
from jaxtrain import checkpoint
from jaxtrain.compat import orbax_noise

# The failure paths provoked here leave Orbax coroutines and event loops behind; their complaints are noise.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_state(step):
    """Random bits in `w` (64x64 f32): zstd stores them verbatim and OCDBT keeps chunks this large out of line,
    unchecked, in its data files; that is where a flipped bit goes unnoticed by Orbax."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "b", "c"))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    w = np.random.default_rng(0).integers(0, 2**32, (64, 64), dtype=np.uint32).view(np.float32)
    return {"step": put(np.int32(step)), "params": {"w": put(w, "a", "b")},
            "opt_state": {"mu": put(np.arange(16, dtype=np.float32) * step, "c")}}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def tree_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Good checkpoints at steps 1 and 2, written once; each test damages a copy of step 2."""
    root = tmp_path_factory.mktemp("template") / "ckpt"
    ckpt = checkpoint.Checkpointer(root, keep=5)
    for step in (1, 2):
        ckpt.save(step, make_state(step), {"pos": step})
    ckpt.close()
    return root


def flip_array_bit(step_dir):
    """Flips one bit inside the bytes of params/w wherever tensorstore wrote them."""
    needle = np.asarray(make_state(2)["params"]["w"])[0, :8].tobytes()
    hits = 0
    for name in tree_files(step_dir / "state"):
        path = step_dir / "state" / name
        blob = bytearray(path.read_bytes())
        if (at := blob.find(needle)) >= 0:
            blob[at + 13] ^= 0x10
            path.write_bytes(bytes(blob))
            hits += 1
    assert hits, "params/w bytes not found verbatim: the on-disk layout changed"


def truncate_largest(step_dir):
    path = max((step_dir / "state").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "flipped bit": (flip_array_bit, "checksum mismatch in params/w"),
    "truncated file": (truncate_largest, "failed to load"),
    "missing manifest": (lambda d: (d / "state/manifest.ocdbt").unlink(), "failed to load"),
    "missing integrity record": (lambda d: shutil.rmtree(d / "integrity"), "unreadable integrity record"),
    "missing commit marker": (lambda d: (d / "commit_success.txt").unlink(), "missing commit marker"),
    "broken data-state JSON": (lambda d: (d / "data/metadata").write_text('{"pos": '), "failed to load"),
    "altered data-state JSON": (lambda d: (d / "data/metadata").write_text('{"pos": 3}'), "data state differs"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_damaged_checkpoint_is_reported_kept_and_skipped(case, template, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(template, root)
    damage, reason = CORRUPTIONS[case]
    damage(root / "2")
    before = tree_files(root)
    if case == "flipped bit":  # Orbax alone restores the damaged value without complaint
        orbax_alone = ocp.StandardCheckpointer()
        plain = orbax_alone.restore(root / "2/state", abstract(make_state(2)))
        orbax_alone.close()
        changed = np.asarray(plain["params"]["w"]).view(np.uint32) != np.asarray(make_state(2)["params"]["w"]).view(
            np.uint32)
        assert changed.sum() == 1

    logs = []
    ckpt = checkpoint.Checkpointer(root, keep=5, log=logs.append)
    step, state, data = ckpt.restore_latest(abstract(make_state(2)))
    assert (step, data, int(state["step"])) == (1, {"pos": 1}, 1)
    assert len(logs) == 1 and "step 2" in logs[0] and str(root) in logs[0] and reason in logs[0], logs
    moved = [p.name for p in root.iterdir() if p.name.startswith("2.corrupt-")]
    assert len(moved) == 1 and moved[0] in logs[0]
    assert tree_files(root) == [n.replace("2/", moved[0] + "/", 1) if n.startswith("2/") else n for n in before]

    # The step can be saved again, and Orbax ignores the moved-aside copy (listing, GC, tmp cleanup).
    ckpt.save(2, make_state(2), {"pos": 2})
    ckpt.close()
    ckpt = checkpoint.Checkpointer(root, keep=1, log=logs.append)
    assert ckpt.restore_latest(abstract(make_state(2)))[0] == 2
    ckpt.save(3, make_state(3), {"pos": 3})
    ckpt.close()
    assert sorted(p.name for p in root.iterdir() if p.name[0].isdigit()) == sorted(["3", moved[0]])


@pytest.mark.parametrize("name", ["_CHECKPOINT_METADATA", "_CHECKPOINT_METADATA garbled", "state/_METADATA",
                                  "state/_sharding"])
def test_missing_redundant_metadata_is_not_damage(name, template, tmp_path, caplog):
    """Orbax's descriptive metadata is not needed to restore onto an abstract target, and the checksums prove
    the data intact: such a checkpoint is used, not skipped. Orbax's complaint about a step's metadata, which
    it repeats with the file's content each time it lists the steps, reaches the user once, as one line."""
    root = tmp_path / "ckpt"
    shutil.copytree(template, root)
    path = root / "2" / name.split()[0]
    if name.endswith("garbled"):
        path.write_text("garbage{\n")
    else:
        path.unlink()
    logs = []
    orbax_noise.install()  # as every entry point does (the line below is its filter's)
    with caplog.at_level(logging.WARNING, logger="absl"):
        ckpt = checkpoint.Checkpointer(root, keep=5, log=logs.append)
        step, _, data = ckpt.restore_latest(abstract(make_state(2)))
        ckpt.save(3, make_state(3), {"pos": 3})
        ckpt.close()
    assert (step, data, logs) == (2, {"pos": 2}, [])
    about = [(r.levelno, r.getMessage()) for r in caplog.records if str(path) in r.getMessage()]
    if name.startswith("_CHECKPOINT_METADATA"):
        reason = "unreadable" if name.endswith("garbled") else "missing"
        assert about == [(logging.WARNING, f"{path}: {reason}; Orbax goes on without it (the state is still "
                                           "verified)")], about


def test_all_checkpoints_bad_is_an_error_not_a_fresh_start(template, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(template, root)
    for step in ("1", "2"):
        (root / step / "commit_success.txt").unlink()
    logs = []
    ckpt = checkpoint.Checkpointer(root, keep=5, log=logs.append)
    # restore(step) names the problem and leaves the copy where it is; restore_latest moves bad copies aside.
    with pytest.raises(checkpoint.CheckpointError, match="cannot restore checkpoint step 2: .*missing commit marker"):
        ckpt.restore(2, abstract(make_state(2)))
    assert not list(root.glob("*.corrupt-*"))
    with pytest.raises(checkpoint.CheckpointError, match="none of the 2 checkpoints"):
        ckpt.restore_latest(abstract(make_state(2)))
    ckpt.close()
    assert len(logs) == 2 and len(list(root.glob("*.corrupt-*"))) == 2


KILLED_SAVE = """
import os, signal
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from jaxtrain import checkpoint

ckpt = checkpoint.Checkpointer({root!r}, keep=3)
ckpt.save(1, {{"w": jnp.ones(8)}}, {{"pos": 1}})
ckpt.wait()

async def never_commit(*args, **kwargs):  # the kill lands before the commit, deterministically
    os.kill(os.getpid(), signal.SIGKILL)

atomicity.on_commit_callback = never_commit
ckpt.save(2, {{"w": jnp.ones(8) * 2}}, {{"pos": 2}})
ckpt.wait()
"""


def test_save_killed_midway_leaves_a_tmp_dir_that_is_ignored_and_cleaned(tmp_path):
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_SAVE.format(root=str(root)))], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    partial = root / "2.orbax-checkpoint-tmp"
    assert sorted(p.name for p in root.iterdir() if p.name[0].isdigit()) == ["1", partial.name]
    assert (partial / "state").is_dir() and not (partial / "commit_success.txt").exists()

    logs = []
    ckpt = checkpoint.Checkpointer(root, keep=3, log=logs.append)
    assert ckpt.latest_step() == 1
    target = {"w": jax.ShapeDtypeStruct((8,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    step, state, data = ckpt.restore_latest(target)
    assert (step, data, logs) == (1, {"pos": 1}, [])
    deadline = time.monotonic() + 30
    while partial.exists() and time.monotonic() < deadline:  # cleanup_tmp_directories runs in the background
        time.sleep(0.05)
    assert not partial.exists()
    ckpt.save(2, {"w": jax.numpy.ones(8) * 2}, {"pos": 2})
    ckpt.close()
    assert sorted(p.name for p in root.iterdir() if p.name[0].isdigit()) == ["1", "2"]
    ckpt = checkpoint.Checkpointer(root, keep=3)
    step, state, _ = ckpt.restore_latest(target)
    ckpt.close()
    assert step == 2 and float(state["w"][0]) == 2


TWO_PROCESSES = """
import faulthandler, os
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

pid = int(os.environ["CKPT_PID"])
faulthandler.dump_traceback_later(140, exit=True)  # a hang shows where, instead of a bare timeout
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{os.environ['CKPT_PORT']}", num_processes=2, process_id=pid)
from jaxtrain import checkpoint, compat

compat.install()  # this script is its process's entry point: s3:// checkpoints need Orbax's specs extended

mesh = jax.make_mesh((8,), ("d",), devices=jax.devices())
def state(step):
    x = jax.make_array_from_callback((64,), NamedSharding(mesh, P("d")), lambda i: np.arange(64.0, dtype=np.float32)[i] * step)
    return {"x": x}

read_items = checkpoint._read_items
for where, root in zip(("local", "s3"), os.environ["CKPT_ROOTS"].split(",")):
    # Process 1's clock runs at half speed: by its own reckoning no save would ever be due.
    now = [0.0]
    ckpt = checkpoint.Checkpointer(root, keep=5, every_minutes=5, clock=lambda: now[0] / (1 + pid))
    decisions = []
    for step, t in enumerate([100, 400, 500, 800], start=1):
        now[0] = t
        decisions.append(ckpt.should_save(step))
        if decisions[-1]:
            ckpt.save(step, state(step), {"pos": step})
    ckpt.close()

    # Step 4's shards fail to read on process 1 only (a flaky disk on one host): both must skip it together.
    def flaky(path, abstract, *rest):
        if pid == 1 and path.name == "4":
            raise OSError("simulated read error on process 1")
        return read_items(path, abstract, *rest)
    checkpoint._read_items = flaky
    logs = []
    ckpt = checkpoint.Checkpointer(root, keep=5, log=logs.append)
    step, restored, data = ckpt.restore_latest({"x": jax.ShapeDtypeStruct((64,), np.float32, sharding=NamedSharding(mesh, P("d")))})
    ckpt.close()
    checkpoint._read_items = read_items
    ok = bool(jax.jit(lambda a, b: (a == b).all())(restored["x"], state(step)["x"]))
    print("RESULT", where, pid, decisions, step, data, ok, logs, flush=True)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree_on_time_saves_and_on_skipping_a_bad_step_local_and_in_s3(tmp_path):
    """In s3:// each process writes its own shards straight to the bucket (tensorstore's s3 driver). One pair of
    processes runs the drill on a local directory, then in s3://."""
    import emulators
    import s3fs

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    server = emulators.S3()
    server.start()
    env.update(server.env())
    fs = s3fs.S3FileSystem(endpoint_url=server.url, key="test", secret="test", skip_instance_cache=True)
    local = tmp_path / "ckpt"
    names = {"local": lambda: sorted(p.name for p in local.iterdir() if p.name[0].isdigit()),
             "s3": lambda: sorted({p.split("/")[2] for p in fs.find("bucket/ckpt")})}
    env.update(XLA_FLAGS=cpu_flags(4), JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               CKPT_ROOTS=f"{local},s3://bucket/ckpt", CKPT_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES], env={**env, "CKPT_PID": str(i)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
        after = {where: listing() for where, listing in names.items()}
    finally:
        for p in procs:
            p.kill()
        server.stop()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    for where in names:
        results = [next(line for line in out.splitlines() if line.startswith(f"RESULT {where} ")) for out in outputs]
        for pid, line in enumerate(results):
            assert line.startswith(f"RESULT {where} {pid} [False, True, False, True] 2 {{'pos': 2}} True"), line
        assert "simulated read error on process 1" in results[1] and "failed on another process" in results[0]
        moved = [name for name in after[where] if name.startswith("4.corrupt-")]
        assert len(moved) == 1 and after[where] == sorted(["2", *moved]), where


def failing(monkeypatch, root, method, code):
    """Makes `epath.Path.<method>` raise OSError(code) below `root`, as a read-only or full disk would."""
    cls = type(epath.Path(root))
    original = getattr(cls, method)

    def fail(self, *args, **kwargs):
        if str(self).startswith(str(root)):
            raise OSError(code, os.strerror(code), str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, fail)


def test_read_only_directory_fails_the_save_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    ckpt = checkpoint.Checkpointer(root, keep=1)
    ckpt.save(1, make_state(1), {"pos": 1})
    ckpt.wait()
    failing(monkeypatch, root, "mkdir", errno.EROFS)
    with pytest.raises(checkpoint.CheckpointError, match="step 2.*Read-only file system"):
        ckpt.save(2, make_state(2), {"pos": 2})  # the step directory is created before save returns
    assert sorted(p.name for p in root.iterdir() if p.name[0].isdigit()) == ["1"]
    monkeypatch.undo()
    ckpt.save(3, make_state(3), {"pos": 3})  # the same Checkpointer works again once the disk does
    ckpt.wait()
    assert sorted(p.name for p in root.iterdir() if p.name[0].isdigit()) == ["3"]

    # A bucket whose endpoint went down fails the save and then the fresh manager too (Orbax lists the dir):
    # both are the CheckpointError (exit 4), not a client's traceback, and the next save reopens the dir.
    failing(monkeypatch, root, "mkdir", errno.EROFS)
    monkeypatch.setattr(checkpoint._Dir, "_open", lambda self, options: (_ for _ in ()).throw(
        ConnectionError("Could not connect to the endpoint URL")))
    with pytest.raises(checkpoint.CheckpointError, match="step 4.*Read-only file system.*cannot reopen the "
                                                         "checkpoint directory after a failed save \\(ConnectionError"):
        ckpt.save(4, make_state(4), {"pos": 4})
    with pytest.raises(checkpoint.CheckpointError, match="^[^;]*cannot reopen the checkpoint directory"):
        ckpt.save(5, make_state(5), {"pos": 5})  # still down: said again, nothing else tried
    monkeypatch.undo()
    ckpt.save(6, make_state(6), {"pos": 6})
    ckpt.close()
    assert sorted(p.name for p in root.iterdir() if p.name[0].isdigit()) == ["6"]


def test_full_disk_surfaces_by_the_next_save_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    ckpt = checkpoint.Checkpointer(root, keep=1)
    ckpt.save(1, make_state(1), {"pos": 1})
    ckpt.wait()
    failing(monkeypatch, root, "write_text", errno.ENOSPC)
    ckpt.save(2, make_state(2), {"pos": 2})  # returns: the failing writes happen in the background
    with pytest.raises(checkpoint.CheckpointError, match="step 2.*No space left on device"):
        ckpt.save(3, make_state(3), {"pos": 3})
    with pytest.raises(checkpoint.CheckpointError, match="step 3.*No space left on device"):
        ckpt.wait()
    assert "1" in os.listdir(root)  # keep=1, yet the failed saves did not garbage-collect it
    monkeypatch.undo()

    logs = []
    ckpt.log = logs.append
    assert ckpt.restore_latest(abstract(make_state(1)))[0] == 1 and logs == []
    assert "3.orbax-checkpoint-tmp" in os.listdir(root)
    ckpt.save(4, make_state(4), {"pos": 4})  # the same Checkpointer works again once the disk does
    # A writer of failed save 2 that was still running (Orbax reports the first error without waiting for the
    # rest) writes again after save 4 removed its directory: the close removes it once more.
    (root / "2.orbax-checkpoint-tmp" / "state").mkdir(parents=True, exist_ok=True)
    (root / "2.orbax-checkpoint-tmp" / "state" / "late").write_text("x")
    ckpt.close()
    # 1 goes once 4 has committed; the partial writes of failed saves are removed by later saves and the close,
    # not left to pile up on a full disk.
    assert sorted(p.name for p in root.iterdir() if p.name[0].isdigit()) == ["4"]


def test_reports_of_orbax_reads_abandoned_by_a_failed_restore_are_dropped(caplog, capsys, monkeypatch):
    """A failed load leaves Orbax's reads behind, to report at any later time from any thread: finished tasks
    through asyncio's logger ("Task exception was never retrieved"), and reads still in flight in tensorstore
    through sys.unraisablehook once Orbax's loop is closed. Only those are dropped, and only once a restore ran."""
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])  # as in a process that restored nothing
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    orbax_frame = compile(
        "async def read():\n    raise ValueError('corrupt shard')\n"
        "class Pending:\n    def __await__(self):\n        yield\n"
        "async def suspended():\n    try:\n        await Pending()\n"
        "    except BaseException as e:\n        raise Exception('corrupt index') from e\n",
        "orbax/checkpoint/x.py", "exec")
    scope = {}
    exec(orbax_frame, scope)

    async def ours():
        raise ValueError("not orbax")

    def abandon(coroutine_fn):
        loop = asyncio.new_event_loop()
        task = loop.create_task(coroutine_fn())
        loop.run_until_complete(asyncio.sleep(0))
        assert task.done()
        loop.close()
        del task
        gc.collect()

    class Raises:  # an object whose finalizer raises reaches sys.unraisablehook, as tensorstore's callbacks do
        def __init__(self, fn):
            self.fn = fn

        def __del__(self):
            self.fn()

    def late_completion():  # a read ending after Orbax closed its loop
        loop = asyncio.new_event_loop()
        loop.close()
        Raises(lambda: loop.call_soon_threadsafe(lambda: None))

    def other_unraisable():
        Raises(lambda: 1 / 0)

    def collected_while_suspended():  # Orbax's read raises when the garbage collector closes it
        read = scope["suspended"]()
        read.send(None)
        del read

    def tensorstore_future():  # a failed read's future, set from C++: no traceback, an absl status in its text
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(ValueError("DATA_LOSS: Error reading \"x\": corrupt"))
        loop.close()
        del future
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        abandon(scope["read"])
        late_completion()
        collected_while_suspended()
        assert "corrupt shard" in caplog.text  # no restore yet: all reports stand
        err = capsys.readouterr().err
        assert "Event loop is closed" in err and "corrupt index" in err
        caplog.clear()
        orbax_noise.install()
        abandon(scope["read"])
        tensorstore_future()
        abandon(ours)
        late_completion()
        collected_while_suspended()
        other_unraisable()
    assert "corrupt" not in caplog.text
    assert "not orbax" in caplog.text
    err = capsys.readouterr().err
    assert "Event loop is closed" not in err and "corrupt" not in err and "ZeroDivisionError" in err
