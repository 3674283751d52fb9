"""Chat data for supervised fine-tuning: a conversation rendered with the model's own chat template, tokenized,
and a loss weight per token: 1 on what the assistant says, 0 on everything else.

`render` is transformers' `apply_chat_template(..., tokenize=False)`: the same sandboxed jinja2 environment and
globals, and `encode`'s ids are its `tokenize=True` ids. The assistant's text is found without reading the
template: message i's span is what rendering messages[:i+1] adds to rendering messages[:i] with the generation
prompt. So a span holds the reply and the end-of-turn text after it (`<|eot_id|>`, `<|im_end|>\\n`), never the
role header or the generation prompt. That needs a template that renders a conversation's start the same
whatever follows; one that does not (Qwen3 drops earlier turns' <think> blocks) is refused: pass a training
template file instead. A token is weighted when any of its characters lies in a span, the rule of transformers'
`return_assistant_tokens_mask`, so a token that merges a header's trailing space with the reply still trains.
"""

from __future__ import annotations

import functools
import json
import os
import traceback
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxtrain.data.tokenizer import HF_TOKENIZER_CONFIG, Tokenizer, _special_token, read_hf_config
from jaxtrain.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"  # newer transformers save the template here, beside tokenizer_config.json
# The named special tokens transformers passes to every template (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers copies a message's reasoning, under any of these names, to the first two before rendering.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def load_template(source: str) -> str:
    """The chat template of a Hugging Face model directory, or the text of a template file."""
    if os.path.isdir(source):
        if os.path.isfile(path := os.path.join(source, TEMPLATE_FILE)):  # transformers prefers it too
            return _read(path)
        template = read_hf_config(source).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        if not isinstance(template, str) or not template.strip():
            raise DataError(f"{source}: no chat template in {TEMPLATE_FILE} or {HF_TOKENIZER_CONFIG} "
                            f"(a 'default' one if it names several); pass a template file instead")
        return template
    if not os.path.isfile(source):
        raise DataError(f"{source}: not found; pass a Hugging Face model directory or a chat template file")
    return _read(source)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not readable as a chat template ({e})") from None
    if not template.strip():
        raise DataError(f"{path}: the chat template is empty; pass a file with a jinja2 chat template")
    return template


def special_tokens(hf_dir: str) -> dict:
    """The special tokens a template sees as variables (`bos_token`, ...), from tokenizer_config.json."""
    config = read_hf_config(hf_dir)
    return {name: token for name in SPECIAL_TOKENS if (token := _special_token(config, name)) is not None}


class _Generation(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks the assistant's text for transformers' mask. Templates that
    # have it must still compile; its body renders as is (in its own scope, as transformers' does).
    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Unlike jinja2's own tojson: no HTML escaping, and json.dumps' options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class TemplateFailure(DataError):
    """The chat template failed on a record (its own raise_exception, an undefined name, any error it raised),
    as distinct from a record that is not a conversation."""


def _template_line(error: BaseException) -> str:
    """ "line N: " of the template's frame in `error`'s traceback (jinja2 maps it back to the template), or ""."""
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == "<template>"]
    return f"line {lines[-1]}: " if lines else ""


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Templates come from the Hub: untrusted code, hence the sandbox.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateFailure(f"chat template line {e.lineno}: {e.message}") from None


def check_syntax(template: str) -> None:
    """TemplateFailure (naming the line) for a template that does not compile."""
    _compile(template)


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = False,
           variables: dict | None = None) -> str:
    """The text `apply_chat_template(messages, tokenize=False)` gives; `variables`: special_tokens() and any
    template options (e.g. enable_thinking)."""
    compiled = _compile(template)
    # transformers drops None values and copies reasoning fields; it also passes tools and documents as None,
    # which `tools is defined` sees.
    messages = [_as_transformers_passes(m) for m in messages]
    try:
        return compiled.render(**{"tools": None, "documents": None, **(variables or {})}, messages=messages,
                               add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:  # raise_exception, undefined names, the sandbox
        raise TemplateFailure(f"chat template {_template_line(e)}{' '.join(str(e).split())[:300]}") from None
    except Exception as e:  # noqa: BLE001 - anything else the template's code raised: str + list, recursion, 1/0
        raise TemplateFailure(f"chat template {_template_line(e)}{type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]}") from None


def _as_transformers_passes(message: dict) -> dict:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def conversation(record: dict) -> list[dict]:
    """One JSONL record's messages: {"messages": [...]}, {"prompt": str, "completion": str} (a user turn and
    the reply), or TRL's conversational {"prompt": [messages], "completion": [messages]}."""
    if isinstance(record, dict):  # a dataset row of a mixed file has every column: the others are None
        record = {k: v for k, v in record.items() if v is not None}
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
    elif isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            messages = prompt + completion
        else:
            raise DataError(f"prompt and completion must be both strings or both lists of messages, not "
                            f"{type(prompt).__name__} and {type(completion).__name__}")
    else:
        raise DataError(f"a chat record needs 'messages', or 'prompt' and 'completion'; found {keys}")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"messages must be a non-empty list, not {messages!r:.60}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"message {i}: needs a string 'role' and a string 'content', got {m!r:.80}")
    return messages


def encode(tok: Tokenizer, template: str, messages: list[dict], variables: dict,
           train_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) of one conversation: apply_chat_template's ids, and 1 on the assistant's tokens (of the
    messages from index `train_from` on: a preference pair's response, not the assistant turns of its prompt)."""
    full = render(template, messages, variables=variables)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < train_from:
            continue
        prompt = render(template, messages[:i], add_generation_prompt=True, variables=variables)
        upto = render(template, messages[:i + 1], variables=variables)
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise DataError(f"message {i}: the chat template does not render conversations prefix-stably (a turn "
                            f"renders differently once more follows); pass a template file that does")
        spans.append((len(prompt), len(upto)))
    ids, offsets = tok.encode_rendered(full)
    weights = np.zeros(len(ids), np.uint8)
    if ids and spans:
        starts, ends = np.asarray(offsets, np.int64).T
        for lo, hi in spans:
            weights[(starts < hi) & (ends > lo)] = 1
    return np.asarray(ids, np.int64), weights


def preference(record: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of one preference record: {"prompt", "chosen", "rejected"}, each a
    string (the prompt a user turn, a response an assistant turn) or a list of messages, as TRL takes them. Without
    a "prompt", chosen and rejected are whole conversations and the prompt is the messages they share."""
    if isinstance(record, dict):
        record = {k: v for k, v in record.items() if v is not None}
    if not (isinstance(record, dict) and "chosen" in record and "rejected" in record):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"a preference record needs 'chosen' and 'rejected' (and a 'prompt'); found {keys}")
    prompt = record.get("prompt", [])
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    responses = [[{"role": "assistant", "content": r}] if isinstance(r, str) else r
                 for r in (record["chosen"], record["rejected"])]
    if not isinstance(prompt, list) or not all(isinstance(r, list) and r for r in responses):
        raise DataError("prompt, chosen and rejected must be strings or non-empty lists of messages")
    if "prompt" not in record:  # implicit prompt: the leading messages both conversations share
        shared = 0
        while all(shared < len(r) - 1 for r in responses) and responses[0][shared] == responses[1][shared]:
            shared += 1
        prompt, responses = responses[0][:shared], [r[shared:] for r in responses]
    if not isinstance(prompt, list) or not all(isinstance(r, list) and r for r in responses):
        raise DataError("prompt, chosen and rejected must be strings or non-empty lists of messages")
    chosen, rejected = (conversation({"messages": prompt + r})[len(prompt):] for r in responses)
    return prompt, chosen, rejected


def encode_prompt(tok: Tokenizer, template: str, messages: list[dict], variables: dict) -> list[int]:
    """The ids a model continues to answer `messages`: their rendering with the generation prompt."""
    return tok.encode_rendered(render(template, messages, add_generation_prompt=True, variables=variables))[0]
