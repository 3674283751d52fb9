"""The prepared-data-dir format, as the trainer and the tools read it.

A prepared dir holds `manifest.json` (settings, inputs, dtype, EOS id, per-shard docs/tokens/sha256), the
tokenizer (`tokenizer.json` or `tokenizer.model`), and `train-*` / `heldout-*` ArrayRecord shards, each with a
`.lengths.npy` index (tokens per document) and a `.blocks.npy` one (tokens per block of BLOCK_RECORDS
documents, what the shuffle reads at start). corpus.py and prepare.py write it; this module is what reading
needs. Data made with a Hugging Face directory's tokenizer (manifest `tokenizer.hf_dir`) also holds its
tokenizer_config.json, and the data dir is then read as that directory (its template tokens, e.g. BOS,
start each encoded text).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from jaxtrain import files, storage
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.errors import DataError, TokenizerError

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_SPM = "tokenizer.model"
LENGTHS_SUFFIX = ".lengths.npy"
BLOCKS_SUFFIX = ".blocks.npy"
OFFSETS_SUFFIX = ".offsets.npy"  # byte offset of each block in the shard (chunks.py): range reads from buckets
BLOCK_RECORDS = 1024  # records per block of the block index and of the shuffle (even: pairs never straddle)
CHUNK_RECORDS = 16  # records per ArrayRecord chunk (group_size); divides BLOCK_RECORDS


def default_dir(data_cfg) -> str:
    """Where the default corpus is prepared when `data.dir` is empty."""
    name = f"{data_cfg.corpus}_v{data_cfg.vocab_size}_h{data_cfg.heldout_docs}"
    return data_cfg.dir or files.user_cache("data", name)


def block_tokens(lengths: np.ndarray, block_records: int = BLOCK_RECORDS) -> np.ndarray:
    """Tokens per block of `block_records` consecutive documents (the last block may be shorter)."""
    lengths = np.asarray(lengths, np.int64)
    return np.add.reduceat(lengths, np.arange(0, len(lengths), block_records)) if len(lengths) else lengths


def load_manifest(data_dir: str) -> dict:
    """The data dir's manifest (a local dir or a bucket's); DataError naming what is wrong."""
    path = os.path.join(data_dir, MANIFEST)
    if storage.is_url(data_dir):
        storage.check_url(data_dir, "data dir")
        if not storage.exists(path):
            raise DataError(f"{path}: missing, {data_dir} is not a prepared data dir; create it with `jaxtrain "
                            f"prepare --output {data_dir}`")
        text = storage.read_bytes(path)
    else:
        if not os.path.isdir(data_dir):
            raise DataError(f"{data_dir}: data dir does not exist; create it with `jaxtrain prepare --output "
                            f"{data_dir}`")
        try:
            with open(path, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            raise DataError(f"{path}: missing, {data_dir} is not a prepared data dir") from None
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    check_manifest(manifest, path)
    return manifest


TOKEN_DTYPES = ("uint16", "int32")  # what the writers write (vocabularies up to 2**16, and past it)
_SHARD_FILES = ("file", "lengths", "blocks", "offsets")


def content_id(manifest: dict, split: str) -> str:
    """What a split holds, as 16 hex digits: its shards (names, counts, sha256s, in order), the token dtype and the
    tokenizer; not the manifest's settings or input mtimes, which a rerun of the same prepare may change."""
    rows = [[r.get(k) for k in ("file", "docs", "tokens", "sha256")] for r in manifest["splits"].get(split, [])]
    key = json.dumps([manifest["dtype"], manifest["tokenizer"]["sha256"], rows], separators=(",", ":"))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _inside(name) -> bool:
    return isinstance(name, str) and bool(name) and not os.path.isabs(name) and ".." not in Path(name).parts


def check_manifest(manifest, path: str) -> None:
    """DataError naming the first field of a manifest that the readers cannot trust: its shape, the token dtype,
    file names inside the dir, counts that are non-negative integers, and each shard listed once. The files
    themselves are checked when a split opens (records.Split)."""
    def bad(field: str, why: str) -> DataError:
        return DataError(f"{path}: {field}: {why}; prepare the data again")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(manifest, dict):
        raise DataError(f"{path}: not a JSON object; prepare the data again")
    if manifest.get("dtype") not in TOKEN_DTYPES:
        raise bad("dtype", f"{manifest.get('dtype')!r} is not a token dtype the writers write ({', '.join(TOKEN_DTYPES)})")
    tokenizer = manifest.get("tokenizer")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("sha256"), str):
        raise bad("tokenizer", "must be an object with the tokenizer's sha256 (and its file)")
    if not _inside(tokenizer.get("file", TOKENIZER)):
        raise bad("tokenizer.file", f"{tokenizer['file']!r} is not a file name inside the data dir")
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise bad("splits", "missing or empty")
    seen: set[str] = set()
    for name, rows in splits.items():
        if not isinstance(rows, list):
            raise bad(f"splits.{name}", "must be a list of shards")
        for i, row in enumerate(rows):
            where = f"splits.{name}[{i}]"
            if not isinstance(row, dict) or not isinstance(row.get("file"), str):
                raise bad(where, "must be an object naming its file")
            for key in _SHARD_FILES:
                if key in row and not _inside(row[key]):
                    raise bad(f"{where}.{key}", f"{row[key]!r} is not a file name inside the data dir")
            for key in ("docs", "tokens"):
                if key in row and not count(row[key]):
                    raise bad(f"{where}.{key}", f"{row[key]!r} is not a count")
            if "block_records" in row and not (count(row["block_records"]) and row["block_records"] > 0):
                raise bad(f"{where}.block_records", f"{row['block_records']!r} is not a positive count")
            if row["file"] in seen:
                raise bad(f"{where}.file", f"{row['file']} is listed twice")
            seen.add(row["file"])
        if name == "train":  # prepare leaves out held-out shards that got no documents; train shards are all kept
            _check_numbering(name, [row["file"] for row in rows], bad)


_NUMBERED = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.array_record")


def _check_numbering(split: str, names: list[str], bad) -> None:
    """The train split's shards named `<stem>-<i>-of-<n>` (as every writer names them) must be all n of them: a
    shard removed from the list would otherwise go unnoticed. Names of another form (hand-made dirs) are not
    checked."""
    groups: dict[tuple[str, int], set[int]] = {}
    for name in names:
        if m := _NUMBERED.fullmatch(name):
            groups.setdefault((m["stem"], int(m["n"])), set()).add(int(m["i"]))
    for (stem, n), have in groups.items():
        if missing := sorted(set(range(n)) - have):
            raise bad(f"splits.{split}", f"lists {len(have)} of the {n} shards {stem}-*-of-{n:05d} (not "
                      f"{', '.join(f'{stem}-{i:05d}-of-{n:05d}.array_record' for i in missing[:3])}"
                      f"{' ...' if len(missing) > 3 else ''})")


def prepared_from_sources(data_dir: str) -> bool:
    """Whether data_dir holds data made by `prepare --input` (rather than the default corpus)."""
    return storage.exists(os.path.join(data_dir, MANIFEST)) and (
        load_manifest(data_dir).get("corpus") == "sources" or load_manifest(data_dir).get("kind") == "prompts")


def verified_tokenizer(data_dir: str) -> str:
    """Path of the data dir's tokenizer.json, after checking it is the one its shards were made with."""
    manifest = load_manifest(data_dir)
    path = os.path.join(data_dir, manifest["tokenizer"].get("file", TOKENIZER))
    if not storage.exists(path):
        raise DataError(f"{path}: missing; the shards in {data_dir} cannot be decoded without it")
    if (actual := files.file_hash(path)) != manifest["tokenizer"]["sha256"]:
        raise DataError(f"{path}: sha256 {actual[:12]} differs from {manifest['tokenizer']['sha256'][:12]}, the "
                        f"tokenizer the shards were made with (manifest.json); prepare the data again")
    return path


def open_tokenizer(path: str, eos_token: str | None) -> tok_lib.Tokenizer:
    """tokenizer.load, with an unusable file reported as bad data input."""
    try:
        return tok_lib.load(path, eos_token)
    except TokenizerError as e:
        raise DataError(str(e)) from None


def load_tokenizer(data_dir: str) -> tok_lib.Tokenizer:
    """The data dir's verified tokenizer, with the EOS id its documents end with."""
    if storage.is_url(data_dir):  # the tokenizer libraries open local files: read a local copy
        data_dir = local_tokenizer_dir(data_dir)
    manifest = load_manifest(data_dir)
    path = verified_tokenizer(data_dir)
    if manifest["tokenizer"].get("hf_dir"):  # prepared with a Hugging Face directory's tokenizer
        config = os.path.join(data_dir, tok_lib.HF_TOKENIZER_CONFIG)
        if (want := manifest["tokenizer"].get("config_sha256")) and (
                not storage.exists(config) or files.file_hash(config) != want):
            raise DataError(f"{config}: missing or changed since the shards were made (manifest.json); prepare "
                            f"the data again")
        path = data_dir
    # With the --eos_token the dir was prepared with: a given tokenizer.json may have no EOS by a known name.
    tok = open_tokenizer(path, manifest.get("eos_token"))
    tok.eos_id = manifest.get("eos_id", tok.eos_id)
    return tok


def local_tokenizer_dir(data_dir: str) -> str:
    """A local dir holding a bucket data dir's manifest and tokenizer files (what load_tokenizer reads), under
    ~/.cache/jaxtrain/remote/, refreshed on every call."""
    manifest = load_manifest(data_dir)
    names = [MANIFEST, manifest["tokenizer"].get("file", TOKENIZER)]
    if manifest["tokenizer"].get("hf_dir"):
        names.append(tok_lib.HF_TOKENIZER_CONFIG)
    local = Path(remote_cache(data_dir))
    for name in names:
        if storage.exists(path := os.path.join(data_dir, name)):
            storage.local_copy(path, str(local))
    return str(local)


def remote_cache(data_dir: str) -> str:
    """The local dir for copies of a bucket data dir's files (tokenizer, sparse shards)."""
    return files.url_cache("remote", data_dir)
