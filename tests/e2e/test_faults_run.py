"""Faults injected into real (tiny) runs: non-finite losses under each faults.nan_policy, bad input at
start, and SIGKILL at an arbitrary step. Unit-level fault tests live in test_faults.py and
test_checkpoint_faults.py."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import install_poison, read_jsonl, tree_digest
from jaxtrain import checkpoint, config as config_lib, errors, files, train
from jaxtrain.data import pipeline
from jaxtrain import trainer as trainer_lib

REPO = Path(__file__).resolve().parents[2]
BAD_STEP = 7


def quiet(*args, **kwargs):
    pass



@pytest.fixture
def poison_step(monkeypatch):
    """The batch of step BAD_STEP makes the loss (and so every gradient) NaN, as a corrupt record would."""
    install_poison(monkeypatch.setattr, BAD_STEP)


def finite_tree(tree):
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(jax.device_get(tree)))


RUN = {"train.steps": 10, "checkpoint.every_steps": 5, "log.fingerprints": True}


def test_nan_halt_stops_without_applying_or_saving_it(tiny_config, poison_step):
    cfg = tiny_config(**RUN, **{"faults.nan_policy": "halt"})
    with pytest.raises(errors.NonFiniteLoss, match=f"step {BAD_STEP}.*nan_policy=halt"):
        train.run(cfg, print_fn=quiet)
    steps = sorted(int(d) for d in os.listdir(Path(cfg.workdir) / "checkpoints") if d.isdigit())
    assert steps == [5]  # saved before the bad step; nothing after it


def test_nan_skip_drops_one_update_and_trains_on(tiny_config, poison_step):
    lines = []
    cfg = tiny_config(**RUN, **{"faults.nan_policy": "skip"})
    summary = train.run(cfg, print_fn=lines.append)
    assert summary["finished"] and finite_tree(summary["state"])
    assert any(f"non-finite loss or gradient at step {BAD_STEP}" in line and "skipped" in line for line in lines)
    metrics = {r["step"]: r for r in read_jsonl(Path(cfg.workdir) / "metrics.jsonl") if "loss" in r}
    assert metrics[BAD_STEP]["skipped_steps"] == 1 and metrics[BAD_STEP]["loss"] is None
    assert sum(r["skipped_steps"] for r in metrics.values()) == 1
    # Adam's count advanced on every step but the skipped one.
    counts = [int(x) for x in jax.tree.leaves(summary["state"]["opt_state"]) if np.ndim(x) == 0]
    assert RUN["train.steps"] - 1 in counts


def test_nan_rollback_restores_and_skips_the_bad_window(tiny_config, poison_step):
    lines = []
    cfg = tiny_config(**RUN, **{"faults.nan_policy": "rollback", "eval.every_steps": 3})
    summary = train.run(cfg, print_fn=lines.append)
    assert summary["finished"] and summary["step"] == 10 and finite_tree(summary["state"])
    assert any("rolled back to step 5" in line for line in lines), "\n".join(lines)
    # Step 6 was evaluated before the rollback and again after it: the summary keeps the second only, as the
    # metrics log's final lineage does.
    evals = [(r["step"], r["eval_loss"]) for r in read_jsonl(Path(cfg.workdir) / "metrics.jsonl") if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 3, 6, 6, 9, 10] and evals[2] != evals[3]
    assert [tuple(e) for e in summary["eval"]] == [*evals[:2], *evals[3:]]
    # The guard reads step 7's flag after step 8 was dispatched (it never stalls the pipeline), so the
    # skipped window is batches 6..8; after the rollback, steps 6..10 train on batches 9..13.
    it = pipeline.train_iterator(cfg.data.dir, seq_len=cfg.train.seq_len, global_batch=cfg.train.batch_size, seed=0)
    batches = [pipeline.tokens_per_batch_fingerprint(next(it)) for _ in range(13)]
    seen = [(r["step"], r["fingerprint"]) for r in read_jsonl(Path(cfg.workdir) / "data_fingerprints.0.jsonl")]
    assert [s for s, _ in seen] == [*range(1, BAD_STEP + 1), *range(6, 11)]
    assert [f for _, f in seen[:BAD_STEP]] == batches[:BAD_STEP]  # the marker is not in the tokens
    assert [f for _, f in seen[BAD_STEP:]] == batches[8:13]
    # Every checkpoint is finite.
    facts = config_lib.validate(cfg, jax.device_count())
    abstract = trainer_lib.build_trainer(cfg, facts).abstract_state
    ckpt = checkpoint.Checkpointer(Path(cfg.workdir) / "checkpoints", keep=3)
    for s in (5, 10):
        state, _ = ckpt.restore(s, abstract)
        assert finite_tree(state)
    ckpt.close()




# One schedule for the set-aside drills, so that one uninterrupted run is the reference of both. Checkpoints every
# 3 steps: 3, 6, 9 (and 10 at the end); keep=3.
SET_ASIDE = {"train.steps": 10, "checkpoint.every_steps": 3, "checkpoint.keep": 3, "eval.every_steps": 0}


@pytest.fixture(scope="module")
def straight(tiny_config):
    """The final state checksum of an uninterrupted SET_ASIDE run."""
    return train.run(tiny_config(**SET_ASIDE), print_fn=quiet)["state_checksum"]


def test_swapped_and_copied_step_dirs_are_set_aside_and_the_run_ends_bit_identical(tiny_config, straight):
    """Checkpoints 3, 6, 9; then 6 and 9 swapped and (true) 9 copied to 21, by hand or a sync tool. Each step
    dir that holds another step's checkpoint is moved aside, not restored and not deleted: the run resumes from 3,
    the last true step, and ends where an uninterrupted run ends."""
    # keep=3: retention runs (it deleted the true step 20's directory in the original report), and must not touch
    # what was moved aside.
    cfg = tiny_config(**SET_ASIDE, **{"train.stop_at": 9})
    train.run(cfg, print_fn=quiet)
    root = Path(cfg.workdir) / "checkpoints"
    shutil.copytree(root / "9", root / "21")
    (root / "9").rename(root / "swap")
    (root / "6").rename(root / "9")
    (root / "swap").rename(root / "6")
    misplaced = [tree_digest(root / name) for name in ("6", "9", "21")]

    lines = []
    summary = train.run(tiny_config(workdir=cfg.workdir, **SET_ASIDE), print_fn=lines.append)
    for step, holds in ((6, 9), (9, 6), (21, 9)):
        assert any(line.startswith(f"checkpoint step {step} in {root} is not this run's: it holds the checkpoint of "
                                   f"step {holds}, not {step}") and f"moved aside to {root}/{step}.corrupt-" in line
                   for line in lines), lines
    assert "resumed from checkpoint at step 3" in lines
    assert summary["finished"] and summary["state_checksum"] == straight
    kept = [tree_digest(p) for p in root.glob("*.corrupt-*")]  # the moved-aside dirs, every byte of them
    assert len(kept) == 3 and all(digest in kept for digest in misplaced)
    assert sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) == [6, 9, 10]  # 3 retired


def test_a_step_dir_copied_from_another_run_is_set_aside_and_the_run_ends_bit_identical(tiny_config, straight):
    """Another run's step 10 (same model, another seed) copied into a run stopped at 3: its integrity record names
    step 10, as the directory does, but not this workdir's run id. Without that check the run would call itself
    finished at 10 with the other run's weights."""
    other = tiny_config(**SET_ASIDE, **{"train.seed": 7})
    train.run(other, print_fn=quiet)
    cfg = tiny_config(**SET_ASIDE, **{"train.stop_at": 3})
    train.run(cfg, print_fn=quiet)
    root = Path(cfg.workdir) / "checkpoints"
    shutil.copytree(Path(other.workdir) / "checkpoints" / "10", root / "10")
    lines = []
    summary = train.run(tiny_config(workdir=cfg.workdir, **SET_ASIDE), print_fn=lines.append)
    assert any(line.startswith(f"checkpoint step 10 in {root} is not this run's: it holds a checkpoint of another "
                               f"run") for line in lines), lines
    assert "resumed from checkpoint at step 3" in lines
    assert summary["finished"] and summary["state_checksum"] == straight
    assert [tree_digest(p) for p in root.glob("10.corrupt-*")] == [tree_digest(Path(other.workdir) / "checkpoints" /
                                                                               "10")]


def test_missing_absolute_workdir_parent_is_refused(tiny_config, tmp_path):
    cfg = tiny_config(workdir=tmp_path / "not-mounted" / "run")
    with pytest.raises(config_lib.ConfigError, match="^workdir: parent directory .*not-mounted does not exist"):
        train.run(cfg, print_fn=quiet)
    assert not (tmp_path / "not-mounted").exists()


@pytest.fixture(scope="module")
def stopped_at_5(tiny_config):
    """The workdir of a 10-step run stopped at 5, to copy: the refusals below each run against their own copy."""
    cfg = tiny_config(**{"train.steps": 10, "train.stop_at": 5})
    train.run(cfg, print_fn=quiet)
    return Path(cfg.workdir)


@pytest.mark.parametrize("field, value", [("model.d_model", 64), ("train.seed", 1), ("model.n_layers", 3)])
def test_incompatible_config_change_is_refused_and_nothing_changes(tiny_config, stopped_at_5, tmp_path, field,
                                                                   value):
    workdir = tmp_path / "run"
    shutil.copytree(stopped_at_5, workdir)
    before = tree_digest(workdir)
    changed = tiny_config(workdir=workdir, **{"train.steps": 10, field: value})
    with pytest.raises(config_lib.ConfigError, match=f"^{field}: is {value} but the checkpoints in .* were made "
                       f"with"):
        train.run(changed, print_fn=quiet)
    assert tree_digest(workdir) == before


def test_checkpoint_from_another_model_is_refused_by_name(tiny_config, stopped_at_5, tmp_path):
    copied = tmp_path / "copied"  # checkpoints without the workdir's config.json, e.g. copied by hand
    copied.mkdir()
    shutil.copytree(stopped_at_5 / "checkpoints", copied / "checkpoints")
    before = tree_digest(copied)
    other = tiny_config(workdir=copied, **{"train.steps": 10, "model.d_ff": 128})
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"does not match .*mlp.*saved \(\(2, 32, 64\)"):
        train.run(other, print_fn=quiet)
    assert {k: v for k, v in tree_digest(copied).items() if k.startswith("checkpoints")} == before


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_checkpoint_write_failure_policy(tiny_config, monkeypatch, policy):
    """The step-10 save fails once. "stop" raises (exit 4) and keeps step 5; "continue" warns and the
    final save at the end of the run retries and commits."""
    real_save, failed = checkpoint.Checkpointer.save, []

    def save(self, step, state, data_state):
        if step == 10 and not failed:
            failed.append(step)
            raise checkpoint.CheckpointError("simulated: no space left on device")
        return real_save(self, step, state, data_state)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    lines = []
    cfg = tiny_config(**{"train.steps": 12, "checkpoint.every_steps": 5, "checkpoint.on_write_error": policy})
    ckpt_dir = Path(cfg.workdir) / "checkpoints"
    if policy == "stop":
        with pytest.raises(checkpoint.CheckpointError, match="no space left"):
            train.run(cfg, print_fn=lines.append)
        assert sorted(d for d in os.listdir(ckpt_dir) if d.isdigit()) == ["5"]
    else:
        summary = train.run(cfg, print_fn=lines.append)
        assert summary["finished"]
        assert any("warning: simulated: no space left" in line for line in lines), lines
        assert sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) == [5, 12]


def wait_for(predicate, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.01)
    raise TimeoutError


def children(pid):
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def logged_step(workdir):
    path = Path(workdir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if '"loss"' in line), default=0)


# 60 steps, checkpoints every 20, killed at step 27 or later: some steps since the last checkpoint are lost and
# redone, as at any step but a checkpoint's (13 steps of margin before the next one).
KILL_STEPS, KILL_EVERY, KILL_AFTER = 60, 20, 27


@pytest.mark.slow
def test_sigkill_at_an_arbitrary_step_under_the_supervisor_is_bit_identical(tiny_data_dir, tmp_path):
    overrides = {"workdir": None, "data.dir": tiny_data_dir, "train.steps": KILL_STEPS,
                 "checkpoint.every_steps": KILL_EVERY, "eval.every_steps": 0, "log.fingerprints": True}

    def command(workdir):
        return [sys.executable, "-m", "jaxtrain.main", "--config", str(REPO / "configs/tiny.py"),
                *(f"--config.{k}={workdir if k == 'workdir' else v}" for k, v in overrides.items())]

    reference = tmp_path / "reference"
    ref = subprocess.Popen(command(reference), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: logged_step(reference) >= 1, ref)
        os.kill(ref.pid, signal.SIGSTOP)  # it holds the workdir, mid-run, for as long as the checks below take
        try:
            # A relaunch onto a workdir in use (a SLURM requeue, a second supervisor) stops at once, touching nothing.
            before = tree_digest(reference)
            for second in (command(reference), [sys.executable, "-m", "jaxtrain", "supervise", "--workdir",
                                                str(reference), "--", *command(reference)]):
                proc = subprocess.run(second, cwd=REPO, capture_output=True, text=True, timeout=300)
                (line,) = proc.stderr.splitlines()
                assert proc.returncode == 2 and line.startswith(
                    f"error: workdir: {reference} is in use by another run (pid {ref.pid} on {socket.gethostname()}, "
                    f"since ") and line.endswith("or use another workdir"), proc.stderr[-2000:]
            assert tree_digest(reference) == before
        finally:
            os.kill(ref.pid, signal.SIGCONT)
        assert ref.wait(timeout=300) == 0, ref.communicate()[0][-3000:]
    finally:
        ref.kill()
    # The lock went with its holder. (In this process: the same config and checks as the command, without
    # another interpreter's start.)
    config = files.run_python_file(REPO / "configs/tiny.py", "get_config", field="--config")
    config.update_from_flattened_dict({**overrides, "workdir": str(reference)})
    again = []
    assert train.run(config, print_fn=again.append) == {"finished": True, "step": KILL_STEPS, "resumed": True}
    assert any("run already finished" in line for line in again), again

    workdir = tmp_path / "killed"
    sup = subprocess.Popen([sys.executable, "-m", "jaxtrain", "supervise", "--workdir", str(workdir), "--backoff_s",
                            "0.1", "--", *command(workdir)], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: logged_step(workdir) >= KILL_AFTER, sup)
        killed_at = logged_step(workdir)
        os.kill(children(sup.pid)[0], signal.SIGKILL)  # the supervisor holds the workdir's lock for the next child
        out = sup.communicate(timeout=300)[0]
    finally:
        sup.kill()
    assert sup.returncode == 0, out[-3000:]

    # Params and optimizer state: the checksum of every array equals the uninterrupted run's.
    ours, theirs = (json.loads((d / "summary.json").read_text()) for d in (workdir, reference))
    assert ours["finished"] and ours["state_checksum"] == theirs["state_checksum"]
    # Data: every batch trained on, before and after the kill, is the one the reference saw at that step.
    ref = {r["step"]: r["fingerprint"] for r in read_jsonl(reference / "data_fingerprints.0.jsonl")}
    seen = read_jsonl(workdir / "data_fingerprints.0.jsonl")
    assert all(r["fingerprint"] == ref[r["step"]] for r in seen) and len(seen) > KILL_STEPS  # some steps ran twice
    assert {r["step"] for r in seen} == set(range(1, KILL_STEPS + 1))

    # The supervisor restarted once after the crash and counted the recomputed steps as badput.
    report = json.loads((workdir / "supervisor.json").read_text())
    assert [a["kind"] for a in report["attempts"]] == ["crash", "done"]
    assert report["restarts"] == {"preempt": 0, "crash": 1}
    resumed_from = KILL_EVERY * (killed_at // KILL_EVERY)
    assert report["goodput"]["steps_lost"] >= killed_at - resumed_from
    assert 0 < report["goodput"]["goodput"] < 1


def test_preemption_save_reaches_the_persistent_directory_with_a_local_tier(tiny_config, tmp_path, monkeypatch):
    """SIGTERM in a single process: the step is saved and the run stops with Preempted. Every step goes to the
    local tier here, so the preemption save must still write the persistent copy."""
    original_next = pipeline.TrainIterator.__next__

    def next_with_sigterm(self):
        if self.next_token == 3 * self.global_batch * self.seq_len:  # while fetching step 4's batch
            os.kill(os.getpid(), signal.SIGTERM)
        return original_next(self)

    monkeypatch.setattr(pipeline.TrainIterator, "__next__", next_with_sigterm)
    cfg = tiny_config(**{"train.steps": 10, "checkpoint.every_steps": 50, "checkpoint.local_dir": str(tmp_path / "local"),
                         "checkpoint.local_every_steps": 1})
    with pytest.raises(errors.Preempted) as preempted:
        train.run(cfg, print_fn=quiet)
    step = preempted.value.step
    assert step == 4
    assert str(step) in os.listdir(Path(cfg.workdir) / "checkpoints")  # the persistent copy
    assert str(step) in os.listdir(tmp_path / "local")
    resumed = train.run(tiny_config(workdir=cfg.workdir, **{"train.steps": 10, "checkpoint.every_steps": 50}),
                        print_fn=quiet)
    assert resumed["finished"] and resumed["resumed"]
