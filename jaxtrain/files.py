"""Small file helpers every layer uses: atomic JSON writes and content hashes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from etils import epath


def write_json(path: str | os.PathLike, data: dict) -> None:
    """`data` as JSON at `path`, written to a temporary file and renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)  # a reader never sees half a file


def file_hash(path: str | os.PathLike) -> str:
    """sha256 hex of a file (tokenizer.json, shards, prepare's inputs: so any etils.epath path, gs:// too)."""
    h = hashlib.sha256()
    with epath.Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
