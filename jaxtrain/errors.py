"""Every exception a user can see, and the exit codes.

A command turns these into one line on stderr and its exit code (`exit_code`); anything else is a bug
and keeps its traceback. The exit codes are the contract with `jaxtrain supervise` and any scheduler.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # bad config or input: rerunning the same command cannot help
EXIT_NONFINITE = 3  # halted on a non-finite loss (faults.nan_policy=halt)
EXIT_CHECKPOINT = 4  # a checkpoint write failed
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: state saved, retry later
EXIT_HUNG = 124  # the step watchdog fired, as coreutils `timeout`
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it


class ConfigError(ValueError):
    """A bad config value. `str()` is the one line shown to the user: '<field>: <reason>'."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class DataError(ValueError):
    """Bad data input: missing or mismatching data dir, impossible settings."""


class SourceError(ValueError):
    """A path that matches nothing, or a file that cannot be read as its kind."""


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used: unreadable, or without an end-of-document token."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, read or verified."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint holds another model (array names, shapes or dtypes): bad input, not damage."""


class HFError(ValueError):
    """An HF directory we cannot read or represent, or an export we refuse; the message names the field,
    tensor or path."""


class HFMismatch(ConfigError, HFError):
    """The HF checkpoint's architecture differs from the jaxtrain model config.

    `HFMismatch("d_ff", reason)`: str() is 'model.d_ff: <reason>', like ConfigError (so `.field` is 'model.d_ff'),
    and the CLI's ConfigError handling already exits 2 on it."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"model.{field}", reason)


class NonFiniteLoss(RuntimeError):
    """faults.nan_policy=halt met a non-finite loss or gradient (exit 3)."""


class Preempted(Exception):
    """SIGTERM reached some process: every process saved `step` and exits EXIT_PREEMPTED."""

    def __init__(self, step: int):
        super().__init__(f"preempted: saved step {step}; rerun the same command to resume")
        self.step = step


class Interrupted(Exception):
    """Ctrl-C during training, after the save in flight (if any) completed; `saved` is the newest checkpoint."""

    def __init__(self, step: int, saved: int):
        where = (f"the newest checkpoint is step {saved}; rerun the same command to resume from it" if saved else
                 "no checkpoint was written yet")
        super().__init__(f"interrupted at step {step}: {where}")
        self.step, self.saved = step, saved


class PlanError(ValueError):
    """A bad planner input; `str()` is '<field>: <reason>' like ConfigError."""


class ReportError(ValueError):
    """A workdir the report cannot use (exit 2 from the CLI)."""


class SweepError(ConfigError):
    """A bad sweep file, space, flag or storage. `str()` is the one line shown: '<field>: <reason>'."""


# Checked in order: a subclass before its base.
_EXIT_CODES = ((CheckpointMismatch, EXIT_BAD_INPUT), (NonFiniteLoss, EXIT_NONFINITE),
               (CheckpointError, EXIT_CHECKPOINT), (Preempted, EXIT_PREEMPTED), (Interrupted, EXIT_INTERRUPTED),
               ((ConfigError, DataError, SourceError, TokenizerError, HFError, PlanError, ReportError),
                EXIT_BAD_INPUT))
KNOWN = tuple(kind for kinds, _ in _EXIT_CODES for kind in (kinds if isinstance(kinds, tuple) else (kinds,)))


def exit_code(error: BaseException) -> int | None:
    """The documented exit code of a known failure; None for anything else (a bug)."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return next((code for kinds, code in _EXIT_CODES if isinstance(error, kinds)), None)


def message(error: BaseException) -> str:
    """The one line a command prints for a known failure."""
    if isinstance(error, KeyboardInterrupt):  # outside training: nothing of its own to report
        return "interrupted"
    line = str(error) if isinstance(error, (Preempted, Interrupted)) else f"error: {error}"
    return line.splitlines()[0] if line.strip() else f"error: {type(error).__name__}"
