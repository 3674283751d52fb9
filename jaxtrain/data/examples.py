"""Chat and preference data made from the KJV (the default corpus, offline), for the fine-tuning walkthrough
(docs/fine-tuning.md, notebooks/fine_tune.ipynb): the user gives a sentence, the assistant continues it.

`write_kjv_chat(out_dir)` writes sft.jsonl ({"messages"}: the true next sentence), pairs.jsonl ({"prompt",
"chosen", "rejected"}: the true next sentence over one from elsewhere in the Bible) and chat_template.jinja, a
plain "User: / Assistant:" template for a tokenizer without one (`prepare --chat_template`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from jaxtrain.data import corpus

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token + "
            "'\\n' }}{% else %}{{ m['role'].capitalize() + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def continuations() -> list[tuple[str, str]]:
    """(a sentence, the sentence after it) from every KJV paragraph with two or more."""
    out = []
    for paragraph in corpus.read_kjv_documents():
        sentences = [s.strip() for s in re.split(r"(?<=[.?!:;])\s+", paragraph) if s.strip()]
        out += [(a, b) for a, b in zip(sentences, sentences[1:]) if len(a) < 200 and len(b) < 200]
    return out


def write_kjv_chat(out_dir, examples: int = 4000, seed: int = 0) -> dict[str, Path]:
    """Writes `examples` conversations and as many pairs (disjoint prompts); returns the three paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pool = continuations()
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(pool), 2 * examples, replace=False)
    paths = {"sft": out / "sft.jsonl", "pairs": out / "pairs.jsonl", "template": out / "chat_template.jinja"}
    with open(paths["sft"], "w") as f:
        for i in picked[:examples]:
            first, then = pool[i]
            f.write(json.dumps({"messages": [{"role": "user", "content": first},
                                             {"role": "assistant", "content": then}]}) + "\n")
    with open(paths["pairs"], "w") as f:
        for i, other in zip(picked[examples:], rng.choice(len(pool), examples)):
            first, then = pool[i]
            f.write(json.dumps({"prompt": first, "chosen": then, "rejected": pool[other][1]}) + "\n")
    paths["template"].write_text(TEMPLATE)
    return paths
