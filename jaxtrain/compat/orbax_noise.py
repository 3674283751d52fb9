"""Orbax and tensorstore noise around damaged checkpoints, kept off the user's terminal.

jaxtrain.checkpoint verifies every restore, logs each bad copy in one line and falls back to an older one. What
Orbax and tensorstore print around such a failure is noise the user cannot act on:
- a failed load leaves tensorstore reads and Orbax coroutines behind, which report "Event loop is closed",
  "exception was never retrieved" and "coroutine ... was never awaited" at any later time, from any thread
  (Orbax does not cancel its other reads when one fails; we know of no upstream issue for it);
- Orbax logs an ERROR with a damaged `_CHECKPOINT_METADATA` file's whole content each time it lists the steps,
  then goes on without it;
- a failed background save is logged by three Orbax threads, each with its traceback, before the same exception
  reaches jaxtrain.checkpoint, which reports it in one line (CheckpointError, or a warning under `continue`).
`install()` adds one narrow filter for each; everything else passes. It can go when Orbax cancels and awaits
the reads of a failed restore, logs a bad metadata file once, and leaves a failed save to its caller.
"""

from __future__ import annotations

import inspect
import logging
import sys
import traceback
import warnings


def install() -> None:
    """Both filters below, once per process (idempotent)."""
    _quiet_abandoned_reads()
    _once_per_damaged_metadata()
    _filter_once("absl", _FailedSaveReports)


def _quiet_abandoned_reads() -> None:
    """Keeps what a failed load leaves behind off the user's terminal for the rest of the process: the failure
    itself is logged (jaxtrain.checkpoint), and the rest would print at any later time, from any thread, around
    the one-line error when every checkpoint is damaged. Tensorstore's reads still in flight report within
    milliseconds, once Orbax's loop is closed, through sys.unraisablehook ("Event loop is closed"), as do
    Orbax's suspended reads when they are collected. Its futures and tasks come through asyncio's logger
    ("... exception was never retrieved"), its coroutines as warnings. Each filter is narrow; everything else
    passes."""
    _filter_once("asyncio", _AbandonedReads)
    if not isinstance(sys.unraisablehook, _LateCompletions):
        sys.unraisablehook = _LateCompletions(sys.unraisablehook)
    # jaxtrain has no coroutines of its own.
    if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern == _NEVER_AWAITED for f in warnings.filters):
        warnings.filterwarnings("ignore", _NEVER_AWAITED, RuntimeWarning)


_NEVER_AWAITED = r"coroutine '\w+' was never awaited"


def _once_per_damaged_metadata() -> None:
    """Orbax reads a step's `_CHECKPOINT_METADATA` (timestamps, not the state) each time it lists the steps, and
    logs an ERROR with the file's whole content each time one is damaged or missing; it then goes on without
    it. One warning line per file says the same."""
    _filter_once("absl", _MetadataComplaints)


def _filter_once(logger: str, kind: type[logging.Filter]) -> None:
    """Adds a `kind` filter to the logger unless it has one."""
    log = logging.getLogger(logger)
    if not any(isinstance(f, kind) for f in log.filters):
        log.addFilter(kind())


class _MetadataComplaints(logging.Filter):
    PREFIXES = ("Failed to json parse Metadata file", "Failed to read Metadata file", "Metadata file does not exist")

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if not msg.startswith(self.PREFIXES) or not record.args:
            return True
        path = str(record.args[0])
        if path in self.seen:
            return False
        self.seen.add(path)
        record.msg, record.args = "%s: %s; Orbax goes on without it (the state is still verified)", (
            path, "missing" if msg.startswith("Metadata file does not exist") else "unreadable")
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class _FailedSaveReports(logging.Filter):
    """Drops Orbax's tracebacks of a failed background save: the exception is re-raised to the waiting caller."""
    TEMPLATES = ("_SignalingThread.run() raised an exception", "Handler Commit operations or the Commit callback",
                 "[wait_until_finished] Save Finalize thread")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and any(t in str(record.msg) for t in self.TEMPLATES))


class _AbandonedReads(logging.Filter):
    """Drops asyncio's report of a future whose exception nobody retrieved when it was one of Orbax's tasks or
    gathers (an Orbax frame raised it) or a tensorstore read (set from C++: no frames, an absl status code)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or "exception was never retrieved" not in str(record.msg).partition("\n")[0]:
            return True
        if exc.__traceback__ is None:
            return str(exc).partition(":")[0] not in _ABSL_STATUS_CODES
        return not any("orbax" in f.filename for f in traceback.extract_tb(exc.__traceback__))


_ABSL_STATUS_CODES = frozenset(
    "CANCELLED UNKNOWN INVALID_ARGUMENT DEADLINE_EXCEEDED NOT_FOUND ALREADY_EXISTS PERMISSION_DENIED "
    "RESOURCE_EXHAUSTED FAILED_PRECONDITION ABORTED OUT_OF_RANGE UNIMPLEMENTED INTERNAL UNAVAILABLE DATA_LOSS "
    "UNAUTHENTICATED".split())


class _LateCompletions:
    """An unraisable hook that drops a read finishing after its loop was closed, or one of Orbax's suspended reads
    raising as the garbage collector closes it ("Exception ignored in: <coroutine ...>"), whenever that happens;
    it passes on all else. It may run while the interpreter exits, so it binds what it uses now."""

    def __init__(self, passed_on, extract_tb=traceback.extract_tb, is_coroutine=inspect.iscoroutine):
        self.passed_on, self.extract_tb, self.is_coroutine = passed_on, extract_tb, is_coroutine

    def __call__(self, unraisable) -> None:
        obj, exc = unraisable.object, unraisable.exc_value
        late = (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
                and any(f.name == "call_soon_threadsafe" for f in self.extract_tb(unraisable.exc_traceback)))
        closed_read = self.is_coroutine(obj) and "orbax" in obj.cr_code.co_filename
        if not (late or closed_read):
            self.passed_on(unraisable)
