"""Tokenizers: a byte-level BPE trained locally with HF `tokenizers` (no downloads), or a given HF
`tokenizer.json`, SentencePiece `.model` or Hugging Face model directory, behind one small interface (`Tokenizer`).

A directory is read as transformers 5's AutoTokenizer reads it with a tokenizer.json (PreTrainedTokenizerFast):
the EOS is tokenizer_config.json's `eos_token`, and encoding applies tokenizer.json's post-processor (Llama 3's
and Gemma's BOS). transformers drops tokenizer_config.json's add_bos_token/add_eos_token when a tokenizer.json
exists, and so do we. A lone tokenizer.json file is used without its post-processor, as before.
"""

from __future__ import annotations

import json
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
# A Hugging Face model directory's tokenizer files.
HF_TOKENIZER, HF_TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


class Tokenizer:
    """What prepare and the trainer need from a tokenizer: batch encode, decode, vocab size and EOS id.
    `kind` is "hf" (a tokenizer.json) or "sentencepiece" (a .model file); `hf_dir` is the Hugging Face
    directory it came from (None for a file), whose template tokens `encode` adds (module docstring)."""

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        self.path, self.hf_dir = os.fspath(path), None
        if os.path.isdir(self.path):
            self.hf_dir, self.path = self.path, os.path.join(self.path, HF_TOKENIZER)
            if not os.path.isfile(self.path):
                spm = os.path.join(self.hf_dir, "tokenizer.model")
                hint = f"; for its SentencePiece model pass {spm}" if os.path.isfile(spm) else ""
                raise TokenizerError(f"{self.path}: not found: {self.hf_dir} has no Hugging Face tokenizer{hint}")
            eos_token = eos_token or _special_token(read_hf_config(self.hf_dir), "eos_token")
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
        # A template that ends with EOS (add_eos_token style) would end each document twice: callers append it.
        self._drop_eos = self.hf_dir is not None and self._template_ends_with_eos()

    def _template_ends_with_eos(self) -> bool:
        plain, templated = (self._impl.encode("a", add_special_tokens=t).ids for t in (False, True))
        return templated[-1:] == [self.eos_id] and plain[-1:] != [self.eos_id]

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
        """Without EOS: the caller appends it where a document ends. A file adds no template tokens; an HF
        directory adds its post-processor's (e.g. a BOS), as AutoTokenizer would."""
        if self.kind == "sentencepiece":
            return self._impl.encode(texts)
        ids = [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=self.hf_dir is not None)]
        return [i[:-1] if i[-1:] == [self.eos_id] else i for i in ids] if self._drop_eos else ids

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of text a chat template rendered, as transformers' apply_chat_template
        encodes it: no post-processor tokens, and the special tokens the template wrote are special tokens."""
        if self.kind == "sentencepiece":
            raise TokenizerError(f"{self.path}: chat data needs a Hugging Face directory with a tokenizer.json")
        literal, self._impl.encode_special_tokens = self._impl.encode_special_tokens, False
        try:
            encoding = self._impl.encode(text, add_special_tokens=False)
        finally:
            self._impl.encode_special_tokens = literal
        return encoding.ids, encoding.offsets

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
    """A tokenizer.json, a SentencePiece .model or a Hugging Face model directory (see the module docstring)."""
    return Tokenizer(path, eos_token)


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """A Hugging Face directory's tokenizer_config.json ({} when it has none)."""
    path = os.path.join(hf_dir, HF_TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return config


def _special_token(config: dict, name: str) -> str | None:
    # A plain string, or a serialized AddedToken {"content": ...}.
    value = config.get(name)
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _treat_text_as_text(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    # A literal "<|endoftext|>" inside a document must stay text, not become
    # EOS_ID. This flag is not saved in tokenizer.json, so set it on every load.
    tok.encode_special_tokens = True
    return tok


