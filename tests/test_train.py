"""End-to-end `train.run`: bit-exact resume, finished runs, the metrics file.

Every run here logs every step (log.every_steps=1), which also fetches each step's metrics: on 8 fake CPU
devices sharing 2 cores, XLA's in-process collectives have been seen to deadlock when dozens of
collective programs are dispatched without a sync (jax 0.10.2), and these tests should not depend on that.
"""

import json
import math
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import read_jsonl, tree_digest
from jaxtrain import train

STEPS = 10
# Sharded over all three mesh axes, so that saving and restoring sharded arrays is part of the test.
RUN = {
    "train.steps": STEPS,
    "checkpoint.every_steps": 5,
    "eval.every_steps": 5,
    "log.every_steps": 1,
    "log.fingerprints": True,
    "mesh.data": 2,
    "mesh.fsdp": 2,
    "mesh.tensor": 2,
}


def run(cfg):
    lines = []
    summary = train.run(cfg, print_fn=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return summary, lines


@pytest.fixture(scope="module")
def straight(tiny_config):
    cfg = tiny_config(**RUN)
    summary, lines = run(cfg)
    return cfg, summary, lines


@pytest.fixture(scope="module")
def resumed(tiny_config):
    """The same run in two invocations: stop at step 5, then run the same config (stop_at off) again."""
    first_cfg = tiny_config(**RUN, **{"train.stop_at": 5})
    first, _ = run(first_cfg)
    cfg = tiny_config(workdir=first_cfg.workdir, **RUN)
    second, lines = run(cfg)
    return cfg, first, second, lines





def test_resume_is_bit_exact(straight, resumed):
    _, a, _ = straight
    cfg, first, b, lines = resumed
    assert first["finished"] is False and first["step"] == 5
    assert b["finished"] is True and b["step"] == STEPS and b["resumed"] is True
    assert any("resumed from checkpoint at step 5" in line for line in lines)
    assert a["finished"] is True and a["resumed"] is False

    leaves_a = jax.tree_util.tree_flatten_with_path(jax.device_get(a["state"]))[0]
    leaves_b = jax.tree_util.tree_flatten_with_path(jax.device_get(b["state"]))[0]
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    assert any("opt_state" in jax.tree_util.keystr(p) and "mu" in jax.tree_util.keystr(p) for p, _ in leaves_a)
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)
    assert int(b["state"]["step"]) == STEPS

    # The batches: every step's fingerprint, in both invocations of the resumed run, equals the straight run's.
    fa = read_jsonl(Path(straight[0].workdir) / "data_fingerprints.0.jsonl")
    fb = read_jsonl(Path(cfg.workdir) / "data_fingerprints.0.jsonl")
    assert [r["step"] for r in fa] == list(range(1, STEPS + 1))
    assert [r["step"] for r in fb] == list(range(1, STEPS + 1))  # steps 1-5, then 6-10 after the resume
    assert fa == fb
    assert len({r["fingerprint"] for r in fa}) == STEPS  # distinct batches: the check has teeth

    # Same params -> same held-out loss at step 10 (and at 5, in the first invocation).
    assert dict(a["eval"])[STEPS] == dict(b["eval"])[STEPS]
    assert dict(a["eval"])[5] == dict(first["eval"])[5]
    # The resumed invocation's summary holds the whole run's evals, the first invocation's included.
    assert [s for s, _ in first["eval"]][-1] == 5 and b["eval"] == a["eval"]
    for run_dir in (straight[0].workdir, cfg.workdir):
        assert {"5", "10"} <= set(os.listdir(Path(run_dir) / "checkpoints"))


def test_rerunning_a_finished_run_changes_nothing(straight, tmp_path):
    cfg, _, _ = straight
    workdir = tmp_path / "finished"
    shutil.copytree(cfg.workdir, workdir)
    before = tree_digest(workdir)
    again = cfg.copy_and_resolve_references()
    again.workdir = str(workdir)

    t = time.perf_counter()
    summary, lines = run(again)
    elapsed = time.perf_counter() - t
    assert summary["finished"] is True and summary["step"] == STEPS
    assert "state" not in summary  # nothing was restored or trained
    assert any("already finished" in line for line in lines)
    assert not any(line.startswith(("compiled", "step ", "eval ")) for line in lines), lines
    assert elapsed < 30, elapsed  # no compile, no restore: seconds (generous for a loaded CI machine)

    after = tree_digest(workdir)
    # Checkpoints, metrics, fingerprints and summary are byte-identical. (TensorBoard's writer may start
    # a new, empty-of-scalars events file; that is all that may appear.)
    changed = {k for k in before if after.get(k) != before[k]}
    added = set(after) - set(before)
    assert not changed, changed
    assert all(k.startswith("tensorboard" + os.sep) for k in added), added


def test_metrics_file(straight):
    cfg, summary, _ = straight
    workdir = Path(cfg.workdir)
    records = read_jsonl(workdir / "metrics.jsonl")
    train_records = [r for r in records if "loss" in r]
    eval_records = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, STEPS + 1))
    for r in train_records:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu"):
            assert key in r, (key, r)
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1
    # lr of step k is schedule(k - 1): warmup over 2 steps to 3e-3 (tiny config), then cosine decay.
    np.testing.assert_allclose([r["lr"] for r in train_records[:3]], [0.0, 1.5e-3, 3e-3], rtol=1e-6)
    assert [r["step"] for r in eval_records] == [0, 5, 10]  # eval.at_start, then every 5 steps
    assert all(math.isfinite(r["eval_loss"]) for r in eval_records)
    assert [(r["step"], r["eval_loss"]) for r in eval_records] == [tuple(e) for e in summary["eval"]]
    assert train_records[-1]["loss"] < train_records[0]["loss"]

    events = list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    saved = json.loads((workdir / "summary.json").read_text())
    assert saved["finished"] is True and saved["step"] == STEPS
    assert {p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()} == {"5", "10"}
