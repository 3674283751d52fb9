"""Prompts for reinforcement learning (`jaxtrain prepare --prompts`): JSONL records with a `prompt`, tokenized.

A record's `prompt` is text, used as it is, or chat messages, rendered with the tokenizer directory's chat
template (or --chat_template) and its generation prompt, as TRL does. Every other field is kept for the rewards
(e.g. a reference `answer`). The data dir holds `prompts.jsonl` (train) and `heldout.jsonl` (the evals'), one
line per prompt {"id", "prompt_ids", "fields"}, with the tokenizer and a manifest whose `kind` is "prompts".
Which prompts a step trains on is a function of (seed, step) alone (`step_prompts`): each epoch visits every
prompt once, in a keyed permutation, so a resumed run draws the same prompts.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from jaxtrain import files
from jaxtrain.data import chat as chat_lib
from jaxtrain.data import layout
from jaxtrain.data import order as order_lib
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.errors import DataError

KIND = "prompts"
TRAIN, HELDOUT = "prompts.jsonl", "heldout.jsonl"


def _records(path: str):
    """(line number, record) of a JSONL file; DataError naming the line that is not a JSON object with a prompt."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise DataError(f"{path}:{n}: no `prompt` field (each line: {{\"prompt\": text or chat messages, "
                                f"...fields for the rewards}})")
            prompt = record["prompt"]
            if not (isinstance(prompt, str) and prompt) and not (
                    isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
                raise DataError(f"{path}:{n}: `prompt` must be non-empty text or a list of chat messages")
            yield n, record


def prepare_prompts(output: str, inputs: list[str], *, tokenizer: str, chat_template: str | None = None,
                    max_prompt_tokens: int | None = None, heldout: int = 0, seed: int = 0, print_fn=print) -> dict:
    """Writes `output` from JSONL files of prompts (module docstring); returns its manifest. `heldout` prompts,
    drawn by `seed`, go to the held-out split. A prompt longer than `max_prompt_tokens` is refused, naming it."""
    if not tokenizer or not os.path.exists(tokenizer):
        raise DataError(f"{tokenizer or '--tokenizer'}: prompts need --tokenizer (a tokenizer.json or a Hugging "
                        f"Face model directory)")
    tok = layout.open_tokenizer(tokenizer, None)
    template = variables = None
    records = [(f"{path}:{n}", r) for path in inputs for n, r in _records(path)]
    if not records:
        raise DataError(f"{', '.join(inputs)}: no prompts")
    if any(isinstance(r["prompt"], list) for _, r in records):
        if not (chat_template or tok.hf_dir):
            raise DataError("chat prompts need --tokenizer HF_MODEL_DIR (its chat template) or --chat_template")
        template = chat_lib.load_template(chat_template or tok.hf_dir)
        variables = chat_lib.special_tokens(tok.hf_dir) if tok.hf_dir else {}
    if not 0 <= heldout < len(records):
        raise DataError(f"--heldout: {heldout} must leave train prompts (the files hold {len(records)})")
    rows = []
    for i, (where, record) in enumerate(records):
        prompt = record["prompt"]
        text = prompt if isinstance(prompt, str) else chat_lib.render(template, prompt, add_generation_prompt=True,
                                                                     variables=variables)
        ids = tok.encode(text) if isinstance(prompt, str) else tok.encode_rendered(text)[0]
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            raise DataError(f"{where}: the prompt has {len(ids)} tokens, more than --max_prompt_tokens "
                            f"{max_prompt_tokens}")
        rows.append({"id": i, "prompt_ids": [int(t) for t in ids], "fields": record})
    held = set(np.random.default_rng(seed).permutation(len(rows))[:heldout].tolist())
    splits = {TRAIN: [r for r in rows if r["id"] not in held], HELDOUT: [r for r in rows if r["id"] in held]}

    os.makedirs(output, exist_ok=True)
    if tok.kind != "hf":
        raise DataError(f"{tokenizer}: prompts need a Hugging Face tokenizer (tokenizer.json or a model directory)")
    shutil.copyfile(tok.path, os.path.join(output, layout.TOKENIZER))  # the data dir is self-contained
    if tok.hf_dir and os.path.isfile(config := os.path.join(tok.hf_dir, tok_lib.HF_TOKENIZER_CONFIG)):
        shutil.copyfile(config, os.path.join(output, tok_lib.HF_TOKENIZER_CONFIG))
    for name, split in splits.items():
        files.write_text(os.path.join(output, name), "".join(json.dumps(r) + "\n" for r in split))
    tok_file = os.path.join(output, layout.TOKENIZER)
    manifest = {
        "kind": KIND, "dtype": "int32", "eos_id": tok.eos_id,
        "tokenizer": {"file": layout.TOKENIZER, "sha256": files.file_hash(tok_file),
                      **({"hf_dir": True, "config_sha256": files.file_hash(
                          os.path.join(output, tok_lib.HF_TOKENIZER_CONFIG))}
                         if tok.hf_dir and os.path.isfile(os.path.join(output, tok_lib.HF_TOKENIZER_CONFIG))
                         else {})},
        "splits": {"train": [{"file": TRAIN, "docs": len(splits[TRAIN])}],
                   "heldout": [{"file": HELDOUT, "docs": len(splits[HELDOUT])}]},
        "longest": max(len(r["prompt_ids"]) for r in rows),
        "fields": sorted({k for r in rows for k in r["fields"]}),
        "chat": template is not None,
    }
    files.write_text(os.path.join(output, layout.MANIFEST), json.dumps(manifest, indent=1) + "\n")
    print_fn(f"prepared {len(rows)} prompts ({len(splits[HELDOUT])} held out), the longest {manifest['longest']} "
             f"tokens -> {output}")
    return manifest


def load(data_dir: str, split: str = "train") -> list[dict]:
    """The split's prompts ({"id", "prompt_ids", "fields"}), in file order."""
    name = TRAIN if split == "train" else HELDOUT
    path = os.path.join(data_dir, name)
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not readable prompts ({e}); prepare the data again") from None


def step_prompts(count: int, per_step: int, seed: int, step: int) -> np.ndarray:
    """The indices (into the train split's `count` prompts) of step `step`'s `per_step` prompts (steps from 1):
    prompt g = (step - 1) * per_step + j of the run is epoch g // count's keyed permutation at g % count."""
    g = (step - 1) * per_step + np.arange(per_step, dtype=np.int64)
    epochs = g // count
    out = np.empty(per_step, np.int64)
    for epoch in np.unique(epochs):
        at = epochs == epoch
        out[at] = order_lib.FeistelPermutation(count, [seed, int(epoch)])(g[at] % count)
    return out
