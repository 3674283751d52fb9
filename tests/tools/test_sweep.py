"""jaxtrain.tools.sweep: sweep files, budget and resume, pruning, workers, results, and bad input (exit 2).

Most tests stand a fake trainer in for `train.run` (it logs eval_loss as a function of the learning rate
and "checkpoints" its step to a file), so the sweep's own logic runs in milliseconds; the tests named
`*_real*` and the CLI tests train the tiny model for a few steps per trial.
"""

import json
import math
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
from helpers import cpu_flags, read_jsonl
from optuna.trial import TrialState

from jaxtrain import train
from jaxtrain.config import ConfigError
from jaxtrain.errors import SweepError
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.tools import sweep
from jaxtrain.tools.sweep import spec as sweep_spec
from jaxtrain.tools.sweep import study as sweep_study
from jaxtrain.tools.sweep import trials as sweep_trials

REPO = Path(__file__).resolve().parents[2]


# ===== A fake trainer ===================================================================================

def fake_loss(lr, step):
    """Lower for lr near 3e-3, and falling with the step."""
    return 2.0 + abs(math.log10(lr) + 2.5) + 1.0 / (1 + step)


class FakeTrain:
    """train.run's contract in miniature: resumes from its workdir, writes metrics.jsonl and feeds `writers`."""

    def __init__(self, fail_lr=None, interrupt_at=None):
        self.calls, self.fail_lr, self.interrupt_at = [], fail_lr, interrupt_at

    def __call__(self, config, print_fn=print, writers=()):
        workdir = Path(config.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        marker = workdir / "fake_checkpoint"
        start = int(marker.read_text()) if marker.exists() else 0
        self.calls.append({"workdir": workdir, "lr": config.optim.lr, "start": start})
        if config.optim.lr == self.fail_lr:
            raise ConfigError("optim.lr", "rejected by the fake trainer")
        writer = metrics_lib.MultiWriter([metrics_lib.JsonlWriter(workdir / "metrics.jsonl"), *writers])
        steps, every = config.train.steps, config.eval.every_steps
        try:
            for step in range(start, steps + 1):
                if step % every == 0 or step == steps:
                    writer.write_scalars(step, {"eval_loss": fake_loss(config.optim.lr, step)})
                if step == self.interrupt_at:
                    raise KeyboardInterrupt
                marker.write_text(str(step))
        finally:
            writer.close()
        return {"finished": True, "step": steps, "resumed": start > 0}


@pytest.fixture
def fake_train(monkeypatch):
    fake = FakeTrain()
    monkeypatch.setattr(train, "run", fake)
    return fake


def quiet(*args):
    pass


def states(study):
    return [t.state for t in sorted(study.get_trials(), key=lambda t: t.number)]


def load_study(sweep_dir, name):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return optuna.load_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(sweep_dir / "study.journal"))))


# ===== Sweep files ======================================================================================

def write_sweep(path, body):
    path.write_text(textwrap.dedent(body))
    return path


def recipe(name):
    """configs/<name>.py's get_config() (configs/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", REPO / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_sample_sweep_files_load_and_check():
    for config in (recipe("tiny"), recipe("default")):
        for name in ("lr_grid", "tpe"):
            spec = sweep_spec.load(REPO / "configs" / "sweeps" / f"{name}.py")
            sweep_spec.check(config, spec)
    grid = sweep_spec.load(REPO / "configs" / "sweeps" / "lr_grid.py")
    assert (grid.sampler, grid.trials, grid.space["optim.lr"].choices) == ("grid", 3, (1e-3, 3e-3, 1e-2))
    tpe = sweep_spec.load(REPO / "configs" / "sweeps" / "tpe.py", trials=4)
    assert (tpe.sampler, tpe.pruner, tpe.trials) == ("tpe", "median", 4)


BAD_SPECS = {
    "unknown_path": ({"space": {"optim.lrr": [1e-3]}, "sampler": "grid"}, "space.optim.lrr: unknown config path"),
    "group_path": ({"space": {"optim": [1]}, "sampler": "grid"}, "space.optim: is a group"),
    "workdir": ({"space": {"workdir": ["a", "b"]}, "sampler": "grid"}, "space.workdir: set by the sweep"),
    "empty_space": ({"space": {}, "sampler": "grid"}, "space: empty"),
    "bounds": ({"space": {"optim.lr": sweep.loguniform(1e-2, 1e-4)}, "trials": 2}, "low must be < high"),
    "log_nonpositive": ({"space": {"optim.lr": sweep.loguniform(0.0, 1e-2)}, "trials": 2}, "log scale needs low > 0"),
    "int_bounds": ({"space": {"optim.warmup_steps": sweep.integer(0, 2.5)}, "trials": 2}, "high must be a finite integer"),
    "sampler": ({"space": {"optim.lr": [1e-3]}, "sampler": "bayes"}, "sampler: unknown value 'bayes'"),
    "pruner": ({"space": {"optim.lr": [1e-3]}, "sampler": "grid", "pruner": "asha"}, "pruner: unknown value"),
    "pruner_args": ({"space": {"optim.lr": [1e-3]}, "sampler": "grid", "pruner": "median",
                     "pruner_args": {"n_startup": 1}}, "pruner_args:"),
    "budget": ({"space": {"optim.lr": sweep.loguniform(1e-4, 1e-2)}, "trials": 0}, "trials: must be an integer >= 1"),
    "no_budget": ({"space": {"optim.lr": sweep.loguniform(1e-4, 1e-2)}}, "trials: required"),
    "grid_continuous": ({"space": {"optim.lr": sweep.loguniform(1e-4, 1e-2)}, "sampler": "grid"},
                        "space.optim.lr: the grid sampler needs discrete values"),
    "unknown_key": ({"space": {"optim.lr": [1e-3]}, "budget": 3}, "budget: unknown key"),
    "type": ({"space": {"optim.warmup_steps": [1.5]}, "sampler": "grid"}, "space.optim.warmup_steps: 1.5 does not fit"),
    # every grid point is validated: warmup 30 > train.steps (tiny: 20)
    "grid_validation": ({"space": {"optim.warmup_steps": [0, 30]}, "sampler": "grid"},
                        "space.optim.warmup_steps: optim.warmup_steps=30 fails the config's validation"),
    # random/tpe: the bounds' extremes are validated
    "bound_validation": ({"space": {"optim.b1": sweep.uniform(0.5, 1.5)}, "trials": 3, "sampler": "random"},
                         "space.optim.b1: optim.b1=1.5 fails"),
    "categorical_validation": ({"space": {"optim.schedule": ["cosine", "exp"]}, "trials": 3},
                               "space.optim.schedule: optim.schedule='exp' fails"),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_sweep_rejected_with_the_field(case, tmp_path):
    raw, message = BAD_SPECS[case]
    with pytest.raises(ConfigError) as e:
        sweep_spec.check(recipe("tiny"), sweep_spec.load(raw))
    assert message in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_bad_sweep_files(tmp_path):
    with pytest.raises(SweepError, match="file not found"):
        sweep_spec.load(tmp_path / "missing.py")
    with pytest.raises(SweepError, match=r"no get_sweep\(\) function"):
        sweep_spec.load(write_sweep(tmp_path / "s.py", "def get_config():\n    return {}\n"))
    with pytest.raises(SweepError, match="must return a dict"):
        sweep_spec.load(write_sweep(tmp_path / "s2.py", "def get_sweep():\n    return 3\n"))
    with pytest.raises(SweepError, match="SyntaxError"):
        sweep_spec.load(write_sweep(tmp_path / "s3.py", "def get_sweep(:\n"))


def test_sweep_file_forms(tmp_path):
    """Nested space dicts, a ConfigDict, and grid sizes (trials capped at the grid)."""
    import ml_collections

    spec = sweep_spec.load({"space": {"optim": {"lr": [1e-3, 2e-3], "warmup_steps": sweep.integer(0, 4, step=2)}},
                       "sampler": "grid", "trials": 100})
    assert list(spec.space) == ["optim.lr", "optim.warmup_steps"] and spec.trials == 6
    assert spec.grid_points()[:2] == [{"optim.lr": 1e-3, "optim.warmup_steps": 0},
                                      {"optim.lr": 1e-3, "optim.warmup_steps": 2}]
    assert sweep.uniform(0.0, 0.3, step=0.1).grid() == [0.0, 0.1, 0.2, 0.3]
    c = ml_collections.ConfigDict({"space": {"model": {"d_ff": [64, 128]}}, "sampler": "grid"})
    assert sweep_spec.load(c).space["model.d_ff"].choices == (64, 128)


def test_storage_urls_are_redacted():
    shown = sweep_study.describe_storage(Path("x"), "postgresql://alice:s3cret@db.example:5432/optuna")
    assert "s3cret" not in shown and "alice" in shown


# ===== The sweep, with the fake trainer =================================================================

def test_random_sweep_resumes_without_redoing_trials(tiny_config, fake_train, tmp_path):
    config = tiny_config(**{"train.steps": 4, "eval.every_steps": 2})
    spec = {"space": {"optim.lr": sweep.loguniform(1e-4, 1e-1), "optim.warmup_steps": sweep.integer(0, 3)},
            "sampler": "random", "trials": 2, "seed": 1, "name": "rand"}
    first = sweep.run(config, spec, tmp_path / "sw", print_fn=quiet)
    assert len(fake_train.calls) == 2 and [r["state"] for r in first["rows"]] == ["complete", "complete"]

    lines = []
    again = sweep.run(config, spec, tmp_path / "sw", trials=3, print_fn=lines.append)  # the budget grows by one
    assert len(fake_train.calls) == 3 and fake_train.calls[-1]["workdir"] == tmp_path / "sw" / "trial_0002"
    assert any(line.startswith("[3/3] trial 2 complete eval_loss") for line in lines), lines
    rows = again["rows"]
    assert sorted(r["trial"] for r in rows) == [0, 1, 2]
    values = [r["objective"] for r in rows]
    assert values == sorted(values)  # best first
    drawn = {r["optim.lr"] for r in rows}
    assert len(drawn) == 3 and all(1e-4 <= lr <= 1e-1 for lr in drawn)  # a rerun does not repeat a draw
    for r in rows:
        history = {rec["step"]: rec["eval_loss"] for rec in read_jsonl(Path(r["workdir"]) / "metrics.jsonl")}
        assert r["objective"] == history[4] == fake_loss(r["optim.lr"], 4)
    assert again["best"] == rows[0]

    sweep.run(config, spec, tmp_path / "sw", trials=3, print_fn=quiet)  # nothing left to do
    assert len(fake_train.calls) == 3


def test_trial_left_running_by_a_killed_worker_is_retried_in_its_workdir(tiny_config, fake_train, tmp_path):
    config = tiny_config(**{"train.steps": 6, "eval.every_steps": 2})
    spec = sweep_spec.load({"space": {"optim.lr": [1e-3, 1e-2]}, "sampler": "grid", "name": "kill"})
    sweep_dir = tmp_path / "sw"
    sweep_dir.mkdir()
    # What a worker killed mid-trial leaves: a RUNNING trial owned by a dead pid, and a workdir with a
    # checkpoint at step 3 and metrics up to step 4 (logged after that checkpoint).
    study = sweep_study.open_study(spec, config, sweep_dir)
    trial, params = sweep_study.claim(study, spec, sweep_dir)
    dead = subprocess.Popen(["true"])
    dead.wait()
    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}")
    with pytest.raises(KeyboardInterrupt):  # "checkpoints" step 3, logs step 4's eval, then dies
        FakeTrain(interrupt_at=4)(sweep_spec.trial_config(config, params, sweep_dir / "trial_0000"))

    results = sweep.run(config, spec, sweep_dir, print_fn=quiet)
    assert [c["workdir"].name for c in fake_train.calls] == ["trial_0000", "trial_0002"]
    assert fake_train.calls[0]["start"] == 3 and fake_train.calls[0]["lr"] == 1e-3  # resumed, same values
    study = load_study(sweep_dir, "kill")
    assert states(study) == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    retry = study.trials[1]
    assert retry.user_attrs["workdir"] == "trial_0000" and retry.user_attrs["retry_of"] == 0
    assert retry.value == fake_loss(1e-3, 6)
    assert retry.intermediate_values == {s: fake_loss(1e-3, s) for s in (0, 2, 4, 6)}  # earlier evals kept
    rows = {r["trial"]: r for r in results["rows"]}
    assert rows[0]["state"] == "interrupted" and rows[0]["note"] == "retried as trial 1"
    assert {rows[1]["optim.lr"], rows[2]["optim.lr"]} == {1e-3, 1e-2}  # the grid is done, nothing twice


def test_interrupted_trial_is_retried_by_the_next_run(tiny_config, monkeypatch, tmp_path):
    config = tiny_config(**{"train.steps": 4, "eval.every_steps": 2})
    spec = {"space": {"optim.lr": [1e-3]}, "sampler": "grid", "name": "intr"}
    monkeypatch.setattr(train, "run", FakeTrain(interrupt_at=2))
    with pytest.raises(KeyboardInterrupt):
        sweep.run(config, spec, tmp_path / "sw", print_fn=quiet)
    fake = FakeTrain()
    monkeypatch.setattr(train, "run", fake)
    sweep.run(config, spec, tmp_path / "sw", print_fn=quiet)
    assert [(c["workdir"].name, c["start"]) for c in fake.calls] == [("trial_0000", 1)]
    assert states(load_study(tmp_path / "sw", "intr")) == [TrialState.FAIL, TrialState.COMPLETE]


def test_failed_trial_is_recorded_and_the_sweep_goes_on(tiny_config, monkeypatch, tmp_path):
    monkeypatch.setattr(train, "run", FakeTrain(fail_lr=1e-2))
    spec = {"space": {"optim.lr": [1e-2, 1e-3]}, "sampler": "grid"}
    results = sweep.run(tiny_config(), spec, tmp_path / "sw", print_fn=quiet)
    rows = {r["trial"]: r for r in results["rows"]}
    assert rows[0]["state"] == "fail" and rows[0]["note"] == "optim.lr: rejected by the fake trainer"
    assert rows[1]["state"] == "complete" and results["best"]["trial"] == 1
    assert [r["trial"] for r in results["rows"]] == [1, 0]  # trials without a value last
    assert "rejected by the fake trainer" in (tmp_path / "sw" / "results.md").read_text()
    # failures count toward the budget: a rerun does not try them again
    sweep.run(tiny_config(), spec, tmp_path / "sw", print_fn=quiet)
    assert len(train.run.calls) == 2


def test_changed_sweep_is_refused(tiny_config, fake_train, tmp_path):
    config = tiny_config(**{"train.steps": 2, "eval.every_steps": 2})
    sweep.run(config, {"space": {"optim.lr": [1e-3]}, "sampler": "grid", "name": "s"}, tmp_path / "sw", print_fn=quiet)
    with pytest.raises(SweepError, match="different sweep.space"):
        sweep.run(config, {"space": {"optim.lr": [1e-2]}, "sampler": "grid", "name": "s"}, tmp_path / "sw",
                  print_fn=quiet)
    config.optim.b1 = 0.8
    with pytest.raises(SweepError, match="different config.optim.b1"):
        sweep.run(config, {"space": {"optim.lr": [1e-3]}, "sampler": "grid", "name": "s"}, tmp_path / "sw",
                  print_fn=quiet)


def test_tpe_with_median_pruner_and_rdb_storage(tiny_config, fake_train, tmp_path):
    """TPE suggestions stay in bounds; the median pruner stops trials whose eval_loss is worse than the
    earlier trials' median at the same step; an sqlite URL works as --storage."""
    config = tiny_config(**{"train.steps": 8, "eval.every_steps": 2})
    spec = {"space": {"optim.lr": sweep.loguniform(1e-5, 1e-1), "optim.weight_decay": sweep.uniform(0.0, 0.3)},
            "sampler": "tpe", "sampler_args": {"n_startup_trials": 2}, "trials": 6, "pruner": "median",
            "pruner_args": {"n_startup_trials": 2, "n_warmup_steps": 1}, "name": "tpe"}
    results = sweep.run(config, spec, tmp_path / "sw", storage=f"sqlite:///{tmp_path}/study.db", print_fn=quiet)
    assert not (tmp_path / "sw" / "study.journal").exists()
    rows = results["rows"]
    assert len(rows) == 6 and all(1e-5 <= r["optim.lr"] <= 1e-1 for r in rows)
    for r in rows:
        if r["state"] == "pruned":
            history = {rec["step"]: rec["eval_loss"] for rec in read_jsonl(Path(r["workdir"]) / "metrics.jsonl")}
            assert r["objective"] == history[max(history)] and max(history) < 8  # its last value
    assert results["best"]["state"] == "complete"


def test_pruning_writer_with_a_fake_trial():
    class Trial:
        def __init__(self, prune_after):
            self.reports, self.prune_after = [], prune_after

        def report(self, value, step):
            self.reports.append((step, value))

        def should_prune(self):
            return len(self.reports) >= self.prune_after

    trial = Trial(prune_after=2)
    writer = sweep_trials.PruningWriter(trial, "eval_loss", reported={0})
    writer.write_scalars(0, {"eval_loss": 5.0})  # a retry: step 0 was reported before
    writer.write_scalars(1, {"loss": 4.0, "lr": 1e-3})  # train records: not the metric
    writer.write_scalars(2, {"eval_loss": 4.5, "eval_loss/other": 9.0})
    with pytest.raises(optuna.TrialPruned, match="pruned at step 4"):
        writer.write_scalars(4, {"eval_loss": 4.25})
    assert trial.reports == [(2, 4.5), (4, 4.25)]


# ===== Real training ====================================================================================

def test_grid_sweep_real_with_pruning(tiny_config, tmp_path):
    """Two learning rates, really trained: lr 1e-2 completes; lr 1e-5 still has its initial eval_loss at step 2,
    worse than trial 0 there, so the median pruner stops it. Each objective is that trial's last eval_loss."""
    config = tiny_config(**{"train.steps": 4, "eval.every_steps": 2, "checkpoint.every_steps": 2,
                            "optim.warmup_steps": 0, "model.n_layers": 1})
    spec = {"space": {"optim.lr": [1e-2, 1e-5]}, "sampler": "grid", "pruner": "median",
            "pruner_args": {"n_startup_trials": 1, "n_warmup_steps": 1}, "name": "real"}
    lines = []
    results = sweep.run(config, spec, tmp_path / "sw", print_fn=lines.append)
    rows = {r["optim.lr"]: r for r in results["rows"]}
    assert set(rows) == {1e-2, 1e-5}
    assert rows[1e-2]["state"] == "complete" and rows[1e-5]["state"] == "pruned", lines
    for r in rows.values():
        workdir = Path(r["workdir"])
        evals = [rec for rec in read_jsonl(workdir / "metrics.jsonl") if "eval_loss" in rec]
        assert r["objective"] == evals[-1]["eval_loss"]
        assert (workdir / "config.json").is_file() and (workdir / "checkpoints").is_dir()
    summary = json.loads((Path(rows[1e-2]["workdir"]) / "summary.json").read_text())
    assert rows[1e-2]["objective"] == summary["eval"][-1][1] and rows[1e-2]["steps"] == 4
    assert rows[1e-5]["steps"] == 2 and rows[1e-5]["note"] == "pruned at step 2"
    assert results["best"]["trial"] == rows[1e-2]["trial"]

    table = list(__import__("csv").DictReader(open(results["csv"])))
    assert [int(r["trial"]) for r in table] == [r["trial"] for r in results["rows"]]
    assert set(table[0]) == {"trial", "state", "optim.lr", "objective", "steps", "wall_s", "workdir", "note"}
    assert results["markdown"].read_text().count("\n| ") == 3  # header + 2 trials
    assert results["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(line.startswith("best: trial 0") for line in lines), lines


def cli(tmp_path, *args, devices=1, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(devices)}
    return subprocess.run([sys.executable, "-m", "jaxtrain", "sweep", "--config", "configs/tiny.py", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)


CLI_BAD = {
    "unknown_path": ('{"space": {"model.dff": [64, 128]}, "sampler": "grid"}', "space.model.dff: unknown config path"),
    "empty_space": ('{"space": {}, "trials": 2}', "space: empty"),
    "grid_loguniform": ('{"space": {"optim.lr": loguniform(1e-4, 1e-2)}, "sampler": "grid"}',
                        "grid sampler needs discrete values"),
}


@pytest.mark.parametrize("case", list(CLI_BAD))
def test_cli_bad_sweep_exits_2_before_any_trial(case, tmp_path, tiny_data_dir):
    body, message = CLI_BAD[case]
    path = write_sweep(tmp_path / f"{case}.py", f"from jaxtrain.tools.sweep import loguniform\n\n\ndef get_sweep():\n"
                                                f"    return {body}\n")
    proc = cli(tmp_path, "--sweep", str(path), "--sweep_dir", str(tmp_path / "sw"), f"--config.data.dir={tiny_data_dir}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert not (tmp_path / "sw").exists()


@pytest.mark.slow
def test_cli_two_workers_share_one_study(tmp_path, tiny_data_dir):
    path = write_sweep(tmp_path / "two.py", """
        from jaxtrain.tools.sweep import loguniform


        def get_sweep():
            return {"space": {"optim.lr": loguniform(1e-3, 1e-2)}, "sampler": "random", "trials": 2}
        """)
    proc = cli(tmp_path, "--sweep", str(path), "--sweep_dir", str(tmp_path / "sw"), "--workers", "2",
               f"--config.data.dir={tiny_data_dir}", "--config.train.steps=2", "--config.eval.every_steps=2",
               "--config.optim.warmup_steps=0", "--config.model.n_layers=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = load_study(tmp_path / "sw", "two")
    assert states(study) == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert len({t.user_attrs["worker"] for t in study.trials}) == 2, proc.stdout  # one trial each
    assert "[worker 1] [" in proc.stdout and "best: trial" in proc.stdout
    assert (tmp_path / "sw" / "results.png").is_file()


KILLED_WORKER = """
import os, pickle, sys
from jaxtrain import train
from jaxtrain.tools import sweep

real_run = train.run


def killed(config, **kwargs):  # trains to step 2 (checkpointed), then the worker dies without a word
    config.train.stop_at = 2
    real_run(config, **kwargs)
    os._exit(9)


train.run = killed
job = pickle.load(sys.stdin.buffer)
sweep.run(job["config"], job["spec"], job["sweep_dir"])
"""


@pytest.mark.slow
def test_real_killed_trial_resumes_from_its_checkpoint(tiny_config, tmp_path):
    # test_grid_sweep_real_with_pruning's first trial: its compiled programs are in the compilation cache.
    config = tiny_config(**{"train.steps": 4, "eval.every_steps": 2, "checkpoint.every_steps": 2,
                            "optim.warmup_steps": 0, "model.n_layers": 1})
    spec = {"space": {"optim.lr": [1e-2]}, "sampler": "grid", "name": "killed"}
    sweep_dir = tmp_path / "sw"
    proc = subprocess.run([sys.executable, "-c", KILLED_WORKER], cwd=REPO, capture_output=True, timeout=600,
                          input=pickle.dumps({"config": config, "spec": sweep_spec.load(spec), "sweep_dir": sweep_dir}),
                          check=False)
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert (sweep_dir / "trial_0000" / "checkpoints" / "2").is_dir()

    results = sweep.run(config, spec, sweep_dir, print_fn=quiet)
    assert [r["state"] for r in sorted(results["rows"], key=lambda r: r["trial"])] == ["interrupted", "complete"]
    run_json = json.loads((sweep_dir / "trial_0000" / "run.json").read_text())
    assert [a["start_step"] for a in run_json["attempts"]] == [0, 2]
    assert json.loads((sweep_dir / "trial_0000" / "summary.json").read_text())["resumed"] is True
    assert results["best"]["workdir"] == str(sweep_dir / "trial_0000") and results["best"]["steps"] == 4


def test_trials_of_a_config_with_a_checkpoint_dir_each_get_their_own(tiny_config, tmp_path):
    base = tiny_config(**{"checkpoint.dir": "gs://bucket/ckpt/"})
    a = sweep_spec.trial_config(base, {"optim.lr": 1e-3}, tmp_path / "trial_0000")
    b = sweep_spec.trial_config(base, {"optim.lr": 2e-3}, tmp_path / "trial_0001")
    assert (a.checkpoint.dir, b.checkpoint.dir) == ("gs://bucket/ckpt/trial_0000", "gs://bucket/ckpt/trial_0001")
    assert base.checkpoint.dir == "gs://bucket/ckpt/" and tiny_config().checkpoint.dir == ""
