"""scripts/bench_step.py end to end on the tiny config: its JSON line is self-consistent (tokens/s from the step
time, model FLOP/s from the model's FLOPs per token, MFU against the peak it names) and, on CPU, quotes the f32
matmul peak it measured in the same run."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain import config as config_lib
from jaxtrain.models import transformer

REPO = Path(__file__).resolve().parent.parent


def test_bench_step_reports_consistent_figures_on_cpu():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "scripts/bench_step.py", "--config", "configs/tiny.py", "--steps", "3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "MFU" in proc.stderr and "measured f32 matmul" in proc.stderr

    spec = importlib.util.spec_from_file_location("tiny", REPO / "configs" / "tiny.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    cfg = tiny.get_config()
    t = cfg.train
    flops_per_token = transformer.train_flops_per_token(config_lib.model_config(cfg, "cpu"), t.seq_len)
    assert result["devices"] == 1 and result["device_kind"] == "cpu" and result["dtype"] == "float32"
    assert result["tokens_per_sec"] == pytest.approx(t.batch_size * t.seq_len / (result["step_ms"] / 1e3))
    assert result["model_gflops_per_sec"] == pytest.approx(result["tokens_per_sec"] * flops_per_token / 1e9)
    assert result["peak_source"] == "measured f32 matmul"
    assert result["peak_gflops"] == result["measured_matmul_gflops"] > 1  # any CPU does a GFLOP/s
    assert result["mfu"] == pytest.approx(result["model_gflops_per_sec"] / result["peak_gflops"])
    assert result["mfu_vs_measured"] == result["mfu"]
    assert 0 < result["mfu"] < 1 and result["loss"] > 0
