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

import json
import os
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
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


def prepared_from_sources(data_dir: str) -> bool:
    """Whether data_dir holds data made by `prepare --input` (rather than the default corpus)."""
    return storage.exists(os.path.join(data_dir, MANIFEST)) and load_manifest(data_dir).get("corpus") == "sources"


def verified_tokenizer(data_dir: str) -> str:
    """Path of the data dir's tokenizer.json, after checking it is the one its shards were made with."""
    manifest = load_manifest(data_dir)
    path = os.path.join(data_dir, manifest["tokenizer"]["file"])
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
    names = [MANIFEST, manifest["tokenizer"]["file"]]
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
