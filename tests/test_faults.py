"""The step watchdog and coordinated preemption, in one process and across 2 local processes."""

import ctypes
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import cpu_flags
from jaxtrain import errors, faults

TIMEOUT_S = 0.5
MARGIN_S = 1.5  # poll interval (TIMEOUT_S / 10) plus scheduling on 2 busy cores


def _wait_for(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _named_thread_body(release: threading.Event):
    release.wait()


@pytest.mark.parametrize("kind", ["file", "no_fileno"])  # faulthandler needs a file descriptor
def test_watchdog_fires_within_timeout_and_dumps_every_thread(tmp_path, kind):
    release = threading.Event()
    worker = threading.Thread(target=_named_thread_body, args=(release,), name="busy-worker", daemon=True)
    worker.start()
    codes = []
    with open(tmp_path / "stderr.txt", "w+") if kind == "file" else io.StringIO() as stream:
        dog = faults.Watchdog(TIMEOUT_S, stream=stream, exit_fn=codes.append)
        t = time.monotonic()
        dog.start()
        try:
            assert _wait_for(lambda: codes, TIMEOUT_S + MARGIN_S)
            elapsed = time.monotonic() - t
        finally:
            dog.stop()
            release.set()
        stream.seek(0)
        dump = stream.read()
    assert codes == [errors.EXIT_HUNG]
    assert TIMEOUT_S <= elapsed <= TIMEOUT_S + MARGIN_S
    assert "no step finished in" in dump and f"(faults.step_timeout_s={TIMEOUT_S:g})" in dump
    assert "busy-worker" in dump  # the thread-name line maps idents to names
    assert "_named_thread_body" in dump  # the other thread's stack, not only the watchdog's own
    assert "test_watchdog_fires_within_timeout_and_dumps_every_thread" in dump  # the main thread's


def test_watchdog_pet_and_pause_keep_it_quiet(tmp_path):
    codes = []
    with open(tmp_path / "stderr.txt", "w") as stream:
        dog = faults.Watchdog(TIMEOUT_S, stream=stream, exit_fn=codes.append)
        dog.start()
        try:
            for _ in range(12):  # 1.2 s of steps, each well inside the timeout
                time.sleep(TIMEOUT_S / 5)
                dog.pet()
            with dog.paused():  # an eval or a checkpoint longer than the timeout
                time.sleep(2 * TIMEOUT_S)
                with dog.paused():  # pauses nest
                    time.sleep(TIMEOUT_S / 5)
            time.sleep(TIMEOUT_S / 2)  # the clock restarted when the pause ended
            assert codes == [] and not dog.fired
        finally:
            dog.stop()


def test_watchdog_gives_the_first_step_its_own_limit(tmp_path):
    """A resumed multi-process run's first step also waits for the other processes' restore and compile: it has
    `first_step_s`; the steps after it the usual timeout."""
    codes = []
    with open(tmp_path / "stderr.txt", "w") as stream:
        dog = faults.Watchdog(TIMEOUT_S, stream=stream, exit_fn=codes.append)
        dog.start(first_step_s=3 * TIMEOUT_S)
        try:
            time.sleep(2 * TIMEOUT_S)
            assert codes == []
            dog.pet()
            assert _wait_for(lambda: codes, TIMEOUT_S + MARGIN_S)
        finally:
            dog.stop()


def test_watchdog_off_at_zero():
    codes = []
    dog = faults.Watchdog(0, exit_fn=codes.append)
    dog.start()
    time.sleep(0.2)
    dog.stop()
    assert codes == [] and dog._thread is None


def test_preemption_guard_single_process_stops_at_next_step_and_restores_handler():
    previous = signal.getsignal(signal.SIGTERM)
    guard = faults.PreemptionGuard(grace_s=10)
    try:
        assert not guard.should_stop(1) and guard.received_at is None and guard.since_signal() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop(2)
        assert guard.stop_step == 2 and guard.should_stop(3)
        assert abs(guard.received_at - time.time()) < 5
        assert 0 <= guard.since_signal() < 5 and guard.grace_left() <= 10
    finally:
        guard.close()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_ctrl_c_waits_for_the_step_end_and_a_second_one_does_not():
    # Python's own handler, whatever this process was started with: a suite started as a background job (`nohup
    # make test &`) inherits SIGINT ignored, and the test is about a run that honours it.
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt = faults.InterruptBetweenSteps()
    try:
        interrupt.check()  # nothing asked yet
        os.kill(os.getpid(), signal.SIGINT)  # handled here, not raised mid-step
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes; this never finishes
    finally:
        interrupt.close()
        restored = signal.signal(signal.SIGINT, started_with)
    assert restored is signal.default_int_handler


def test_ctrl_c_left_alone_where_sigint_is_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        interrupt = faults.InterruptBetweenSteps()
        os.kill(os.getpid(), signal.SIGINT)
        interrupt.check()
        interrupt.close()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_preemption_guard_chains_the_c_handler_it_displaces():
    """JAX's preemption notifier is a C++ SIGTERM handler; a ctypes callback stands in for it here."""
    previous = signal.getsignal(signal.SIGTERM)
    libc = ctypes.CDLL(None)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    seen = []
    notifier = ctypes.CFUNCTYPE(None, ctypes.c_int)(seen.append)
    address = ctypes.cast(notifier, ctypes.c_void_p).value
    libc.signal(signal.SIGTERM, address)
    try:
        guard = faults.PreemptionGuard()
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop(1) and seen == [signal.SIGTERM]
        guard.close()
        assert faults._c_signal_handler(signal.SIGTERM) == address  # the C handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----- two processes -------------------------------------------------------------------------------------

CHILD = r"""
import sys, time
pid, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
import jax, numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax.experimental import multihost_utils
from jaxtrain import errors, faults


def train_loop():
    if mode == "preempt":
        guard = faults.PreemptionGuard()
        print("ready", flush=True)
        deadline = time.monotonic() + 30
        for step in range(1, 100_000):
            if time.monotonic() > deadline:
                print("never stopped", flush=True)
                break
            if guard.should_stop(step):
                print(f"stop {step} signalled_here={guard.received_at is not None}", flush=True)
                guard.close()
                sys.exit(errors.EXIT_PREEMPTED)
            time.sleep(0.01)
    else:
        dog = faults.Watchdog(3.0)
        dog.start()
        print("ready", flush=True)
        for step in range(1, 100_000):
            multihost_utils.process_allgather(np.int32(step))  # blocks while the peer is stopped
            dog.pet()
            time.sleep(0.01)
    sys.exit(1)


train_loop()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pair(tmp_path):
    """Starts the 2-process CHILD in a mode, waits until both are in their loop; always kills both."""
    procs = []

    def start(mode):
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        env = {**os.environ, "XLA_FLAGS": cpu_flags(2), "JAX_PLATFORMS": "cpu"}
        port = _free_port()
        for i in range(2):
            with open(tmp_path / f"out{i}.txt", "w") as out, open(tmp_path / f"err{i}.txt", "w") as err:
                procs.append(subprocess.Popen([sys.executable, str(script), str(i), str(port), mode],
                                              stdout=out, stderr=err, env=env))
        outs = [tmp_path / f"out{i}.txt" for i in range(2)]
        assert _wait_for(lambda: all("ready" in p.read_text() for p in outs), 120), [p.read_text() for p in outs]
        return procs, lambda i: ((tmp_path / f"out{i}.txt").read_text(), (tmp_path / f"err{i}.txt").read_text())

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()  # SIGKILL ends a stopped process too
            os.kill(p.pid, signal.SIGCONT)
        p.wait(timeout=30)


def test_sigterm_to_one_process_stops_both_at_the_same_step(pair):
    (p0, p1), output = pair("preempt")
    time.sleep(0.3)
    p1.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=60) for p in (p0, p1)]
    outs = [output(i)[0] for i in range(2)]
    assert codes == [errors.EXIT_PREEMPTED] * 2, [output(i) for i in range(2)]
    stops = [line.split()[1] for out in outs for line in out.splitlines() if line.startswith("stop ")]
    assert len(stops) == 2 and stops[0] == stops[1], outs
    assert "signalled_here=False" in outs[0] and "signalled_here=True" in outs[1]


def test_watchdog_ends_the_survivor_when_a_peer_is_stopped(pair):
    (p0, p1), output = pair("watchdog")
    time.sleep(0.3)
    t = time.monotonic()
    p1.send_signal(signal.SIGSTOP)
    code = p0.wait(timeout=60)
    elapsed = time.monotonic() - t
    err = output(0)[1]
    assert code == errors.EXIT_HUNG, err
    assert elapsed < 3.0 + 3.0, elapsed  # timeout + poll + process exit, generously
    assert "step watchdog: no step finished in" in err and "(faults.step_timeout_s=3)" in err
    assert "most recent call first" in err and "train_loop" in err and "process_allgather" in err
