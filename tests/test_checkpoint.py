"""Checkpointer: round trip, sharding-independent checksums, save/keep policies, the local tier, elastic restore."""

import asyncio
import json
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.path import atomicity

from jaxtrain import checkpoint
from jaxtrain.parallel import distributed
from jaxtrain.parallel import pipeline as pipeline_parallel


def mesh222():
    return Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "b", "c"))


def make_state(step=7, mesh=None):
    """A few small sharded arrays of different dtypes, as a train state would hold."""
    mesh = mesh or mesh222()
    rng = np.random.default_rng(0)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    return {"step": put(np.int32(step)),
            "params": {"w": put(rng.standard_normal((16, 8), np.float32), "a", "b"),
                       "b": put(rng.standard_normal(8).astype(jax.numpy.bfloat16), "c")},
            "opt_state": {"count": put(np.int32(step)), "mu": put(np.arange(32, dtype=np.float32) + step, ("a", "b"))}}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_bitwise_equal(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), jax.tree_util.keystr(path)


def test_relative_directory_round_trip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state, data = make_state(), {"epoch": 1, "position": [3, 5], "seed": 0}
    ckpt = checkpoint.Checkpointer("runs/rel/checkpoints", keep=2)
    ckpt.save(3, state, data)
    data["position"][0] = 99  # the caller reuses its dict; the checkpoint must hold the value at save time
    ckpt.close()
    assert (tmp_path / "runs/rel/checkpoints/3/integrity").is_dir()

    ckpt = checkpoint.Checkpointer("runs/rel/checkpoints", keep=2)
    assert ckpt.latest_step() == 3
    step, restored, restored_data = ckpt.restore_latest(abstract(state))
    restored2, _ = ckpt.restore(3, abstract(state))
    ckpt.close()
    assert step == 3 and restored_data == {"epoch": 1, "position": [3, 5], "seed": 0}
    assert_bitwise_equal(restored, state)
    assert_bitwise_equal(restored2, state)


def test_a_one_process_save_compiles_no_replica_slices(tmp_path, caplog):
    """Orbax's replica-parallel save slices each replicated shard, one compiled program per slice, which gains
    nothing with one writing process. Shapes of this test only, so that no earlier test compiled them."""
    mesh = mesh222()
    rng = np.random.default_rng(1)
    state = {"w": jax.device_put(rng.standard_normal((24, 40), np.float32), NamedSharding(mesh, P("b"))),
             "v": jax.device_put(rng.standard_normal(40).astype(np.float32), NamedSharding(mesh, P()))}
    ckpt = checkpoint.Checkpointer(tmp_path, keep=1)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        ckpt.save(1, state, {})
        ckpt.wait()
    compiled = [r.getMessage().split(" with ")[0] for r in caplog.records if r.getMessage().startswith("Compiling ")]
    assert compiled and not [name for name in compiled if "slice" in name], compiled
    step, restored, _ = ckpt.restore_latest(abstract(state))
    ckpt.close()
    assert step == 1
    assert_bitwise_equal(restored, state)


def test_no_checkpoint_and_mismatched_target(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, keep=2)
    assert ckpt.latest_step() is None and ckpt.restore_latest(abstract(make_state())) is None
    ckpt.save(1, make_state(), {})
    ckpt.wait()
    # A different model is the caller's error, not a corrupt checkpoint: it is raised, and nothing is moved aside.
    wrong = abstract(make_state())
    wrong["params"]["w"] = jax.ShapeDtypeStruct((16, 4), np.float32, sharding=wrong["params"]["w"].sharding)
    with pytest.raises(checkpoint.CheckpointError, match=r"params/w: saved \(\(16, 8\), 'float32'\)"):
        ckpt.restore_latest(wrong)
    with pytest.raises(checkpoint.CheckpointError, match="step 5"):
        ckpt.restore(5, abstract(make_state()))
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name[0].isdigit()) == ["1"]


def test_checksum_is_sharding_independent_and_sees_every_bit():
    state = make_state()
    ref = checkpoint.checksums(state)
    mesh22 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    moved = jax.device_put(state, {"step": NamedSharding(mesh22, P()),
                                   "params": {"w": NamedSharding(mesh22, P("y", "x")), "b": NamedSharding(mesh22, P("x"))},
                                   "opt_state": {"count": NamedSharding(mesh22, P()),
                                                 "mu": NamedSharding(mesh22, P(("y", "x")))}})
    assert checkpoint.checksums(moved) == ref
    assert checkpoint.checksums(jax.device_put(state, jax.devices()[5])) == ref

    # Any single flipped bit, in any dtype and position, changes the checksum of that array only.
    arrays = {"f32": np.asarray(state["params"]["w"]), "bf16": np.asarray(state["params"]["b"]),
              "i8": np.arange(-50, 50, dtype=np.int8).reshape(10, 10), "bool": np.arange(12).reshape(3, 4) % 3 == 0}
    base = checkpoint.checksums(arrays)
    for name, x in arrays.items():
        flat = x.reshape(-1).view(np.uint8)
        for byte, bit in [(0, 0), (flat.size // 2, 3), (flat.size - 1, 7)]:
            if x.dtype == bool and bit:
                continue  # a bool is one bit of its byte
            y = flat.copy()
            y[byte] ^= 1 << bit
            sums = checkpoint.checksums({**arrays, name: y.view(x.dtype).reshape(x.shape)})
            assert sums[name] != base[name], (name, byte, bit)
            assert {k: v for k, v in sums.items() if k != name} == {k: v for k, v in base.items() if k != name}
    swapped = arrays["i8"].copy()
    swapped[0, 0], swapped[0, 1] = swapped[0, 1], swapped[0, 0]  # same multiset of values, other positions
    assert checkpoint.checksums({"i8": swapped})["i8"] != base["i8"]


def test_checksum_equals_its_definition_in_numpy():
    """The recorded format: checkpoints already on disk verify only while these sums stay the same. (murmur3's
    finaliser, checkpoint._fmix, is plain arithmetic: here it runs on numpy arrays.)"""
    rng = np.random.default_rng(0)
    arrays = {"f32": rng.standard_normal((6, 7, 5), np.float32),
              "bf16": rng.standard_normal((9, 11)).astype(jnp.bfloat16), "i8": rng.integers(-128, 128, (13,), np.int8),
              "bool": rng.random((4, 3)) < 0.5, "scalar": np.float32(-2.5)}
    want = {}
    for name, x in arrays.items():
        x = np.asarray(x)
        w = (x.astype(np.uint32) if x.dtype == bool else x.view(f"uint{x.dtype.itemsize * 8}").astype(np.uint32))
        w = w.reshape(-1)
        pos = np.arange(w.size, dtype=np.uint32)
        f1 = checkpoint._fmix(pos) | np.uint32(1)
        f2 = checkpoint._fmix(pos ^ np.uint32(0x5BD1E995)) | np.uint32(1)
        sums = np.sum(w * f1, dtype=np.uint32), np.sum(checkpoint._fmix(w) * f2, dtype=np.uint32)
        want[name] = "".join(f"{int(s):08x}" for s in sums)
    assert checkpoint.checksums(arrays) == want


def test_save_policies_every_steps_and_minutes(tmp_path, monkeypatch):
    ckpt = checkpoint.Checkpointer(tmp_path / "steps", keep=2, every_steps=3)
    assert [s for s in range(1, 10) if ckpt.should_save(s)] == [3, 6, 9]
    ckpt.close()

    now = [0.0]
    ckpt = checkpoint.Checkpointer(tmp_path / "time", keep=2, every_minutes=1, clock=lambda: now[0])
    state = {"x": jax.numpy.zeros(4)}
    decisions = []
    for step, t in enumerate([30, 61, 100, 122, 130]):
        now[0] = t
        decisions.append(ckpt.should_save(step))
        if decisions[-1]:
            ckpt.save(step, state, {})
    ckpt.wait()
    assert decisions == [False, True, False, True, False]  # the clock restarts at each save
    assert sorted(p.name for p in (tmp_path / "time").iterdir() if p.name.isdigit()) == ["1", "3"]

    # On several processes the clock rule is decided by process 0 and broadcast: another process's own clock
    # (here: not due) does not matter.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "allgather", lambda values: np.array([[1], values]))  # process 0's: due
    now[0] = 131
    assert ckpt.should_save(10)
    monkeypatch.setattr(distributed, "allgather", lambda values: np.array([[0], values]))
    now[0] = 1000
    assert not ckpt.should_save(11)
    monkeypatch.undo()
    ckpt.close()


def test_keep_latest_k_plus_every_pth(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, keep=2, keep_period=4, async_save=False)  # GC inline, in order
    state = {"x": jax.numpy.zeros(4)}
    for step in range(1, 10):
        ckpt.save(step, state, {"step": step})
    ckpt.close()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [4, 8, 9]


def test_gc_deletes_the_previous_step_only_after_the_next_commits(tmp_path, monkeypatch):
    """Orbax computes the steps to delete when a save starts but deletes them in the finalize thread after the
    commit (and not at all if the save fails, see test_checkpoint_faults): check the order with a held commit."""
    ckpt = checkpoint.Checkpointer(tmp_path, keep=1)
    state = {"x": jax.numpy.zeros(4)}
    ckpt.save(1, state, {})
    ckpt.wait()
    release, original = threading.Event(), atomicity.on_commit_callback

    async def held_commit(*args, **kwargs):
        await asyncio.to_thread(release.wait, 60)
        return await original(*args, **kwargs)

    monkeypatch.setattr(atomicity, "on_commit_callback", held_commit)
    ckpt.save(2, state, {})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "1" in names and "2" not in names and "2.orbax-checkpoint-tmp" in names
    release.set()
    ckpt.wait()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name[0].isdigit()) == ["2"]
    ckpt.close()


def test_local_tier_is_preferred_when_newest_and_verified(tmp_path):
    kw = {"keep": 2, "every_steps": 4, "local_directory": tmp_path / "local", "local_every_steps": 2, "local_keep": 2}
    ckpt = checkpoint.Checkpointer(tmp_path / "persistent", **kw)
    for step in range(1, 11):
        if ckpt.should_save(step):
            ckpt.save(step, make_state(step), {"step": step})
    ckpt.save(11, make_state(11), {"step": 11})  # unplanned (end of run): persistent
    ckpt.close()
    steps = lambda d: sorted(int(p.name) for p in (tmp_path / d).iterdir() if p.name.isdigit())
    assert steps("persistent") == [8, 11] and steps("local") == [8, 10]  # the local tier saves at 8 too

    logs = []
    ckpt = checkpoint.Checkpointer(tmp_path / "persistent", log=logs.append, **kw)
    assert ckpt.latest_step() == 11
    assert ckpt.restore_latest(abstract(make_state()))[0] == 11
    (tmp_path / "persistent/11/commit_success.txt").unlink()
    step, state, data = ckpt.restore_latest(abstract(make_state()))
    assert step == 10 and data == {"step": 10} and int(state["step"]) == 10  # from the local tier
    assert len(logs) == 1 and "step 11" in logs[0] and "persistent" in logs[0]
    _, data = ckpt.restore(8, abstract(make_state()))
    assert data == {"step": 8} and ckpt.restored_from["tier"] == "local_dir"  # both hold 8: the faster one
    ckpt.close()


def test_elastic_restore_onto_fewer_devices(tmp_path):
    state = make_state()
    ckpt = checkpoint.Checkpointer(tmp_path, keep=1)
    ckpt.save(7, state, {"pos": 1})
    ckpt.close()

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    specs = {"step": P(), "params": {"w": P("model", "data"), "b": P("data")},
             "opt_state": {"count": P(), "mu": P(("data", "model"))}}
    target = jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
                          state, specs)
    ckpt = checkpoint.Checkpointer(tmp_path, keep=1)
    step, restored, _ = ckpt.restore_latest(target)
    ckpt.close()
    assert step == 7
    assert_bitwise_equal(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert got.sharding == want.sharding and len(got.sharding.device_set) == 4


def test_restore_moves_the_stacked_layers_into_the_restoring_runs_order(tmp_path):
    """A circular pipeline keeps its stacked layers stage-major; the checkpoint records that order, and a restore
    for another order (the model's, another pipeline's) moves them, leaf by leaf, onto the target's sharding.
    The checksums are verified on the saved order first: the moved state is exact, not recomputed."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("pipeline", "data"))
    layers = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)  # row l = model layer l
    stage_major = pipeline_parallel.layer_order(8, 2, 2)  # (0, 1, 4, 5, 2, 3, 6, 7)

    def state_in(order, spec=("pipeline",)):
        put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
        stacked = put(layers[list(order)], *spec)
        return {"step": put(np.int32(3)), "params": {"blocks": {"w": stacked}, "embed": put(layers * 2, "data")},
                "opt_state": ({"mu": {"blocks": {"w": stacked + 1}, "embed": put(layers * 3, "data")}},)}

    saved = state_in(stage_major)
    ckpt = checkpoint.Checkpointer(tmp_path, keep=1, layer_order=stage_major)
    ckpt.save(3, saved, {})
    ckpt.close()
    record = json.loads((tmp_path / "3" / "integrity" / "metadata").read_text())
    assert record["layer_order"] == list(stage_major)

    for order, spec in [(stage_major, ("pipeline",)), (tuple(range(8)), ("data",)),
                        (pipeline_parallel.layer_order(8, 4, 2), ("pipeline", "data"))]:
        want = state_in(order, spec)
        ckpt = checkpoint.Checkpointer(tmp_path, keep=1, layer_order=order)
        step, restored, _ = ckpt.restore_latest(abstract(want))
        again, _ = ckpt.restore(3, abstract(want))
        ckpt.close()
        assert step == 3
        assert_bitwise_equal(restored, want)
        assert_bitwise_equal(again, want)
        assert restored["params"]["blocks"]["w"].sharding == want["params"]["blocks"]["w"].sharding


def test_bucket_checkpoint_dirs_name_what_they_lack_before_anything_starts(monkeypatch):
    import importlib.util

    from ml_collections import ConfigDict
    from orbax.checkpoint._src.serialization import tensorstore_utils

    from jaxtrain.compat import orbax_s3
    from jaxtrain.errors import ConfigError

    c = ConfigDict(dict(checkpoint.CONFIG, dir="s3://b/ckpt"))
    with monkeypatch.context() as m:  # a process where no entry point installed the s3:// support
        m.setattr(checkpoint, "s3_problem", checkpoint.S3_NEEDS_INSTALL)
        with pytest.raises(ConfigError, match=r"^checkpoint.dir: s3://b/ckpt: s3:// checkpoints need "
                                              r"jaxtrain\.compat\.install\(\) in this process first"):
            checkpoint.check_config(c)
        m.setattr(checkpoint, "s3_problem", None)  # what compat.orbax_s3.install() leaves where it works
        checkpoint.check_config(c)
    with monkeypatch.context() as m:  # an Orbax whose spec helpers moved: install leaves the reason
        m.setattr(orbax_s3, "_installed", False)
        m.setattr(checkpoint, "s3_problem", None)
        m.delattr(tensorstore_utils, "_use_gcs_driver")
        orbax_s3.install()
        with pytest.raises(ConfigError, match=r"checkpoint.dir: s3://b/ckpt: this orbax-checkpoint lacks "
                                              r"orbax\.checkpoint\._src\.serialization\.tensorstore_utils\."
                                              r"_use_gcs_driver, which s3:// checkpoints build on"):
            checkpoint.check_config(c)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in ("s3fs", "gcsfs") else
                        find_spec(name))
    for url, client in [("s3://b/ckpt", "s3fs"), ("gs://b/ckpt", "gcsfs")]:
        with pytest.raises(ConfigError, match=rf"checkpoint.dir: {url}: needs {client} \(pip install "
                                              r"'jaxtrain\[cloud\]'\)"):
            checkpoint.check_config(ConfigDict(dict(checkpoint.CONFIG, dir=url)))
