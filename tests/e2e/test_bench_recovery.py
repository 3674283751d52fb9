"""scripts/bench_recovery.py without running it: its arguments, and how it reads another process's compile from
jax's compiler log (the benchmark itself is docs/reliability.md's, not a test)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_recovery.py"


@pytest.mark.parametrize("args, message", [
    (["--processes", "3"], "--processes: invalid choice: 3"),
    (["--processes", "2", "--kill_process", "2"], "--kill_process: 2 is not one of the 2 process(es)"),
    (["--modes", "cache,warm"], "--modes: unknown ['warm']"),
])
def test_bad_arguments_exit_2_before_anything_runs(args, message, tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_step_compiles_reads_hits_and_timed_misses():
    spec = importlib.util.spec_from_file_location("bench_recovery", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    log = ("I1129 17:45:25.891564 1397 compiler.py:135] PERSISTENT COMPILATION CACHE MISS for 'jit_train_step' "
           "with key 'k'\n"
           "I1129 17:45:36.524856 1397 compiler.py:803] Not writing persistent cache entry since process_id != 0\n"
           "supervise: attempt 1 exited -9: killed by SIGKILL\n"
           "I1129 17:46:01.000000 1397 compiler.py:125] Persistent compilation cache hit for 'jit_train_step' with "
           "key 'k'\n")
    (end, source, seconds), (t, hit, none) = bench.step_compiles(log)
    assert (source, hit, none) == ("compiled", "cache", None) and t - end == pytest.approx(24.475144)
    assert seconds == pytest.approx(36.524856 - 25.891564)
