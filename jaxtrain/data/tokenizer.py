"""Tokenizers: a byte-level BPE trained locally with HF `tokenizers` (no downloads), or a given HF
`tokenizer.json` or SentencePiece `.model`, behind one small interface (`Tokenizer`)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxtrain.errors import TokenizerError

PAD_TOKEN, EOS_TOKEN = "<|pad|>", "<|endoftext|>"
PAD_ID, EOS_ID = 0, 1  # Fixed ids in the BPE we train: the trainer assigns special tokens first, in order.
# End-of-document tokens of common tokenizers, tried in order when a given tokenizer.json is used.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
SENTENCEPIECE_SUFFIX = ".model"


class Tokenizer:
    """What prepare and the trainer need from a tokenizer: batch encode, decode, vocab size and EOS id.
    `kind` is "hf" (a tokenizer.json) or "sentencepiece" (a .model file)."""

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        self.path = os.fspath(path)
        try:
            if self.path.endswith(SENTENCEPIECE_SUFFIX):
                self.kind, self._impl = "sentencepiece", _load_sentencepiece(self.path)
            else:
                self.kind, self._impl = "hf", _treat_text_as_text(tokenizers.Tokenizer.from_file(self.path))
        except TokenizerError:
            raise
        except Exception as e:  # both libraries raise their own exception types for a bad file
            raise TokenizerError(f"{self.path}: not a readable {self.kind_name()} ({e})") from None
        self.eos_id = self._find_eos(eos_token)

    def kind_name(self) -> str:
        return "SentencePiece model" if self.path.endswith(SENTENCEPIECE_SUFFIX) else "tokenizer.json"

    def _find_eos(self, eos_token: str | None) -> int:
        if self.kind == "sentencepiece":
            eos = self._impl.piece_to_id(eos_token) if eos_token else self._impl.eos_id()
            if eos < 0 or (eos_token and self._impl.id_to_piece(eos) != eos_token):
                raise TokenizerError(f"{self.path}: no end-of-document token {eos_token or '(eos_id)'}; "
                                     f"pass --eos_token with a piece it has")
            return int(eos)
        for token in (eos_token,) if eos_token else EOS_CANDIDATES:
            if (eos := self._impl.token_to_id(token)) is not None:
                return int(eos)
        raise TokenizerError(f"{self.path}: none of {list((eos_token,) if eos_token else EOS_CANDIDATES)} is a "
                             f"token; pass --eos_token with the token that ends a document")

    @property
    def vocab_size(self) -> int:
        return self._impl.get_piece_size() if self.kind == "sentencepiece" else self._impl.get_vocab_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """No BOS/EOS or other template tokens: the caller appends EOS between documents."""
        if self.kind == "sentencepiece":
            return self._impl.encode(texts)
        return [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=False)


def _load_sentencepiece(path: str):
    try:
        import sentencepiece
    except ImportError:
        raise TokenizerError(f"{path}: a SentencePiece model needs `pip install 'jaxtrain[sentencepiece]'`") from None
    return sentencepiece.SentencePieceProcessor(model_file=path)


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


def load(path: str | os.PathLike, eos_token: str | None = None) -> Tokenizer:
    return Tokenizer(path, eos_token)


def _treat_text_as_text(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    # A literal "<|endoftext|>" inside a document must stay text, not become
    # EOS_ID. This flag is not saved in tokenizer.json, so set it on every load.
    tok.encode_special_tokens = True
    return tok


