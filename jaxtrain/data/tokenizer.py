"""Byte-level BPE tokenizer, trained locally with HF `tokenizers` (no downloads)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

PAD_TOKEN, EOS_TOKEN = "<|pad|>", "<|endoftext|>"
PAD_ID, EOS_ID = 0, 1  # Fixed ids: the trainer assigns special tokens first, in order.


def train_bpe(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Trains a byte-level BPE; the same texts give an identical tokenizer.json."""
    tok = tokenizers.Tokenizer(models.BPE())
    # No prefix space and no normalizer: decode(encode(t)) must return t exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        # All 256 bytes up front, so any later text (held-out docs) is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    _treat_text_as_text(tok)
    assert tok.token_to_id(PAD_TOKEN) == PAD_ID and tok.token_to_id(EOS_TOKEN) == EOS_ID
    return tok


def load(path: str | os.PathLike) -> tokenizers.Tokenizer:
    return _treat_text_as_text(tokenizers.Tokenizer.from_file(os.fspath(path)))


def _treat_text_as_text(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    # A literal "<|endoftext|>" inside a document must stay text, not become
    # EOS_ID. This flag is not saved in tokenizer.json, so set it on every load.
    tok.encode_special_tokens = True
    return tok


def file_hash(path: str | os.PathLike) -> str:
    """sha256 hex of a file (tokenizer.json, shards)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
