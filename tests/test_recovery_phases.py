"""The phases of a (re)start in goodput.jsonl: written by train.run, restore naming its tier; read back per restart."""

import json

import jax
import jax.numpy as jnp

from jaxtrain import checkpoint, train
from jaxtrain.observe import goodput


def phases_records(workdir):
    return [r for r in goodput.read_records(f"{workdir}/goodput.jsonl") if r["event"] == "phases"]


def test_resume_records_its_phases_and_the_restore_tier(tiny_config, tmp_path, monkeypatch, cache_counts):
    overrides = {"train.steps": 4, "checkpoint.every_steps": 2, "checkpoint.local_dir": str(tmp_path / "local"),
                 "checkpoint.local_every_steps": 1, "eval.every_steps": 0}
    config = tiny_config(**overrides, **{"train.stop_at": 3})
    train.run(config, print_fn=lambda *a: None)
    # As a supervisor's restart sees it: launched 0.5 s after the previous attempt exited.
    exited = goodput.read_records(f"{config.workdir}/goodput.jsonl")[-1]["t"] + 2.0
    monkeypatch.setenv(goodput.PREVIOUS_EXIT_AT_ENV, repr(exited))
    monkeypatch.setenv(goodput.LAUNCHED_AT_ENV, repr(exited + 0.5))
    monkeypatch.setattr(train, "_RUNS_IN_PROCESS", [0])  # as the first run of a new process
    config.train.stop_at = 0
    train.run(config, print_fn=lambda *a: None)

    first, second = phases_records(config.workdir)
    assert first["step"] == 0 and first["restore_tier"] is None and "restore" not in first["phases"]
    assert set(first["phases"]) >= {"distributed_init", "setup", "compile"}  # process_start: if first in process
    assert first["compile"] in ("compiled", "cache")  # "cache" if an earlier test compiled the same step
    assert second["compile"] == "cache"  # conftest caches every compile
    assert second["step"] == 3 and second["restore_tier"] == "local_dir"  # step 3 exists only in the local tier
    assert list(second["phases"]) == [k for k in goodput.PHASES if k in second["phases"]]  # in order
    assert set(second["phases"]) == set(goodput.PHASES)
    assert abs(second["phases"]["detection"] - 2.0) < 1e-3 and abs(second["phases"]["restart_wait"] - 0.5) < 1e-3
    assert all(v >= 0 for v in second["phases"].values())

    rows = goodput.restarts(goodput.read_records(f"{config.workdir}/goodput.jsonl"))
    assert [(r["step"], r["restart"]) for r in rows] == [(0, False), (3, True)]
    assert rows[1]["restore_tier"] == "local_dir" and rows[1]["first_step_s"] is not None  # log.every_steps=1
    # Other readers skip the new record: goodput is unchanged by it.
    assert goodput.goodput(goodput.read_records(f"{config.workdir}/goodput.jsonl"), 10.0)["final_step"] == 4


def test_restore_names_the_persistent_tier(tmp_path):
    state = {"step": jnp.int32(2), "w": jnp.arange(8.0)}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    ckpt = checkpoint.Checkpointer(tmp_path / "dir", keep=2, local_directory=tmp_path / "local", local_every_steps=3)
    ckpt.save(2, state, {"step": 2})
    ckpt.close()
    ckpt = checkpoint.Checkpointer(tmp_path / "dir", keep=2, local_directory=tmp_path / "local", local_every_steps=3)
    assert ckpt.restored_from is None and ckpt.restore_latest(target)[0] == 2
    ckpt.close()
    assert ckpt.restored_from == {"tier": "dir", "step": 2, "path": str(tmp_path / "dir")}


def test_start_phases_from_the_supervisors_times(tmp_path):
    ledger = tmp_path / "goodput.jsonl"
    ledger.write_text("".join(json.dumps({"event": "step", "attempt": 1, "t": t, "step": s, "step_s": 1.0}) + "\n"
                              for s, t in [(1, 100.0), (2, 101.0), (3, 109.0)]))
    env = {goodput.PREVIOUS_EXIT_AT_ENV: "105.0", goodput.LAUNCHED_AT_ENV: "106.0"}
    assert goodput.start_phases(110.0, ledger, env) == {"detection": 4.0, "restart_wait": 1.0, "process_start": 4.0}
    # A plain (unsupervised) start: the process's own start time, from the kernel.
    own = goodput.start_phases(goodput.process_start_time() + 3.0, ledger, {})
    assert set(own) == {"process_start"} and abs(own["process_start"] - 3.0) < 1e-6


def test_chaos_finds_the_straggler_lines_by_name():
    """scripts/chaos.py's straggler trial passes when process 0's log names process 1 (jaxtrain.hooks.Stragglers'
    lines, made here by the tracker itself), and only it."""
    import importlib.util
    from pathlib import Path

    from jaxtrain import hooks

    path = Path(__file__).resolve().parents[1] / "scripts" / "chaos.py"
    spec = importlib.util.spec_from_file_location("chaos_script", path)
    chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chaos)
    tracker, lines = hooks.Stragglers(factor=1.5), []
    for step in (5, 10, 15, 20):  # process 1 waits least and takes 3x as long: the others wait for it
        lines += tracker.add(step, {0: (0.3, 0.2), 1: (0.3, 0.0), 2: (0.3, 0.2)}, {0: "a", 1: "node-b", 2: "c"})
    lines += tracker.add(25, {0: (0.1, 0.0), 1: (0.1, 0.0), 2: (0.1, 0.0)}, {0: "a", 1: "node-b", 2: "c"})
    output = "\n".join(["step 5/300 | loss 5.1", *lines, "done"])
    assert chaos.stragglers_named(output) == [("node-b", 1)]  # the "is back under" line is no new naming
    assert chaos.stragglers_named("straggler: nothing") == []
