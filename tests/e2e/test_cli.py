"""`python -m jaxtrain.main` with a bad config: exit 2, one line on stderr naming the field, workdir untouched."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BAD = {
    "unknown_key": (["--config.model.foo=1"], "model.foo"),
    "mesh_product": (["--config.mesh.data=3", "--config.mesh.fsdp=1", "--config.mesh.tensor=1"], "mesh"),
    # default mesh data=-1 -> 8 devices; 12 rows do not split 8 ways
    "batch_not_divisible": (["--config.train.batch_size=12"], "train.batch_size"),
    "negative_lr": (["--config.optim.lr=-1"], "optim.lr"),
    "unimplemented_rope_scaling": (["--config.model.rope_scaling=dynamic"], "model.rope_scaling"),
    "bad_mixture": (["--config.data.mixture=somedir"], "data.mixture"),
    "bad_nan_policy": (["--config.faults.nan_policy=ignore"], "faults.nan_policy"),
    "partial_distributed": (["--config.distributed.num_processes=2"], "distributed.coordinator"),
    # Sizes the machine cannot hold: refused by the step's memory floor, before anything is allocated.
    "seq_len_beyond_memory": (["--config.train.seq_len=1000000000"], "train.seq_len"),
    "batch_beyond_memory": (["--config.train.batch_size=1000000000"], "train.batch_size"),
    # A tracker name W&B refuses, holding a password: named, the password not repeated (asserted for every case).
    "tracker_name_with_secret": (["--config.log.trackers=wandb", "--config.log.experiment=postgresql://u:S3CRET@db/x"],
                                 "log.experiment"),
    # A data dir that is neither prepared data nor empty: named before the workdir exists.
    "data_dir_not_prepared": ([f"--config.data.dir={REPO / 'docs'}"], "docs: exists but has no manifest.json"),
}


def snapshot(directory: Path):
    """Every path under directory with its content hash (None for directories)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), directory)] = None
        for f in files:
            path = os.path.join(root, f)
            out[os.path.relpath(path, directory)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


# Tiny sizes and the session's prepared data: should validation ever let a bad config through, nothing
# heavy runs. The same arguments alone are a valid run (test_good_config_runs).
def tiny_args(data_dir):
    return [
        "--config.data.dir=" + data_dir,
        "--config.data.vocab_size=512",
        "--config.model.vocab_size=512",
        "--config.model.d_model=32",
        "--config.model.n_layers=1",
        "--config.model.d_ff=64",
        "--config.model.head_dim=8",
        "--config.train.seq_len=16",
        "--config.train.steps=2",
        "--config.optim.warmup_steps=0",
        "--config.eval.batches=1",
        "--config.log.every_steps=1",
        "--config.sample.max_new_tokens=0",
    ]


def run_cli(workdir, data_dir, *args):
    env = dict(os.environ)  # conftest's XLA_FLAGS: 8 CPU devices, as the tests see
    assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxtrain.main",
            "--config",
            "configs/default.py",
            f"--config.workdir={workdir}",
            *tiny_args(data_dir),
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


# Each case runs once (a process start costs seconds), the cases taking turns at a missing workdir and one that
# exists with a file in it: validation is one pass before the workdir is touched, whichever the case.
@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_exits_2_with_one_line(case, tiny_data_dir, tmp_path):
    args, field = BAD[case]
    workdir_state = ("missing", "existing")[list(BAD).index(case) % 2]
    workdir = tmp_path / "run"
    if workdir_state == "existing":
        workdir.mkdir()
        (workdir / "notes.txt").write_text("keep me\n")
        before = snapshot(workdir)
    proc = run_cli(workdir, tiny_data_dir, *args)

    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and field in lines[0], lines[0]
    assert proc.stdout == "", proc.stdout
    assert "S3CRET" not in proc.stderr
    if workdir_state == "missing":
        assert not workdir.exists()
    else:
        assert snapshot(workdir) == before


def test_good_config_runs(tiny_data_dir, tmp_path):
    """Control: the arguments shared by the cases above are valid; only each case's own flag is bad."""
    workdir = tmp_path / "run"
    proc = run_cli(workdir, tiny_data_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (workdir / "checkpoints" / "2").is_dir()
    assert "done: 2 steps" in proc.stdout
