"""Exit codes, the step watchdog, coordinated preemption (SIGTERM -> every process saves the same step) and Ctrl-C
between steps.

Exit codes are the contract with `jaxtrain.tools.supervise` and with any scheduler: 75 (sysexits EX_TEMPFAIL)
means "preempted, state saved, run the same command again"; 124 (as coreutils `timeout`) means a step hung.

Preemption across processes uses JAX's own preemption sync point
(`multihost_utils.reached_preemption_sync_point`), the one Orbax's `reached_preemption` also uses, so both
agree on the step. It costs nothing per step (a local mutex; the agreement runs in a background thread
after the notice). Its catch: `jax.distributed.initialize` installs a C++ SIGTERM handler that feeds it,
and any Python SIGTERM handler installed later replaces that handler and silently turns the service off.
PreemptionGuard therefore installs its Python handler (to timestamp the signal) and chains to the C
handler it displaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback

from jaxtrain.errors import EXIT_HUNG, ConfigError
from jaxtrain.fields import Group

NAN_POLICIES = ("halt", "skip", "rollback")
# The config's `faults` group. `nan_policy` for a non-finite loss or gradient (the update is never applied): "halt"
# (exit 3), "skip" (drop that step's update and go on) or "rollback" (restore the last checkpoint and skip the data
# since). `step_timeout_s`: a step (or a peer) stuck this long dumps all stacks and exits 124 (0 = off).
# `preempt_grace_s`: the time SIGTERM leaves us to save; we warn if a save took longer. With several processes, each
# reports its step time every `straggler_every_steps` steps (0 = off) and process 0 names a process whose step
# time stays over `straggler_factor` times the others' median (jaxtrain.hooks.StragglerHook).
CONFIG = dict(nan_policy="halt", step_timeout_s=600.0, preempt_grace_s=30.0, straggler_every_steps=50,
              straggler_factor=1.5)


def check_config(faults) -> None:
    g = Group(faults, "faults")
    g.choice("nan_policy", NAN_POLICIES)
    g.number("step_timeout_s", lo=0)
    g.number("preempt_grace_s", lo=0)
    if g.positive_int("straggler_every_steps", allow_zero=True) == 1:  # a round is read once the next one starts
        raise ConfigError("faults.straggler_every_steps", "must be 0 (off) or at least 2, got 1")
    g.number("straggler_factor", lo=1, lo_open=True)


class Watchdog:
    """Exits the process when no step finishes within `timeout_s` (0 or less: off).

    The loop calls `pet()` after every completed step; time inside `paused()` (eval, checkpoint, compile)
    does not count, and the clock restarts when a pause ends. A hung collective (a peer died or was
    stopped) blocks the main thread in C++ with the GIL released, so this thread still runs: it prints one
    line, every thread's stack and calls `exit_fn(exit_code)`. `os._exit` because a clean exit would
    wait for the very collective that hangs. `stream` None means sys.stderr as it is when the dog fires.
    """

    # How long the dump waits for `peer_report`: it asks the other processes, and a dead coordinator never answers.
    PEER_REPORT_S = 15.0

    def __init__(self, timeout_s: float, *, exit_code: int = EXIT_HUNG, stream=None, exit_fn=os._exit):
        self.timeout_s, self.exit_code, self.stream, self.exit_fn = float(timeout_s), exit_code, stream, exit_fn
        self.fired = False
        # A callable returning lines on the other processes (e.g. which one is behind) for the dump, or None.
        self.peer_report = None
        self._first = None  # the first step's own limit, until it finishes (start)
        self._last = time.monotonic()
        self._pauses = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def start(self, first_step_s: float | None = None) -> None:
        """Starts watching. `first_step_s`: the limit until the first `pet()`, for a first step that also waits
        for every other process (their restore and compile) to reach it; default `timeout_s`."""
        if self.timeout_s <= 0 or self._thread is not None:
            return
        self._first = max(self.timeout_s, first_step_s or 0.0)
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="step-watchdog", daemon=True)
        self._thread.start()

    def pet(self) -> None:
        self._first = None
        self._last = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        with self._lock:
            self._pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self):
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            with self._lock:
                idle = 0.0 if self._pauses else time.monotonic() - self._last
            if idle > (self._first or self.timeout_s):
                self.fired = True
                try:
                    self._dump(idle, self.stream or sys.stderr)
                finally:  # a failed dump must not leave the process hanging
                    self.exit_fn(self.exit_code)
                return

    def _dump(self, idle: float, stream):
        names = ", ".join(f"{t.ident:#018x}={t.name}" for t in threading.enumerate())
        stream.write(f"step watchdog: no step finished in {idle:.1f} s (faults.step_timeout_s={self.timeout_s:g}); "
                     f"dumping all thread stacks\nthreads: {names}\n")
        if self.peer_report is not None:
            stream.write(_bounded(self.peer_report, self.PEER_REPORT_S))
        stream.flush()  # faulthandler writes to the file descriptor directly, after this line
        try:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a stream without a file descriptor (notebook, capture)
            for ident, frame in sys._current_frames().items():
                stream.write(f"\nThread {ident:#018x} (most recent call first):\n")
                stream.write("".join(reversed(traceback.format_stack(frame))))
        stream.flush()


def _bounded(report, timeout_s: float) -> str:
    """`report()`'s lines, or one saying why there are none: it raised, or gave no answer within `timeout_s`."""
    out = []

    def call():
        try:
            out.append("".join(f"{line}\n" for line in report()))
        except Exception as e:  # noqa: BLE001 - the dump goes on without it
            out.append(f"peers: no report ({type(e).__name__}: {e})\n")

    thread = threading.Thread(target=call, name="peer-report", daemon=True)
    thread.start()
    thread.join(timeout_s)
    # jax.distributed's key-value store runs in process 0: with it stopped, nothing answers.
    return out[0] if out else f"peers: no answer within {timeout_s:g} s (is process 0 stuck?)\n"


class InterruptBetweenSteps:
    """Ctrl-C (SIGINT) takes effect between steps: the first one is noted and `check()`, called at each step's end,
    raises KeyboardInterrupt there; a second one interrupts at once. A KeyboardInterrupt raised wherever the main
    thread happened to be could land inside Orbax starting an asynchronous save, whose thread then failed or hung
    as the interpreter exited (tests/e2e/test_bad_input.py's Ctrl-C test caught it intermittently)."""

    def __init__(self):
        self.requested = False
        # Only over Python's own handler: an ignored SIGINT (`nohup`, `cmd &`) or a notebook's handler is left be.
        self._installed = (threading.current_thread() is threading.main_thread()
                           and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if self._installed:
            self._previous = signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # a second Ctrl-C does not wait for the step

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def close(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False


def _c_signal_handler(signum: int) -> int | None:
    """Address of the C-level handler of `signum` (0 = default, 1 = ignore), None where it can't be read.

    Python's signal.getsignal only knows handlers Python installed; a C++ library's handler is invisible
    to it. sigaction with no new action only reads; sa_handler is the struct's first member on Linux and
    macOS, and 512 bytes is more than any platform's struct sigaction.
    """
    try:
        libc = ctypes.CDLL(None)
        buf = ctypes.create_string_buffer(512)
        if libc.sigaction(signum, None, buf) != 0:
            return None
        return ctypes.c_void_p.from_buffer(buf).value or 0
    except (OSError, AttributeError):
        return None


class PreemptionGuard:
    """Turns SIGTERM into one agreed stop step. Create it after `jax.distributed.initialize` (if any).

    `should_stop(step)` must be called by every process at every step, with the same consecutive step
    numbers; once any process got SIGTERM it returns True on all of them at the same step (with several
    processes, the first step every process reaches after the notice went round, usually 1-2 s later:
    JAX's notifier polls once a second). A single process answers at the next step.

    `received_at` is the wall time SIGTERM reached this process (None if it did not, e.g. a peer got it);
    `since_signal()` and `grace_left()` measure the save against `grace_s` (faults.preempt_grace_s).
    """

    def __init__(self, grace_s: float = 30.0, *, signum: int = signal.SIGTERM):
        from jax._src import distributed  # lazily: the supervisor imports this module without jax
        from jax.experimental import multihost_utils

        self.grace_s, self.signum = grace_s, signum
        self.received_at: float | None = None
        self.stop_step: int | None = None
        self._received_mono: float | None = None
        self._dist = distributed.global_state
        self._reached_sync_point = multihost_utils.reached_preemption_sync_point
        self._multi = self._is_multi()
        if self._multi and self._dist.preemption_sync_manager is None:
            raise RuntimeError("PreemptionGuard: jax.distributed runs without its preemption service "
                               "(jax_enable_preemption_service=False), so processes could not agree on a "
                               "stop step after SIGTERM; enable it")
        foreign = _c_signal_handler(signum)
        # Where the C handler can't be read it can't be chained either: with several processes JAX's own
        # handler is then left in place (it still stops the run; only `received_at` stays unknown).
        self._closed = self._multi and foreign is None
        self._foreign = self._chain = None
        if not self._closed:
            self._previous = signal.signal(signum, self._on_signal)
            ours = _c_signal_handler(signum)
            # A C handler we displaced (JAX's preemption notifier) keeps getting the signal through us.
            if foreign not in (None, 0, 1, ours):
                self._foreign, self._chain = foreign, ctypes.CFUNCTYPE(None, ctypes.c_int)(foreign)

    def _is_multi(self) -> bool:
        return self._dist.client is not None and self._dist.num_processes > 1

    def _on_signal(self, signum, frame):
        # No printing here: the handler may interrupt a write to the same stream (reentrant-call error).
        if self.received_at is None:
            self.received_at, self._received_mono = time.time(), time.monotonic()
        if self._chain is not None:
            self._chain(signum)

    def should_stop(self, step: int) -> bool:
        if self.stop_step is not None:
            return step >= self.stop_step
        if self._multi:
            stop = self._reached_sync_point(step)
        else:
            if self._is_multi():
                raise RuntimeError("PreemptionGuard was created before jax.distributed.initialize; create it "
                                   "after, or SIGTERM on one process would stop only that process")
            stop = self.received_at is not None
        if stop:
            self.stop_step = step
        return stop

    def since_signal(self) -> float | None:
        return None if self._received_mono is None else time.monotonic() - self._received_mono

    def grace_left(self) -> float | None:
        since = self.since_signal()
        return None if since is None else self.grace_s - since

    def close(self) -> None:
        """Restores the handlers as they were, the C-level one included."""
        if self._closed:
            return
        self._closed = True
        # None: the previous handler was not Python's; SIG_DFL for Python, the C one is put back below.
        signal.signal(self.signum, signal.SIG_DFL if self._previous is None else self._previous)
        if self._foreign:
            libc = ctypes.CDLL(None)
            libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
            libc.signal(self.signum, self._foreign)
