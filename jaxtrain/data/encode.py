"""Text -> token arrays: documents (each ending with the tokenizer's EOS id), and chat conversations and
preference pairs rendered with a chat template, with their loss weights (which tokens the loss counts).

Both preparations, the default corpus (corpus.py) and your own inputs (prepare.py), encode through it, so a
document becomes the same tokens whichever writes it. `chat_settings` checks what chat encoding needs (the
template, its variables, the length bound) before anything is read.
"""

from __future__ import annotations

import collections
import hashlib
import os

import numpy as np

from jaxtrain.data import chat as chat_lib
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.errors import DataError

CHAT_TEMPLATE = chat_lib.TEMPLATE_FILE  # in a chat data dir: the template its conversations were rendered with
TRUNCATE = ("left", "drop")


def chat_settings(tokenizer: str | None, template: str | None, max_len: int | None, truncate: str,
                  pairs: bool = False) -> dict:
    """What chat preparation needs, checked before anything is read: the template (the tokenizer directory's, or
    a file), its variables (BOS, EOS) and the length bound."""
    if not tokenizer or not os.path.isdir(tokenizer):
        raise DataError(f"{tokenizer or '--tokenizer'}: chat data needs --tokenizer HF_MODEL_DIR (a Hugging Face "
                        f"directory with tokenizer.json and tokenizer_config.json)")
    if truncate not in TRUNCATE:
        raise DataError(f"--truncate: {truncate!r} is not one of {', '.join(TRUNCATE)}")
    if max_len is not None and max_len < 1:
        raise DataError(f"--max_len: must be a positive number of tokens, got {max_len}")
    text = chat_lib.load_template(template or tokenizer)
    chat_lib.check_syntax(text)  # a template that cannot compile fails every record: say so before reading them
    return {"template": text, "template_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "variables": chat_lib.special_tokens(tokenizer), "max_len": max_len, "truncate": truncate,
            **({"preference": True} if pairs else {})}


TOKENIZE_BATCH_BYTES = 4 << 20  # text per encode_batch call


def tokenize(tok: tok_lib.Tokenizer, docs: list[str], dtype: np.dtype) -> list[np.ndarray]:
    # In batches of ~4 MB: HF Encoding objects (and SentencePiece's Python lists) cost ~30x the text, so a
    # 256 MB shard tokenized in one call would peak at several GB per worker.
    eos = np.array([tok.eos_id], dtype=dtype)
    out, start = [], 0
    while start < len(docs):
        stop, size = start + 1, len(docs[start])
        while stop < len(docs) and size < TOKENIZE_BATCH_BYTES:
            size += len(docs[stop])
            stop += 1
        out.extend(np.concatenate([np.asarray(ids, dtype=dtype), eos]) for ids in tok.encode_batch(docs[start:stop]))
        start = stop
    return out


def encode_conversations(tok, records: list, dtype: np.dtype, chat: dict, counts: collections.Counter):
    """Chat records -> (token arrays, loss-weight arrays), each conversation rendered with the template and cut
    to chat["max_len"] (its oldest tokens dropped, or the whole conversation, per chat["truncate"]). Records that
    are not conversations, and conversations left with no assistant token, are skipped and counted. Preference
    data (chat["preference"]) gives two arrays per record, chosen then rejected (see _encode_pairs)."""
    if chat.get("preference"):
        return _encode_pairs(tok, records, dtype, chat, counts)
    ids_out, weights_out = [], []
    max_len = chat["max_len"]
    for record in records:
        try:
            ids, weights = chat_lib.encode(tok, chat["template"], chat_lib.conversation(record), chat["variables"])
        except chat_lib.TemplateFailure as e:
            _count_template_failure(counts, e)
            continue
        except DataError:
            counts["skipped_not_a_conversation"] += 1
            continue
        if max_len and len(ids) > max_len:
            if chat["truncate"] == "drop":
                counts["dropped_too_long"] += 1
                continue
            ids, weights = ids[-max_len:], weights[-max_len:]
            counts["truncated"] += 1
        if not weights.any():
            counts["skipped_no_assistant_tokens"] += 1
            continue
        counts["conversations"] += 1
        counts["longest"] = max(counts["longest"], len(ids))
        ids_out.append(np.asarray(ids, dtype))
        weights_out.append(weights)
    return ids_out, weights_out


def _encode_pairs(tok, records: list, dtype: np.dtype, chat: dict, counts: collections.Counter):
    """Preference records -> [chosen, rejected, chosen, rejected, ...] token and weight arrays: the prompt with
    each response, weighted on the response only. A pair is packed into one row whole, so chat["max_len"] bounds
    the two together; a longer pair is dropped, or (truncate="left") each side loses its oldest tokens, the
    longer side first, until they fit."""
    ids_out, weights_out = [], []
    max_len = chat["max_len"]
    for record in records:
        try:
            prompt, chosen, rejected = chat_lib.preference(record)
            pair = [chat_lib.encode(tok, chat["template"], prompt + response, chat["variables"],
                                    train_from=len(prompt)) for response in (chosen, rejected)]
        except chat_lib.TemplateFailure as e:
            _count_template_failure(counts, e)
            continue
        except DataError:
            counts["skipped_not_a_pair"] += 1
            continue
        total = sum(len(ids) for ids, _ in pair)
        if max_len and total > max_len:
            if chat["truncate"] == "drop":
                counts["dropped_too_long"] += 1
                continue
            keep = _fair_split([len(ids) for ids, _ in pair], max_len)
            pair = [(ids[len(ids) - k:], w[len(w) - k:]) for (ids, w), k in zip(pair, keep)]
            counts["truncated"] += 1
        if not all(w.any() for _, w in pair):
            counts["skipped_no_response_tokens"] += 1
            continue
        counts["pairs"] += 1
        counts["longest"] = max(counts["longest"], sum(len(ids) for ids, _ in pair))
        for ids, weights in pair:
            ids_out.append(np.asarray(ids, dtype))
            weights_out.append(weights)
    return ids_out, weights_out


TEMPLATE_FAILED = "skipped_template_error"
REASON = "reason: "  # counts keys that carry a failure's message (the first REASONS_KEPT distinct ones a shard met)
REASONS_KEPT = 3


def _count_template_failure(counts: collections.Counter, error: DataError) -> None:
    counts[TEMPLATE_FAILED] += 1
    key = REASON + str(error)
    if key in counts or sum(k.startswith(REASON) for k in counts) < REASONS_KEPT:
        counts[key] += 1


def template_failures(counts: dict) -> tuple[int, list[str]]:
    """(records the template failed on, their first distinct messages, the most frequent first)."""
    reasons = sorted(((n, k[len(REASON):]) for k, n in counts.items() if k.startswith(REASON)), reverse=True)
    return counts.get(TEMPLATE_FAILED, 0), [msg for _, msg in reasons[:REASONS_KEPT]]


def _fair_split(lengths: list[int], budget: int) -> list[int]:
    """How many tokens each of two sequences keeps to fit `budget` together: the shorter all it has up to half."""
    a, b = lengths
    keep_a = min(a, max(budget // 2, budget - b))
    return [keep_a, min(b, budget - keep_a)]

