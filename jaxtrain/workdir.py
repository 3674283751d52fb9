"""The workdir: one writer at a time, and the config its checkpoints were made with.

`claim` takes an exclusive `fcntl.flock` on WORKDIR/.lock before the run writes anything there, so a second run,
sweep trial or supervisor on the same workdir exits 2 at once, naming the holder (its host, pid and start, which
the holder writes into the file). A flock belongs to the open file and dies with its process: a SIGKILLed run never
blocks its restart. flock works on local disks and NFSv4; on a filesystem without locks the claim fails with a
one-line error rather than run unguarded. A supervisor holds the lock for its whole run and hands the open file
to its children (JAXTRAIN_WORKDIR_LOCK_FD), which then hold it as theirs. Multi-host: process 0 takes the lock,
and every process follows its answer.

config.json is the config the checkpoints were made with: written once, atomically, only once every check of
the run's input has passed and while no checkpoint exists, so a run that failed early leaves nothing that
blocks a corrected rerun. What a run added to its workdir (the workdir too, if it created it) is removed again
if it fails before writing config.json.
run_id names the workdir's checkpoints (jaxtrain/checkpoint.py checks it), so one copied in from elsewhere is
not restored.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path

from jaxtrain import files
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import distributed

LOCK = ".lock"
CONFIG = "config.json"
RUN_ID = "run_id"  # names this workdir's checkpoints: one copied in from another workdir is not restored
FD_ENV = "JAXTRAIN_WORKDIR_LOCK_FD"  # an inherited, already locked open file of WORKDIR/.lock


class Lock:
    """An exclusive lock on one workdir, held by this process until `release`."""

    def __init__(self, workdir):
        self.workdir = Path(workdir)
        self.path = self.workdir / LOCK
        self.fd: int | None = None

    def acquire(self) -> None:
        """ConfigError('workdir', ...) naming the holder if another process holds the lock."""
        inherited = _inherited_fd(self.path)
        if inherited is not None:
            self.fd = inherited
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError("workdir", f"{self.workdir}: cannot write ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise ConfigError("workdir", f"{self.workdir} is in use by another run ({holder(self.path)}); wait "
                                  f"for it to end or use another workdir") from None
            raise ConfigError("workdir", f"{self.workdir}: cannot lock {LOCK} ({e.strerror}); the workdir must be "
                              f"on a filesystem with file locks") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None and self.fd != _inherited_fd(self.path):
            os.close(self.fd)  # closing the only open file releases the flock
        self.fd = None

    def inheritable_env(self) -> dict:
        """Environment and fd for a child process that should hold this lock as its own (the supervisor's runs)."""
        os.set_inheritable(self.fd, True)
        return {FD_ENV: str(self.fd)}


def holder(path) -> str:
    """Who holds the lock at `path`, as its holder wrote it."""
    try:
        info = json.loads(Path(path).read_text())
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"see {path}"


def _inherited_fd(path: Path) -> int | None:
    """The fd named by JAXTRAIN_WORKDIR_LOCK_FD if it is an open file of `path` (a parent's lock), else None."""
    value = os.environ.get(FD_ENV, "")
    if not value.isdigit():
        return None
    try:
        mine, theirs = os.fstat(int(value)), os.stat(path)
    except OSError:
        return None
    return int(value) if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino) else None


def read_config(workdir) -> dict:
    """WORKDIR/config.json; ConfigError naming it when it is missing or damaged (it is never rewritten here:
    it records what the checkpoints were made with)."""
    path = Path(workdir) / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("workdir", f"{path} not found: not a jaxtrain workdir") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError("workdir", f"{path}: unreadable ({type(e).__name__}: {e}); it records the config the "
                          f"checkpoints were made with: restore it from a copy, or move it aside to resume without "
                          f"that check") from None
    if not isinstance(config, dict):
        raise ConfigError("workdir", f"{path}: holds a {type(config).__name__}, not a config")
    return config


class Workdir:
    """A run's workdir, claimed: `claim` checks and locks it, `record_config` writes config.json, `close` releases
    the lock and, if the run failed before config.json, removes what it added (the workdir, if it created it)."""

    def __init__(self, path, *, is_main: bool):
        self.path, self.is_main = Path(path), is_main
        self.lock = Lock(path) if is_main else None
        self.created = False
        # The workdir's entries when process 0 claimed it (none if it created it); None once it holds a run.
        self.found: set[str] | None = None

    def __enter__(self) -> Workdir:
        return self.claim()

    def __exit__(self, kind, error, traceback) -> None:
        self.close(failed=error is not None)

    def claim(self) -> Workdir:
        path = self.path
        if path.exists() and not path.is_dir():
            raise ConfigError("workdir", f"{path} exists and is not a directory")
        # An absolute workdir's parent must exist: a missing mount is an error, not a new local directory.
        if path.is_absolute() and not path.parent.is_dir():
            what = "is not a directory" if path.parent.exists() else "does not exist"
            raise ConfigError("workdir", f"parent directory {path.parent} {what}")
        error = None
        if self.is_main:
            try:
                self.created = not path.exists()
                self.found = set() if self.created else {p.name for p in path.iterdir()}
                path.mkdir(parents=True, exist_ok=True)
                self.lock.acquire()
            except OSError as e:
                error = ConfigError("workdir", f"{path}: cannot write ({e.strerror})")
            except ConfigError as e:
                error = e
        if not distributed.from_process_0(error is None):  # every process follows process 0
            self._remove_if_created()
            raise error or ConfigError("workdir", f"{path}: process 0 could not claim it")
        return self

    def saved_config(self) -> dict | None:
        """The config.json the checkpoints were made with, or None."""
        return read_config(self.path) if (self.path / CONFIG).exists() else None

    def run_id(self, create: bool) -> str | None:
        """This workdir's run id (process 0; None elsewhere, and before one exists unless `create`). A copy of a
        whole workdir keeps it: the copy is a fork of the same run."""
        if not self.is_main:
            return None
        path = self.path / RUN_ID
        try:
            return path.read_text().strip() or None
        except FileNotFoundError:
            if not create:
                return None
        value = uuid.uuid4().hex
        files.write_text(path, value + "\n")
        return value

    def record_config(self, config: dict) -> None:
        """Writes config.json (process 0, atomically). For a workdir without checkpoints: an earlier config.json
        there binds nothing, since no checkpoint was made with it."""
        if self.is_main:
            files.write_json(self.path / CONFIG, config)
            self.created, self.found = False, None  # from here the workdir holds a run

    def close(self, failed: bool) -> None:
        if failed:
            self._remove_if_created()
        if self.lock:
            self.lock.release()

    def _remove_if_created(self) -> None:
        """Empties nothing: removes what this run added to the workdir, the lock file (unless one was there) and
        directories it left empty, bottom up; the workdir itself too if this run created it."""
        if not self.is_main or self.found is None or not self.path.is_dir():
            return
        if LOCK not in self.found:
            (self.path / LOCK).unlink(missing_ok=True)
        tops = [self.path] if self.created else [p for p in self.path.iterdir() if p.name not in self.found]
        for top in tops:
            for root, dirs, names in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
                if not names:
                    try:
                        os.rmdir(root)
                    except OSError:
                        pass
