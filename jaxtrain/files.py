"""Small file helpers every layer uses: atomic JSON writes, content hashes, directories made with one-line errors
and Python files (configs, sweeps) loaded with one-line errors."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from etils import epath

from jaxtrain.errors import ConfigError


def write_json(path: str | os.PathLike, data: dict) -> None:
    """`data` as JSON at `path`, written to a temporary file and renamed into place."""
    write_text(path, json.dumps(data, indent=1, default=str))


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` at `path`, written to a temporary file and renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a file


def user_cache(*parts: str) -> str:
    """~/.cache/jaxtrain/<parts>: what jaxtrain can rebuild (the default corpus, copies of bucket files, staged
    uploads, the CPU's measured peak)."""
    return str(Path.home().joinpath(".cache", "jaxtrain", *parts))


def url_cache(kind: str, url: str) -> str:
    """A `user_cache` dir of its own for `url` under `kind` (named by the URL's hash)."""
    return user_cache(kind, hashlib.sha256(url.encode()).hexdigest()[:16])


def file_hash(path: str | os.PathLike) -> str:
    """sha256 hex of a file (tokenizer.json, shards, prepare's inputs: so any etils.epath path, gs:// too)."""
    h = hashlib.sha256()
    with epath.Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be or become a directory (it, or a parent on the way, is a file, or it is a URL, which
    pathlib would turn into a local "gs:" dir); None if it can."""
    if "://" in str(path):
        return f"{path}: must be a local path (a bucket can be mounted with gcsfuse or mountpoint-s3)"
    path = Path(path)
    for ancestor in (path, *path.parents):
        if ancestor.exists():
            if ancestor.is_dir():
                return None
            return f"{path} exists and is not a directory" if ancestor == path else f"{path}: {ancestor} is a file"
    return None


def make_dir(path: str | os.PathLike, field: str) -> Path:
    """Creates `path` and its parents; ConfigError(field, ...) naming the path and why it cannot be."""
    path = Path(path)
    problem = dir_problem(path)
    if problem:
        raise ConfigError(field, problem)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(field, f"{path}: cannot create ({e.strerror})") from None
    return path


def run_python_file(path: str | os.PathLike, function: str, *args, field: str):
    """`function(*args)` from the Python file at `path` (a config or sweep file). Any failure of the user's file
    (missing, a directory, a syntax error, no such function, it raises) is ConfigError(field, ...): one line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(field, f"{path}: {'is a directory' if path.is_dir() else 'file not found'}")
    spec = importlib.util.spec_from_file_location(f"_jaxtrain_file_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any error in the user's file is bad input
        raise ConfigError(field, f"{path}: {type(e).__name__}: {e}".splitlines()[0]) from None
    if not callable(getattr(module, function, None)):
        raise ConfigError(field, f"{path}: no {function}() function")
    try:
        return getattr(module, function)(*args)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(field, f"{path}: {function}() raised {type(e).__name__}: {e}".splitlines()[0]) from None
