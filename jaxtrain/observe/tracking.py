"""What a run was: WORKDIR/run.json, and the redaction of secrets from everything a run logs.

run.json (process 0 rewrites it atomically at the start and end of every invocation) holds the resolved config
(redacted), the git commit, package versions, devices, processes and seed, when the workdir's first invocation
started and its latest ended, the latest status (running, finished, stopped, preempted, failed, interrupted)
and one attempt per invocation (docs/experiments.md). A value is redacted when a word of its key is token,
key, password, passwd, secret or credential(s) (`wandb_api_key`; not `max_new_tokens`), and a password in a
URL (`postgresql://user:PASS@host`) is redacted wherever it appears.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from jaxtrain.errors import Interrupted, Preempted
from jaxtrain.files import write_json

REDACTED = "<redacted>"
SECRET_WORDS = {"token", "key", "password", "passwd", "secret", "credential", "credentials", "apikey"}
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)(?P<password>[^@/\s]+)(?=@)")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "grain", "numpy",
            "ml_collections", "tokenizers", "jaxtrain")


def is_secret_key(key) -> bool:
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower())
    return any(w in SECRET_WORDS for w in words)


def redact(value, key=None):
    """A copy of `value` (dicts, lists, strings, numbers) with secrets replaced by "<redacted>"."""
    if key is not None and is_secret_key(key) and value not in ("", None):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED, value)
    return value


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with secrets redacted: `--config.log.wandb_api_key=X` and `--api_key X` by the flag's name,
    and URL passwords anywhere (W&B records the command line of its runs)."""
    out, hide_next = [], False
    for arg in argv:
        name, eq, value = arg.partition("=")
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
        elif eq and name.startswith("-") and is_secret_key(name.rsplit(".", 1)[-1]) and value:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(redact(arg))
        hide_next = not eq and arg.startswith("-") and is_secret_key(arg.rsplit(".", 1)[-1])
    return out


def git_state(path: Path | None = None) -> dict:
    """{"commit", "dirty"} of the checkout holding `path` (default: this package); nulls if it is none."""
    cwd = path or Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def package_versions() -> dict:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def status_of(error: BaseException | None, finished: bool) -> str:
    if error is None:
        return "finished" if finished else "stopped"
    if isinstance(error, Preempted):
        return "preempted"
    if isinstance(error, (KeyboardInterrupt, Interrupted)):
        return "interrupted"
    return "failed"


class RunRecord:
    """WORKDIR/run.json for one invocation: `start()` when training is about to begin, `end()` after.

    Earlier invocations' attempts are kept, so the file tells the whole history of the workdir."""

    def __init__(self, workdir, config: dict, *, devices: dict, processes: int, seed: int):
        self.path = Path(workdir) / "run.json"
        self.config, self.devices, self.processes, self.seed = redact(config), devices, processes, seed

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def start(self, step: int, started_unix: float | None = None) -> None:
        """`started_unix`: when this invocation began (startup counts toward wall time and cost)."""
        now = started_unix or time.time()
        earlier = self._load()
        attempts = [a for a in earlier.get("attempts", []) if isinstance(a, dict)]
        for a in attempts:  # an invocation killed with SIGKILL never wrote its end
            if a.get("status") == "running":
                a["status"] = "killed"
        attempts.append({"start_time": _iso(now), "start_unix": round(now, 3), "end_time": None, "end_unix": None,
                         "status": "running", "start_step": int(step), "end_step": None})
        first = attempts[0]["start_unix"]
        self.data = {"config": self.config, "git": git_state(), "packages": package_versions(),
                     "devices": self.devices, "processes": self.processes, "seed": self.seed,
                     "start_time": _iso(first), "start_unix": first, "end_time": None, "end_unix": None,
                     "status": "running", "attempts": attempts}
        write_json(self.path, self.data)

    def end(self, status: str, step: int | None, error: BaseException | None = None) -> None:
        now = time.time()
        attempt = self.data["attempts"][-1]
        attempt.update(end_time=_iso(now), end_unix=round(now, 3), status=status, end_step=step)
        if error is not None:
            attempt["error"] = redact(f"{type(error).__name__}: {error}".splitlines()[0])
        self.data.update(end_time=_iso(now), end_unix=round(now, 3), status=status)
        write_json(self.path, self.data)
