"""Two local processes x 4 CPU devices (gloo collectives) train like one process with 8 devices.

Each process feeds only its rows of the global batch, process 0 alone logs, and both save and restore
the same Orbax checkpoint. The 2-process run stops at step 3 and resumes to 6.

* Against an uninterrupted 1-process, 8-device run with the same collectives (gloo) it is
  bit-identical: losses, batches and final params.
* Against the default 1-process run (XLA's in-process collectives) it sees the same batches and its
  losses and params agree to float32 rounding, not bit for bit: the two all-reduce implementations add
  the 8 devices' partial gradients in different orders, and float addition is not associative
  (measured: losses 1.6e-7 relative, params within 1 float32 ulp after 20 steps).
"""

import json
import re
import os
import socket
import subprocess
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import cpu_flags
from jaxtrain import train
from jaxtrain.data import pipeline

REPO = Path(__file__).resolve().parents[2]
STEPS = 6  # equality needs a resume and a few steps each side of it, not a long run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_processes(config, tmp_path, name, **extra_env):
    config_path = tmp_path / f"{name}.json"
    config_path.write_text(config.to_json())
    port = free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, **extra_env, "XLA_FLAGS": cpu_flags(4), "JAX_PLATFORMS": "cpu",
               "JAXTRAIN_COORDINATOR": f"127.0.0.1:{port}", "JAXTRAIN_NUM_PROCESSES": "2",
               "JAXTRAIN_PROCESS_ID": str(i), "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "multihost_worker.py"), str(config_path),
                                       str(tmp_path / f"{name}.npz")], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs, timeout=300):
    """(return codes, outputs); kills whatever is left."""
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outputs


def run_two_processes(config, tmp_path, name, timeout=300, **extra_env):
    codes, outputs = finish(start_two_processes(config, tmp_path, name, **extra_env), timeout)
    # Both tails: when one process fails, the other usually times out waiting for it, and the first error
    # printed is then the symptom, not the cause.
    assert codes == [0, 0], "\n".join(f"--- process {i} exited {code}:\n{out[-3000:]}"
                                       for i, (code, out) in enumerate(zip(codes, outputs)))
    return outputs


def wait_for_step(workdir, step, procs, timeout=180):
    """Blocks until process 0 has logged `step` (or a process died)."""
    deadline = time.monotonic() + timeout
    path = Path(workdir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and any(json.loads(line).get("step", 0) >= step and "loss" in line
                                 for line in path.read_text().splitlines()):
            return
        if any(p.poll() is not None for p in procs):  # show why: the next failure is then diagnosable
            codes, outputs = finish(procs, timeout=30)
            raise AssertionError(f"a process exited early: codes {codes}\n"
                                 + "\n".join(f"--- process {i}:\n{out[-3000:]}" for i, out in enumerate(outputs)))
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached in {timeout}s")


def losses(workdir):
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_two_processes_equal_one_process(tiny_config, tmp_path):
    # dcn_data=2: a hybrid mesh whose granules are the 2 processes (a CPU block of 4 devices in the
    # 1-process runs), each holding one data row. Gradient accumulation: each data replica (here a process)
    # accumulates on its own copy of the weights, summed across the processes once a step.
    overrides = {"train.steps": STEPS, "checkpoint.every_steps": 3, "eval.every_steps": 3, "train.microbatches": 2,
                 "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.dcn_data": 2, "log.fingerprints": True}
    reference_cfg = tiny_config(**overrides)
    reference = train.run(reference_cfg, print_fn=lambda *a: None)
    ref_params = {jax.tree_util.keystr(p): np.asarray(x) for p, x in
                  jax.tree_util.tree_flatten_with_path(jax.device_get(reference["state"]["params"]))[0]}

    multi_cfg = tiny_config(**overrides, **{"train.stop_at": STEPS // 2})
    first = run_two_processes(multi_cfg, tmp_path, "first")
    assert all(f"devices 8 step {STEPS // 2}" in out for out in first), first
    multi_cfg.train.stop_at = 0
    second = run_two_processes(multi_cfg, tmp_path, "second")
    assert f"process 0/2 devices 8 step {STEPS}" in second[0] and f"process 1/2 devices 8 step {STEPS}" in second[1]
    assert f"resumed from checkpoint at step {STEPS // 2}" in second[0]
    assert "resumed from checkpoint" not in second[1]  # only process 0 prints

    # Same losses at every step (process 0's metrics.jsonl spans both invocations), same eval losses.
    ref_losses, multi_losses = losses(reference_cfg.workdir), losses(multi_cfg.workdir)
    assert sorted(multi_losses) == list(range(1, STEPS + 1))
    worst = max(abs(multi_losses[k] - ref_losses[k]) / abs(ref_losses[k]) for k in ref_losses)
    assert worst <= 1e-6, worst
    assert not (Path(multi_cfg.workdir) / "metrics.1.jsonl").exists()

    # Each process saw its half of every global batch; together they are the reference's batches.
    for p in range(2):
        seen = [json.loads(line) for line in (Path(multi_cfg.workdir) / f"data_fingerprints.{p}.jsonl")
                .read_text().splitlines()]
        it = pipeline.train_iterator(multi_cfg.data.dir, seq_len=multi_cfg.train.seq_len,
                                     global_batch=multi_cfg.train.batch_size, seed=0, process_index=p, process_count=2)
        expected = [{"step": s, "fingerprint": pipeline.tokens_per_batch_fingerprint(next(it))}
                    for s in range(1, STEPS + 1)]
        assert seen == expected, p

    params = dict(np.load(tmp_path / "second.npz"))
    assert params.keys() == ref_params.keys()
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-6, atol=1e-7, err_msg=k)

    # Bit for bit against 1 process x 8 devices, uninterrupted, with the same (gloo) collectives.
    single_cfg = tiny_config(**overrides)
    (tmp_path / "single.json").write_text(single_cfg.to_json())
    env = {**os.environ, "XLA_FLAGS": cpu_flags(8), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, str(REPO / "tests" / "multihost_worker.py"), str(tmp_path / "single.json"),
                    str(tmp_path / "single.npz"), f"127.0.0.1:{free_port()}"], env=env, check=True, timeout=300,
                   capture_output=True)
    assert losses(single_cfg.workdir) == multi_losses
    single = dict(np.load(tmp_path / "single.npz"))
    for k in single:
        np.testing.assert_array_equal(params[k], single[k], err_msg=k)


LONG = {"train.steps": 400, "checkpoint.every_steps": 200, "eval.every_steps": 0, "log.fingerprints": True,
        "optim.warmup_steps": 2}


@pytest.mark.slow
def test_sigterm_to_one_process_saves_one_step_on_both_and_resumes_there(tiny_config, tmp_path):
    cfg = tiny_config(**LONG)
    procs = start_two_processes(cfg, tmp_path, "term")
    wait_for_step(cfg.workdir, 5, procs)
    procs[1].send_signal(signal.SIGTERM)  # only one host is preempted
    codes, outputs = finish(procs, timeout=60)
    assert codes == [75, 75], [o[-3000:] for o in outputs]
    saved = {int(re.search(r"preempted: saved step (\d+)", out).group(1)) for out in outputs}
    assert len(saved) == 1, outputs  # both processes saved the same step
    step = saved.pop()
    assert 5 <= step < LONG["train.steps"]
    assert re.search(rf"preempted: saved step {step} [\d.]+s after SIGTERM", outputs[1]) is None  # printed by 0 only
    assert str(step) in os.listdir(Path(cfg.workdir) / "checkpoints")

    # The rerun continues from exactly that step, with the batches an uninterrupted run would see.
    cfg.train.stop_at = step + 3
    outputs = run_two_processes(cfg, tmp_path, "term-resumed")
    assert f"resumed from checkpoint at step {step}" in outputs[0]
    for p in range(2):
        rows = [json.loads(line) for line in (Path(cfg.workdir) / f"data_fingerprints.{p}.jsonl").read_text().splitlines()]
        it = pipeline.train_iterator(cfg.data.dir, seq_len=cfg.train.seq_len, global_batch=cfg.train.batch_size,
                                     seed=0, process_index=p, process_count=2)
        expected = [pipeline.tokens_per_batch_fingerprint(next(it)) for _ in range(step + 3)]
        assert [r["step"] for r in rows][-3:] == [step + 1, step + 2, step + 3]
        assert all(r["fingerprint"] == expected[r["step"] - 1] for r in rows)


@pytest.mark.slow
def test_a_stopped_peer_is_detected_by_the_watchdog(tiny_config, tmp_path):
    """Process 1 is a straggler (0.5 s more a step), which process 0 names, then stops: process 0's watchdog
    dumps its stacks, naming process 1 as the peer that is not stuck with it."""
    # 8 s, not less: two trainers on 2 loaded cores can take a few seconds over one step.
    cfg = tiny_config(**LONG, **{"faults.step_timeout_s": 8.0, "faults.straggler_every_steps": 2})
    procs = start_two_processes(cfg, tmp_path, "stop", JAXTRAIN_TEST_SLOW="1:0.5")
    try:
        wait_for_step(cfg.workdir, 10, procs)  # reports at steps 2, 4, 6 are read by step 8
        procs[1].send_signal(signal.SIGSTOP)
        t = time.monotonic()
        out0 = procs[0].communicate(timeout=60)[0]
        detected_after = time.monotonic() - t
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 124, out0[-3000:]
    assert detected_after < 8.0 + 10, detected_after  # the timeout plus a margin for this loaded 2-core machine
    assert "step watchdog: no step finished in" in out0
    assert "Thread 0x" in out0 or "Current thread 0x" in out0  # faulthandler's dump of every thread
    host = socket.gethostname()
    assert re.search(rf"straggler: host {re.escape(host)} \(process 1\) step [\d.]+s, [\d.]+x the median", out0), out0
    assert f"the likely cause: process 1 on {host}" in out0, out0[-3000:]


@pytest.mark.slow
def test_processes_agree_on_a_nan_rollback_when_only_one_sees_the_bad_batch(tiny_config, tmp_path):
    """Process 1's half of step 7's batch is poisoned. The loss and gradients are global, so both processes
    see the step as non-finite, roll back to step 5 together and finish; a disagreement would leave one of
    them waiting in a collective (the watchdog would exit 124)."""
    cfg = tiny_config(**{"train.steps": 10, "checkpoint.every_steps": 5, "faults.nan_policy": "rollback",
                         "faults.step_timeout_s": 60.0})
    outputs = run_two_processes(cfg, tmp_path, "nan", JAXTRAIN_TEST_POISON="7:1")
    assert "non-finite loss or gradient at step 7: rolled back to step 5" in outputs[0], outputs[0][-3000:]
    assert all("devices 8 step 10" in out for out in outputs)
    params = dict(np.load(tmp_path / "nan.npz"))
    assert all(np.isfinite(x).all() for x in params.values())
