"""Writes a prepared data dir and guards its output: the shards, the dir made to appear whole, and its upload.

A shard is one ArrayRecord file (a record per document) with its lengths, blocks and offsets indexes beside
it. A data dir appears whole or not at all: built in a sibling temp dir and renamed into place (the default
corpus), or in a resumable work dir `.<name>.partial` whose finished shards survive an interrupted run (your
own inputs), under a lock that lets one preparer at a time work on it. Data already there is reused when its
settings match and refused otherwise; a bucket's data is prepared locally, then uploaded, its manifest last.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import sys
import tempfile

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from jaxtrain import files, storage
from jaxtrain.data import chunks, layout
from jaxtrain.errors import ConfigError, DataError

PARTIAL = ".partial"  # sibling work dir `.<name>.partial`: finished shards survive an interrupted run


def write_shard(path: str, token_lists: list[np.ndarray], weights: list[np.ndarray] | None = None) -> dict:
    """One ArrayRecord file (a record per document: its tokens, then chat data's uint8 loss weights) plus its
    lengths index; returns its manifest row."""
    # Chunks of CHUNK_RECORDS records: a reader's index holds an entry per chunk (group_size:1 costs 35 bytes
    # per record in every open reader), while reading one record decodes only its small chunk.
    writer = ArrayRecordWriter(path, f"group_size:{layout.CHUNK_RECORDS}")
    for k, tokens in enumerate(token_lists):
        writer.write(tokens.tobytes() + (weights[k].astype(np.uint8).tobytes() if weights is not None else b""))
    writer.close()
    lengths = np.array([len(t) for t in token_lists], np.uint32)
    # The indexes let the pipeline skip reading every record at start; np.save(str) would append ".npy".
    with open(path + layout.LENGTHS_SUFFIX, "wb") as f:
        np.save(f, lengths)
    with open(path + layout.BLOCKS_SUFFIX, "wb") as f:
        np.save(f, layout.block_tokens(lengths))
    with open(path + layout.OFFSETS_SUFFIX, "wb") as f:
        np.save(f, chunks.block_offsets(path, len(token_lists), layout.BLOCK_RECORDS, layout.CHUNK_RECORDS))
    name = os.path.basename(path)
    return {"file": name, "docs": len(token_lists), "tokens": int(lengths.sum(dtype=np.int64)),
            "sha256": files.file_hash(path), "lengths": name + layout.LENGTHS_SUFFIX,
            "blocks": name + layout.BLOCKS_SUFFIX, "offsets": name + layout.OFFSETS_SUFFIX,
            "block_records": layout.BLOCK_RECORDS}


def write_split(out_dir: str, split: str, token_lists: list[np.ndarray], num_shards: int) -> list[dict]:
    """Writes contiguous runs of documents to shards; returns their manifest rows."""
    return [write_shard(os.path.join(out_dir, f"{split}-{i:05d}-of-{num_shards:05d}.array_record"),
                        [token_lists[j] for j in idx])
            for i, idx in enumerate(np.array_split(np.arange(len(token_lists)), num_shards))]


# --- The output dir: reused with the same settings, else refused; made to appear whole -----------------


def _cut(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_settings(data_dir: str, manifest: dict, wanted: dict) -> dict:
    # Cut long values (an input list of many files) so the error stays one readable line.
    diffs = [f"{k}={_cut(manifest.get(k))} (requested {_cut(v)})" for k, v in wanted.items() if manifest.get(k) != v]
    if diffs:
        raise DataError(
            f"{data_dir}: holds data prepared with different settings: "
            + ", ".join(diffs)
            + "; use another directory or delete this one"
        )
    return manifest


def existing_manifest(data_dir: str, settings: dict) -> dict | None:
    """The manifest of data already prepared with `settings` in data_dir; None if data_dir is free to use.
    Data made with other settings, or a non-empty dir without a manifest, is refused (DataError)."""
    if os.path.exists(os.path.join(data_dir, layout.MANIFEST)):
        return _check_settings(data_dir, layout.load_manifest(data_dir), settings)
    if os.path.exists(data_dir) and (not os.path.isdir(data_dir) or os.listdir(data_dir)):
        raise DataError(f"{data_dir}: exists but has no {layout.MANIFEST}; refusing to overwrite it")
    return None


def build_atomically(data_dir: str, settings: dict, build) -> dict:
    """Runs build(tmp_dir) -> manifest and renames tmp_dir to data_dir as a whole."""
    parent, name = os.path.split(data_dir)
    os.makedirs(parent, exist_ok=True)
    # Build in a sibling temp dir and rename it into place as a whole: an
    # interrupted run leaves only a ".tmp" dir, never a data_dir that looks done.
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        manifest = build(tmp)
        with open(os.path.join(tmp, layout.MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700.
        try:
            os.rename(tmp, data_dir)  # Also replaces an empty data_dir.
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # A concurrent preparer won the race: use its result.
            return _check_settings(data_dir, layout.load_manifest(data_dir), settings)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # No-op after a successful rename.
    return manifest


def local_output(data_dir: str) -> str:
    """The absolute path of a local output dir; ConfigError for a URL (pathlib would make it a local "gs:"): a
    bucket's data is prepared in a local staging dir, then `publish`ed."""
    if problem := files.dir_problem(data_dir) if "://" in str(data_dir) else None:
        raise ConfigError("--output", problem)
    return os.path.abspath(data_dir)


# --- Your own data's work dir: one preparer at a time, finished shards kept across interruptions -------


@contextlib.contextmanager
def locked(data_dir: str):
    """One preparer per output dir at a time; a second one waits, then finds the finished data. The holder
    removes the lock file as it leaves, so nothing is left beside the output; a waiter that then holds a removed
    file's lock tries again on the new one."""
    parent, name = os.path.split(data_dir)
    files.make_dir(parent, "--output")
    path = os.path.join(parent, f".{name}.lock")
    while True:
        f = open(path, "a")  # noqa: SIM115 - held across the yield
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        os.unlink(path)
        f.close()


def work_path(data_dir: str) -> str:
    parent, name = os.path.split(data_dir)
    return os.path.join(parent, f".{name}{PARTIAL}")


def work_dir(data_dir: str, settings: dict, input_mtimes: list, print_fn) -> str:
    """The sibling work dir, reused if an interrupted run left it with the same settings, else emptied."""
    work = work_path(data_dir)
    state_file = os.path.join(work, "settings.json")
    try:
        with open(state_file) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError):
        saved = None
    # The mtimes ride along only to spare a resume re-hashing unchanged inputs; they are not settings.
    if saved is None or {k: v for k, v in saved.items() if k != "input_mtimes"} != json.loads(json.dumps(settings)):
        if saved is not None:
            print_fn(f"prepare: discarding the unfinished work in {work}: it was for other inputs or settings",
                     file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)  # our own scratch, never a finished data dir
        os.makedirs(work)
        files.write_json(state_file, {**settings, "input_mtimes": input_mtimes})
    return work


def done_name(index: int) -> str:
    return f"shard-{index:05d}.done.json"


def finished_shard(work: str, index: int, key: str) -> dict | None:
    """The record of a shard an earlier (interrupted) run finished with the same key, if its files verify."""
    try:
        with open(os.path.join(work, done_name(index))) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("key") != key:
        return None
    for row in filter(None, (record["train"], record["heldout"])):
        path = os.path.join(work, row["file"])
        indexes = ("file", "lengths", "blocks", "offsets")
        if not all(os.path.exists(os.path.join(work, row.get(k, "-"))) for k in indexes) or \
                files.file_hash(path) != row["sha256"]:
            return None
    return record


# --- Into a bucket: prepared locally, then uploaded, the manifest last ----------------------------------


def staging_dir(url: str) -> str:
    """Where data for the bucket dir `url` is prepared (and resumed) before `publish` uploads it."""
    return files.url_cache("staging", url)


def publish(local_dir: str, url: str, print_fn=print) -> dict:
    """Uploads the prepared local_dir to the bucket dir `url` (gs:// or s3://), its manifest last, so a reader
    never sees a manifest before its shards; returns the manifest. The same data already there is left as it
    is; other data (another manifest) is refused (DataError), never overwritten."""
    storage.check_url(url, "--output")
    manifest = layout.load_manifest(local_dir)
    remote = os.path.join(url, layout.MANIFEST)
    if storage.exists(remote):
        there = json.loads(storage.read_bytes(remote))
        if (there.get("splits"), there.get("tokenizer")) == (manifest["splits"], manifest["tokenizer"]):
            print_fn(f"prepare: {url} already holds this data", flush=True)
            return manifest
        raise DataError(f"{remote}: {url} holds other prepared data; refusing to overwrite it (give another "
                        f"--output, or delete it first)")
    storage.upload_dir(local_dir, url, last=layout.MANIFEST, print_fn=print_fn)
    return manifest
