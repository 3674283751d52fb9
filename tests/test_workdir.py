"""One run per workdir (an flock that dies with its holder, handed down by a supervisor), config.json written only
once the input passed every check, and a failed fresh run leaving nothing behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import install_poison
from jaxtrain import errors, train
from jaxtrain import workdir as workdir_lib
from jaxtrain.models import hf
from jaxtrain.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
quiet = lambda *a, **k: None  # noqa: E731

HOLD = textwrap.dedent("""
    import sys, time
    from jaxtrain import workdir
    lock = workdir.Lock(sys.argv[1])
    lock.acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def hold_in_subprocess(path, **popen):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            **popen)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_claim_is_refused_naming_the_holder_and_a_dead_holder_blocks_nothing(tmp_path):
    holder = hold_in_subprocess(tmp_path)
    try:
        with pytest.raises(errors.ConfigError, match=rf"^workdir: {tmp_path} is in use by another run \(pid "
                                                     rf"{holder.pid} on .*, since .*\); wait for it to end"):
            workdir_lib.Lock(tmp_path).acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    lock = workdir_lib.Lock(tmp_path)  # the lock file is still there, its flock went with the process
    lock.acquire()
    with pytest.raises(errors.ConfigError, match="is in use by another run"):
        workdir_lib.Lock(tmp_path).acquire()  # the same process, another open file: refused too
    lock.release()
    workdir_lib.Lock(tmp_path).acquire()


def test_a_child_holds_the_lock_its_parent_handed_down_and_no_one_else_does(tmp_path):
    parent = workdir_lib.Lock(tmp_path)
    parent.acquire()
    env = {**os.environ, **parent.inheritable_env()}
    check = "import sys; from jaxtrain import workdir; workdir.Lock(sys.argv[1]).acquire(); print('ok')"
    child = subprocess.run([sys.executable, "-c", check, str(tmp_path)], cwd=REPO, env=env, pass_fds=(parent.fd,),
                           capture_output=True, text=True, timeout=60)
    assert child.stdout == "ok\n", child.stderr
    stranger = subprocess.run([sys.executable, "-c", check, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)  # the variable alone, without the open file, is not the lock
    assert "is in use by another run" in stranger.stderr
    parent.release()


def test_bad_workdir_paths_are_one_line_errors(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(errors.ConfigError, match=rf"^workdir: {a_file} exists and is not a directory$"):
        workdir_lib.Workdir(a_file, is_main=True).claim()
    with pytest.raises(errors.ConfigError, match=rf"^workdir: parent directory {a_file} is not a directory$"):
        workdir_lib.Workdir(a_file / "run", is_main=True).claim()
    assert a_file.read_text() == "x"


def test_a_fresh_run_failing_on_its_input_leaves_no_workdir(tiny_config, tmp_path):
    broken = tmp_path / "hf"  # a Hugging Face dir whose config.json matches, with unreadable weights
    cfg = tiny_config(**{"train.steps": 2})
    model_cfg = ModelConfig(**{k: cfg.model[k] for k in hf.FIELDS})
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(hf.hf_config(model_cfg, dtype="float32")))
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    bad = tiny_config(**{"train.steps": 2, "model.init_from": str(broken)})
    with pytest.raises(errors.ConfigError, match="^model.init_from: "):
        train.run(bad, print_fn=quiet)
    assert not Path(bad.workdir).exists()  # created by this run, and removed: nothing blocks the corrected rerun
    existing = tiny_config(workdir=tmp_path / "existing", **{"train.steps": 2, "model.init_from": str(broken)})
    Path(existing.workdir).mkdir()
    with pytest.raises(errors.ConfigError, match="^model.init_from: "):
        train.run(existing, print_fn=quiet)
    assert list(Path(existing.workdir).iterdir()) == []  # as it was: what the run added is removed, nothing else
    (Path(existing.workdir) / "notes.txt").write_text("mine\n")
    with pytest.raises(errors.ConfigError, match="^model.init_from: "):
        train.run(existing, print_fn=quiet)
    assert [p.name for p in Path(existing.workdir).iterdir()] == ["notes.txt"]


def test_config_json_binds_only_a_workdir_with_checkpoints(tiny_config, monkeypatch):
    # A run that halts on a NaN before its first checkpoint leaves a config.json that does not block a corrected
    # rerun with another model size.
    first = tiny_config(**{"train.steps": 6, "checkpoint.every_steps": 5})
    with monkeypatch.context() as m:
        install_poison(m.setattr, bad_step=3)
        with pytest.raises(errors.NonFiniteLoss):
            train.run(first, print_fn=quiet)
    assert json.loads((Path(first.workdir) / "config.json").read_text())["model"]["d_ff"] == 64
    second = tiny_config(workdir=first.workdir, **{"train.steps": 6, "checkpoint.every_steps": 5, "model.d_ff": 48})
    assert train.run(second, print_fn=quiet)["finished"]
    saved = Path(first.workdir) / "config.json"
    assert json.loads(saved.read_text())["model"]["d_ff"] == 48

    # With checkpoints, config.json binds; without it (deleted), a wrong model fails at restore, writes nothing,
    # and the right command goes on.
    longer = {"train.steps": 8, "checkpoint.every_steps": 5}
    with pytest.raises(errors.ConfigError, match=r"^model.d_ff: is 64 but the checkpoints .* were made with 48"):
        train.run(tiny_config(workdir=first.workdir, **longer, **{"model.d_ff": 64}), print_fn=quiet)
    saved.unlink()
    with pytest.raises(errors.CheckpointMismatch):
        train.run(tiny_config(workdir=first.workdir, **longer, **{"model.d_ff": 64}), print_fn=quiet)
    assert not saved.exists()
    assert train.run(tiny_config(workdir=first.workdir, **longer, **{"model.d_ff": 48}), print_fn=quiet)["step"] == 8


def test_a_data_dir_that_does_not_exist_is_refused_not_filled_with_the_default_corpus(tiny_config, tmp_path):
    """Issue 53: a typo in data.dir prepared the Bible there and trained on it. Now it exits 2 naming the field,
    and nothing is created: neither that dir nor the workdir."""
    cfg = tiny_config(**{"data.dir": str(tmp_path / "corpsu")})
    with pytest.raises(errors.ConfigError, match=rf"^data.dir: {tmp_path / 'corpsu'}: no such directory"):
        train.run(cfg, print_fn=quiet)
    assert not (tmp_path / "corpsu").exists() and not Path(cfg.workdir).exists()

