"""Chat data (jaxtrain.data.chat): rendering equals transformers' apply_chat_template, ids equal its tokenize=True
ids, and the loss weights equal its assistant mask, for Llama-3, ChatML (Qwen) and Gemma style templates.

The tokenizer is a tiny byte-level BPE trained here and saved as a Hugging Face directory, the reference is
transformers' AutoTokenizer on that directory: nothing downloads. Each template marks the assistant's text
with <GEN>...</GEN>: removed for the template itself, `{% generation %}` tags for transformers' mask."""

import json
from pathlib import Path

import numpy as np
import pytest
import transformers
from tokenizers import processors

from jaxtrain.data import chat
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.errors import DataError, TokenizerError

LLAMA = r"""{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
{%- if message['role'] == 'assistant' %}<GEN>{{- message['content'] | trim + '<|eot_id|>' }}</GEN>
{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

CHATML = r"""{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and message.role == 'system' %}{% continue %}{% endif %}
{{- '<|im_start|>' + message.role + '\n' }}
{%- if message.role == 'assistant' %}<GEN>{{- message.content + '<|im_end|>\n' }}</GEN>
{%- else %}{{- message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}"""

GEMMA = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set first_user_prefix = "" %}
{%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif %}
{%- set role = "model" if message['role'] == 'assistant' else message['role'] %}
{{- '<start_of_turn>' + role + '\n' }}
{%- if message['role'] == 'assistant' %}<GEN>{{- message['content'] | trim + '<end_of_turn>\n' }}</GEN>
{%- else %}{{- (first_user_prefix if loop.first else "") + message['content'] | trim + '<end_of_turn>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<start_of_turn>model\n' }}
{%- endif %}"""

# The generation prompt ends with a space the reply's first token takes: the token straddles the span's start.
PLAIN = r"""{%- for m in messages %}
{%- if m.role == 'assistant' %}Assistant: <GEN>{{ m.content + eos_token }}
</GEN>{% else %}{{ m.role | capitalize }}: {{ m.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}Assistant: {% endif %}"""

TEMPLATES = {  # name -> (template, bos, eos, BOS post-processor as in the model's tokenizer.json)
    "llama": (LLAMA, "<|begin_of_text|>", "<|eot_id|>", True),
    "chatml": (CHATML, None, "<|im_end|>", False),
    "gemma": (GEMMA, "<bos>", "<eos>", True),
    "plain": (PLAIN, None, "<|endoftext|>", False),
}
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
            "<|im_end|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris is.",
         "Write a short poem about the sea and the sky.", "Sure! Here it is, with love."] * 3

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = [
    [SYSTEM, {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": " And of Japan? 日本 "},
     {"role": "assistant", "content": "Tōkyō, café <|im_end|> <eos> included."}],
    [{"role": "user", "content": "Write a poem.\n"}, {"role": "assistant", "content": "quick brown fox,\n the sky."},
     {"role": "user", "content": "Shorter."}, {"role": "assistant", "content": "Sea."}],
    [{"role": "user", "content": "Hi"}],
]


def template(name: str, mask: bool = False) -> str:
    text = TEMPLATES[name][0]
    return text.replace("<GEN>", "{% generation %}" if mask else "").replace(
        "</GEN>", "{% endgeneration %}" if mask else "")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict:
    """name -> Hugging Face directory with that template in tokenizer_config.json."""
    bpe = tok_lib.train_bpe(TEXTS, 400)
    bpe.add_special_tokens(SPECIALS)
    dirs = {}
    for name, (text, bos, eos, bos_processor) in TEMPLATES.items():
        if bos_processor:  # ignored by apply_chat_template, so by encode_rendered too
            bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[
                (bos, bpe.token_to_id(bos))])
        else:
            bpe.post_processor = None
        hf_dir = tmp_path_factory.mktemp(name)
        bpe.save(str(hf_dir / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template(name),
                  "eos_token": {"__type": "AddedToken", "content": eos, "special": True}}
        if bos:
            config["bos_token"] = bos
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
        dirs[name] = str(hf_dir)
    return dirs


@pytest.fixture(scope="module")
def pairs(hf_dirs) -> dict:
    """name -> (our Tokenizer, transformers' AutoTokenizer) of the same directory."""
    return {name: (tok_lib.load(d), transformers.AutoTokenizer.from_pretrained(d)) for name, d in hf_dirs.items()}


def cases(name):
    # Gemma's template refuses a system turn after the first and roles out of order: every case here is valid.
    return [(name, i) for i in range(len(CONVERSATIONS))]


ALL_CASES = [c for name in TEMPLATES for c in cases(name)]


def input_ids(out) -> list[int]:
    return list(out["input_ids"] if not isinstance(out, list) else out)  # transformers 5 returns a BatchEncoding


@pytest.mark.parametrize("name,index", ALL_CASES)
def test_render_and_ids_equal_transformers(name, index, hf_dirs, pairs):
    ours, auto = pairs[name]
    messages, variables = CONVERSATIONS[index], chat.special_tokens(hf_dirs[name])
    text = chat.load_template(hf_dirs[name])
    for add_generation_prompt in (False, True):
        want = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert chat.render(text, messages, add_generation_prompt=add_generation_prompt, variables=variables) == want
        # `{% generation %}` renders its body as is.
        assert chat.render(template(name, mask=True), messages, add_generation_prompt=add_generation_prompt,
                           variables=variables) == want
    ids, weights = chat.encode(ours, text, messages, variables)
    assert ids.dtype == np.int64 and weights.dtype == np.uint8 and ids.shape == weights.shape
    assert ids.tolist() == input_ids(auto.apply_chat_template(messages, tokenize=True))


@pytest.mark.parametrize("name,index", ALL_CASES)
def test_weights_equal_transformers_assistant_mask(name, index, hf_dirs, pairs):
    ours, auto = pairs[name]
    messages = CONVERSATIONS[index]
    ids, weights = chat.encode(ours, template(name), messages, chat.special_tokens(hf_dirs[name]))
    out = auto.apply_chat_template(messages, chat_template=template(name, mask=True), tokenize=True,
                                   return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == list(out["input_ids"])
    assert weights.tolist() == list(out["assistant_masks"])
    assert weights.any() == any(m["role"] == "assistant" for m in messages)


@pytest.mark.parametrize("name,start,end", [("llama", "", "<|eot_id|>"), ("chatml", "", "<|im_end|>\n"),
                                            ("gemma", "", "<end_of_turn>\n"),
                                            # " quick" is one token: the header's space trains with the reply.
                                            ("plain", " ", "<|endoftext|>\n")])
def test_the_weighted_tokens_are_the_replies_and_their_end_of_turn(name, start, end, hf_dirs, pairs):
    ours, _ = pairs[name]
    messages = CONVERSATIONS[1]
    ids, weights = chat.encode(ours, template(name), messages, chat.special_tokens(hf_dirs[name]))
    replies = [m["content"].strip() if name in ("llama", "gemma") else m["content"] for m in messages[1::2]]
    assert ours.decode(ids[weights == 1]) == start + replies[0] + end + replies[1] + end
    # Both replies are runs of their own: headers and the user's turn between them weigh 0.
    assert np.count_nonzero(np.diff(np.concatenate([[0], weights, [0]]))) == 4


def test_encode_rendered_parses_template_tokens_and_leaves_documents_alone(hf_dirs):
    ours = tok_lib.load(hf_dirs["chatml"])
    im_end = ours._impl.token_to_id("<|im_end|>")
    ids, offsets = ours.encode_rendered("é<|im_end|>")
    assert ids[-1] == im_end and offsets[-1] == (1, 11)  # character offsets, not bytes
    assert im_end not in ours.encode("<|im_end|>")  # a document's literal token is still text


def test_encode_rendered_refuses_sentencepiece(hf_dirs):
    ours = tok_lib.load(hf_dirs["chatml"])
    ours.kind = "sentencepiece"  # the check is on the kind only: no SentencePiece model needed
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        ours.encode_rendered("x")


def test_template_errors_are_data_errors(hf_dirs):
    user = {"role": "user", "content": "a"}
    with pytest.raises(DataError, match="roles must alternate"):
        chat.render(template("gemma"), [user, user], variables=chat.special_tokens(hf_dirs["gemma"]))
    with pytest.raises(DataError, match="line 1"):
        chat.render("{% for m in messages %}", [user])
    # Whatever else the template's code raises is a TemplateFailure too, naming its line: no traceback.
    for body, error in (("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
                        ("{% for i in range(10 ** 9) %}{% endfor %}", "OverflowError"),
                        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
                        ("{{ 'abc'.index('z') }}", "ValueError"),
                        ("{{ raise_exception('no system role') }}", "no system role")):
        with pytest.raises(chat.TemplateFailure, match=f"^chat template line 2: .*{error}"):
            chat.render("hello\n" + body, [user])


def test_transformers_quirks_match():
    # tojson without HTML escaping, tools passed as None (so "defined"), strftime_now and the special tokens.
    text = "{{ messages | tojson }}|{{ tools is defined }}|{{ tools is none }}|{{ strftime_now('%Y') }}|{{ x }}"
    messages = [{"role": "user", "content": "<a> & 'b' é", "thinking": "hm", "name": None}]
    auto = transformers.PreTrainedTokenizerFast(tokenizer_object=tok_lib.train_bpe(TEXTS, 300))
    want = auto.apply_chat_template(messages, chat_template=text, tokenize=False, x="y")
    assert chat.render(text, messages, variables={"x": "y"}) == want
    assert '"reasoning_content": "hm"' in want and "name" not in want


@pytest.mark.parametrize("bad", [
    # Earlier replies lose their <think> block once a later turn follows (as Qwen3's template does).
    CHATML.replace("{{- message.content + '<|im_end|>\\n' }}</GEN>",
                   "{{- ('<think></think>' if loop.last else '') + message.content + '<|im_end|>\\n' }}</GEN>"),
    # The generation prompt opens a <think> block the rendered reply does not have.
    CHATML.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>' }}"),
])
def test_a_template_that_is_not_prefix_stable_is_refused(bad, pairs):
    ours, _ = pairs["chatml"]
    bad = bad.replace("<GEN>", "").replace("</GEN>", "")
    assert bad != template("chatml")
    with pytest.raises(DataError, match="message 1: .*prefix-stably"):
        chat.encode(ours, bad, CONVERSATIONS[1], {})


def test_conversation_record_forms():
    user, reply = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    assert chat.conversation({"messages": [user, reply], "id": 3}) == [user, reply]
    assert chat.conversation({"prompt": "q", "completion": "a"}) == [user, reply]
    assert chat.conversation({"prompt": [SYSTEM, user], "completion": [reply]}) == [SYSTEM, user, reply]
    for bad, words in [({"text": "x", "id": 1}, "found ['id', 'text']"), ({"prompt": "q", "completion": [reply]},
                       "str and list"), ({"messages": []}, "non-empty"),
                       ({"messages": [user, {"role": "assistant", "content": None}]}, "message 1: "),
                       ({"messages": [{"content": "x"}]}, "message 0: ")]:
        with pytest.raises(DataError, match=words.replace("[", r"\[").replace("]", r"\]")):
            chat.conversation(bad)


def test_load_template_reads_what_transformers_reads(hf_dirs, tmp_path):
    for name, hf_dir in hf_dirs.items():
        assert chat.load_template(hf_dir) == template(name)
        assert chat.special_tokens(hf_dir) == transformers.AutoTokenizer.from_pretrained(hf_dir).special_tokens_map
    named, newer = tmp_path / "named", tmp_path / "newer"
    for d in (named, newer):
        d.mkdir()
        (d / "tokenizer.json").write_text(Path(hf_dirs["chatml"], "tokenizer.json").read_text())
    config = json.loads(Path(hf_dirs["chatml"], "tokenizer_config.json").read_text())
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": [
        {"name": "tool_use", "template": LLAMA}, {"name": "default", "template": template("gemma")}]}))
    (newer / "tokenizer_config.json").write_text(json.dumps(config))
    (newer / "chat_template.jinja").write_text(template("llama"))  # takes priority, as in transformers
    for d, want in ((named, template("gemma")), (newer, template("llama"))):
        assert chat.load_template(str(d)) == want == transformers.AutoTokenizer.from_pretrained(d).get_chat_template()
    assert chat.load_template(str(newer / "chat_template.jinja")) == template("llama")


@pytest.mark.parametrize("case", ["missing", "no_template", "empty_file", "no_default"])
def test_load_template_errors_name_the_path(case, tmp_path):
    path = tmp_path / "model"
    if case == "empty_file":
        path = tmp_path / "t.jinja"
        path.write_text(" \n")
    elif case != "missing":
        path.mkdir()
        template_entry = [{"name": "tool_use", "template": "x"}] if case == "no_default" else None
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template_entry}))
    with pytest.raises(DataError) as e:
        chat.load_template(str(path))
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)
