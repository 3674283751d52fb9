"""scripts/bench_step.py end to end on the tiny config, run through scripts/gpu_bench.sh (the GPU session's
driver): its JSON line is self-consistent (tokens/s from the step time, model FLOP/s from the model's FLOPs per
token, MFU against the peak it names) and, on CPU, quotes the float32 matmul peak it measured in the same run.
Also scripts/bench_revs.sh, which runs it at another commit and here in turn."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain import config as config_lib
from jaxtrain.models import transformer

REPO = Path(__file__).resolve().parents[2]


def gpu_bench(out: Path, *variants: str, budget_s: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(out), CONFIG="configs/tiny.py", STEPS="3",
               BUDGET_S=str(budget_s), PY=sys.executable)
    env.pop("XLA_FLAGS", None)  # the script sets each variant's own
    return subprocess.run(["bash", "scripts/gpu_bench.sh", *variants], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_bench_step_reports_consistent_figures_on_cpu(tmp_path):
    proc = gpu_bench(tmp_path, "base", "lhs")  # budget 0 s: the first variant runs, the next is skipped
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "gpu_bench: skipped lhs (past BUDGET_S=0s)" in proc.stdout
    (line,) = (tmp_path / "gpu_bench.jsonl").read_text().splitlines()
    result = json.loads(line)
    log = (tmp_path / "base.log").read_text()
    assert "MFU" in log and "measured float32 matmul" in log
    assert result["variant"] == "base" and result["xla_flags"] == "" and result["args"] == ""
    assert result["peak_bytes_in_use"] is None  # the CPU allocator keeps no high-water mark

    spec = importlib.util.spec_from_file_location("tiny", REPO / "configs" / "tiny.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    cfg = tiny.get_config()
    t = cfg.train
    flops_per_token = transformer.train_flops_per_token(config_lib.model_config(cfg, "cpu"), t.seq_len)
    assert result["devices"] == 1 and result["device_kind"] == "cpu" and result["dtype"] == "float32"
    assert result["tokens_per_sec"] == pytest.approx(t.batch_size * t.seq_len / (result["step_ms"] / 1e3))
    assert result["model_gflops_per_sec"] == pytest.approx(result["tokens_per_sec"] * flops_per_token / 1e9)
    assert result["peak_source"] == "measured float32 matmul"
    assert result["peak_gflops"] == result["measured_matmul_gflops"] > 1  # any CPU does a GFLOP/s
    assert result["mfu"] == pytest.approx(result["model_gflops_per_sec"] / result["peak_gflops"])
    assert result["mfu_vs_measured"] == result["mfu"]
    assert 0 < result["mfu"] < 1 and result["loss"] > 0


def test_gpu_bench_rejects_an_unknown_variant_before_running_any(tmp_path):
    proc = gpu_bench(tmp_path, "base", "remat_nonee")
    assert proc.returncode == 2 and "gpu_bench: unknown variant 'remat_nonee'" in proc.stderr
    assert not (tmp_path / "gpu_bench.jsonl").exists()
    proc = gpu_bench(tmp_path, "moe", "cudnn")  # moe mode's scripts take no variants: refused, not ignored
    assert proc.returncode == 2 and "gpu_bench: moe takes no variants (got 'cudnn')" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_gpu_bench_runs_variants_joined_by_plus_as_one(tmp_path):
    """`lhs+remat_full` is one run with both variants' XLA flags and arguments; its log's name has no +."""
    proc = gpu_bench(tmp_path, "lhs+remat_full", budget_s=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = (tmp_path / "gpu_bench.jsonl").read_text().splitlines()
    result = json.loads(line)
    assert result["variant"] == "lhs+remat_full" and result["remat"] == "full"
    assert result["xla_flags"] == "--xla_gpu_enable_latency_hiding_scheduler=true"
    assert result["args"] == "--config.model.remat=full"
    assert (tmp_path / "lhs-remat_full.log").is_file()


def test_gpu_bench_rejects_an_unknown_part_of_a_joined_variant(tmp_path):
    proc = gpu_bench(tmp_path, "cudnn+batch61")
    assert proc.returncode == 2 and "gpu_bench: unknown variant 'batch61'" in proc.stderr
    assert not (tmp_path / "gpu_bench.jsonl").exists()


def test_gpu_bench_moe_times_both_ragged_dots_and_trains_tokamax_like_xla(tmp_path):
    """`gpu_bench.sh moe` (the grouped-matmul check for a GPU session), shrunk for the CPU: both ragged_dots are
    timed, and dropless MoE trained with tokamax's kernel (its XLA fallback here) reaches XLA's loss exactly."""
    env = {"RAGGED_ARGS": "--rows 64 --k 16 --n 32 --steps 1",
           "MOE_ARGS": "--expert_d_ff 32 --config.model.n_layers=1 --config.train.batch_size=2"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        proc = gpu_bench(tmp_path, "moe", budget_s=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ragged, moe_run = (json.loads(line) for line in (tmp_path / "gpu_moe.jsonl").read_text().splitlines())
    assert ragged["rows"] == 64 and ragged["xla"]["fwd_ms"] > 0 and ragged["tokamax"]["fwd_bwd_ms"] > 0
    assert ragged["tokamax"]["vs_xla"]["fwd"] == ragged["tokamax"]["vs_xla"]["dx"] == 0  # its XLA fallback here
    assert set(moe_run) >= {"capacity", "dropless", "dropless_tokamax", "tokamax_over_xla"}
    assert moe_run["dropless_tokamax"]["loss"] == moe_run["dropless"]["loss"]
    assert moe_run["dropless"]["dropped_fraction"] == 0 < moe_run["capacity"]["dropped_fraction"]


def test_bench_ragged_dot_exits_1_when_the_kernel_jaxtrain_runs_differs_from_xla_s():
    """The GPU check of tokamax, with its kernels made wrong here. Its ragged_dot (what jaxtrain runs forward and
    for the input gradient) 1.2x wrong: the script names the outputs that differ and exits 1, its timings and JSON
    line still printed. Its ragged-contracting kernel (the weight gradient, which jaxtrain takes from XLA since an
    H200 measured it wrong) 1.2x wrong: reported beside the rest, and the path jaxtrain runs still passes."""
    pytest.importorskip("tokamax")

    def run(name):
        wrong = (f"import runpy, sys, tokamax; kernel = tokamax.{name}; "
                 f"tokamax.{name} = lambda *a, **k: kernel(*a, **k) * 1.2; "
                 "sys.argv = ['bench_ragged_dot.py', '--rows', '64', '--k', '16', '--n', '32', '--steps', '1']; "
                 "runpy.run_path('scripts/bench_ragged_dot.py', run_name='__main__')")
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-c", wrong], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300, check=False)

    proc = run("ragged_dot")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("tokamax against XLA")]
    assert len(verdict) == 1 and ": NOT EQUAL (" in verdict[0], proc.stdout
    errors = json.loads(proc.stdout.splitlines()[-1])["tokamax"]["vs_xla"]
    assert 0.15 < errors["fwd"] < 0.25 and 0.15 < errors["dx"] < 0.25 and errors["dw"] == 0
    proc = run("ragged_dot_general")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])["tokamax"]
    assert result["vs_xla"] == {"fwd": 0, "dx": 0, "dw": 0} and 0.15 < result["own_dw_vs_xla"] < 0.25


RING_ARGS = "--interpret --dtype float32 --seq_len 256 --heads 4 --kv_heads 2 --head_dim 16 --iters 1"


def test_gpu_bench_ring_checks_the_flash_kernels_against_the_xla_blocks(tmp_path):
    """`gpu_bench.sh ring` (the ring kernels' check for a GPU session), shrunk for the CPU, the kernels in Pallas's
    interpreter: one JSON line per window (none, then 4,096 tokens: wider than this sequence) with both paths
    timed and the kernels equal to the f32 blocks. With the kernels' probabilities made 1.2x too large, the
    script exits 1."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RING_ARGS", RING_ARGS)
        proc = gpu_bench(tmp_path, "ring", budget_s=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = [json.loads(line) for line in (tmp_path / "gpu_ring.jsonl").read_text().splitlines()]
    assert [r["window"] for r in runs] == [0, 4096]
    for r in runs:
        assert r["shape"] == [1, 256, 4, 16] and r["xla_ms"] > 0 and r["pallas_ms"] > 0
        assert r["xla_error"] == 0 and r["pallas_error"] < 1e-5
    wrong = ("import runpy, sys; from jaxtrain.models import gpu_flash; p = gpu_flash._probabilities; "
             "gpu_flash._probabilities = lambda *a: p(*a) * 1.2; "
             f"sys.argv = ['bench_ring_kernel.py', *{RING_ARGS.split()!r}]; "
             "runpy.run_path('scripts/bench_ring_kernel.py', run_name='__main__')")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", wrong], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["pallas_error"] > 0.1


def test_bench_revs_times_other_commits_and_this_checkout_in_turn(tmp_path):
    """scripts/bench_revs.sh against HEAD~1 and HEAD, one round: one JSON line per tree, the same synthetic batch,
    a ratio to each baseline, and the other commits' worktrees removed afterwards; a revision git does not know
    exits 2 before anything runs."""
    if subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=REPO, capture_output=True, check=False).returncode:
        pytest.skip(f"{REPO} has fewer than two commits")
    env = dict(os.environ, JAX_PLATFORMS="cpu", ROUNDS="1", OUT=str(tmp_path / "revs.jsonl"), PY=sys.executable)
    env.pop("XLA_FLAGS", None)
    bad = subprocess.run(["bash", "scripts/bench_revs.sh", "no-such-rev"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "bench_revs: no commit 'no-such-rev'"
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    proc = subprocess.run(["bash", "scripts/bench_revs.sh", "HEAD~1,HEAD", "--config", "configs/tiny.py",
                           "--steps", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "revs.jsonl").read_text().splitlines()]
    base, head = (subprocess.run(["git", "rev-parse", "--short=7", rev], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip() for rev in ("HEAD~1", "HEAD"))
    assert [r["tree"] for r in rows] == [base, head, "this checkout"]
    assert all(r["step_ms"] > 0 and r["config"] == "runs/tiny" for r in rows)
    assert [line.split(":")[0] for line in proc.stdout.splitlines()[-2:]] == [f"this checkout / {base}",
                                                                             f"this checkout / {head}"]
    assert subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout == worktrees
