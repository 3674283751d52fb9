"""A fresh clone trains with one command: `git clone` + `make train` (creates .venv, installs, runs).

Slow (a virtualenv, an install, corpus preparation and 6 steps of the default model); CI still runs it.
A clone holds only committed files, so this tests what a user actually gets.
"""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600


def clean_env():
    """This machine's environment minus what ties a child to this checkout or to the test's 8 fake devices."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(key, None)
    # An activated venv of this checkout on PATH would hand `python3` this checkout's packages.
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(REPO)))
    return env


@pytest.mark.slow
def test_fresh_clone_make_train(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    if head.returncode != 0:
        pytest.skip(f"{REPO} has no commits yet, so a clone would be empty: {head.stderr.strip()}")
    clone, workdir = tmp_path / "clone", tmp_path / "run"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    assert not (clone / ".venv").exists()

    # 6 steps (warmup 2, not the default 15, which a run must reach): evals at 0 and 6 and a checkpoint at 6 are
    # what the checks below need. Measured: eval loss 9.07 at step 0, 6.98 at step 6.
    args = (
        f"--config.workdir={workdir} --config.train.steps=6 --config.optim.warmup_steps=2 "
        f"--config.eval.every_steps=6 --config.checkpoint.every_steps=6"
    )
    proc = subprocess.Popen(
        ["make", "train", f"ARGS={args}"],
        cwd=clone,
        env=clean_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # make and everything it started (its own session)
        out, _ = proc.communicate()
        pytest.fail(f"make train did not finish in {TIMEOUT_S}s; output tail:\n{out[-4000:]}")
    assert proc.returncode == 0, f"make train exited {proc.returncode}; output tail:\n{out[-4000:]}"

    assert (clone / ".venv" / "bin" / "python").exists()  # make created the clone's own venv
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in evals][-1] == 6 and len(evals) >= 2, evals
    assert evals[-1][1] < evals[0][1], evals
    assert (workdir / "checkpoints" / "6").is_dir(), sorted(os.listdir(workdir / "checkpoints"))
