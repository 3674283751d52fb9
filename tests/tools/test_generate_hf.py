"""`jaxtrain generate --hf DIR`: greedy ids equal transformers' `generate`, EOS handled as it does, bad input in
one line; a Hugging Face directory's tokenizer (tokenizer.json + tokenizer_config.json) encodes as AutoTokenizer,
in `prepare --tokenizer DIR` and in `generate --prompt`.

Models are tiny, seeded and random, saved to tmp_path: nothing downloads. FAMILIES takes more families as
`jaxtrain.models.hf.import_dir` learns them: (transformers config class, model class, config overrides)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pytest
import torch
import transformers
from tokenizers import processors

from jaxtrain.data import layout
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.models import hf
from jaxtrain.tools import generate as generate_cli
from jaxtrain.tools import prepare as prepare_cli

REPO = Path(__file__).resolve().parents[2]
# initializer_range 0.5 spreads the logits: greedy then has no near-ties a float32 rounding difference could flip.
SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 128, "initializer_range": 0.5, "rope_theta": 5000.0,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
         "pad_token_id": None}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
}
PROMPT_IDS = [5, 17, 42, 3, 88, 1]
NEW_TOKENS = 20


def make_hf_dir(path, config_cls, model_cls, overrides=None, *, vocab_size=96, seed=0) -> Path:
    """A seeded random model of the family, saved as float32 safetensors."""
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab_size, **{**SIZES, **(overrides or {})})
    model_cls(config).to(torch.float32).save_pretrained(path)
    return Path(path)


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def hf_greedy(hf_dir, prompt_ids, max_new_tokens=NEW_TOKENS, min_gap=1e-3):
    """transformers' greedy new tokens (a stop id included), from the directory as saved; asserts every step's
    top-2 logits are `min_gap` apart, else the comparison would test rounding."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    gaps = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
    assert min(gaps) > min_gap, f"near-tie in the reference ({min(gaps):.1e}); pick another seed"
    return out.sequences[0, len(prompt_ids):].tolist()


def run_cli(*args, command=("-m", "jaxtrain", "generate")):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, *command, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def greedy_args(hf_dir, *prompt):
    return ["--hf", str(hf_dir), *prompt, "--max_new_tokens", str(NEW_TOKENS), "--temperature", "0"]


def assert_one_error_line(stderr, *names):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert all(str(name) in lines[0] for name in names), lines[0]


# --- Greedy ids equal transformers' ----------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_ids_equal_transformers(family, tmp_path):
    hf_dir = make_hf_dir(tmp_path / family, *FAMILIES[family])
    want = hf_greedy(hf_dir, PROMPT_IDS)
    # The command as the model-family issue spells it: the old module path runs `jaxtrain generate`.
    proc = run_cli(*greedy_args(hf_dir, "--prompt_ids", ",".join(map(str, PROMPT_IDS))),
                   command=("-m", "jaxtrain.generate"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("note: python -m jaxtrain.generate is now `jaxtrain generate`; running that\n")
    assert proc.stdout.splitlines()[-1] == ",".join(map(str, want))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stops_at_the_eos_ids_as_transformers_does(family, tmp_path, capsys):
    hf_dir = make_hf_dir(tmp_path / family, *FAMILIES[family])
    free = hf_greedy(hf_dir, PROMPT_IDS)
    cut = next(i for i in range(2, NEW_TOKENS) if free[i] not in free[:i])  # its first occurrence
    unused = next(t for t in range(96) if t not in free)
    # generation_config.json's list is what generate reads; config.json's id is not among the tokens drawn.
    edit_json(hf_dir / "config.json", eos_token_id=unused)
    edit_json(hf_dir / "generation_config.json", eos_token_id=[unused, free[cut]])
    want = hf_greedy(hf_dir, PROMPT_IDS)
    assert want == free[:cut + 1]  # transformers keeps the stop id
    assert generate_cli.main(greedy_args(hf_dir, "--prompt_ids", ",".join(map(str, PROMPT_IDS)))) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(map(str, want))


# --- Bad input: exit 2, one line -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "llama", *FAMILIES["llama"])


def test_a_missing_dir_exits_2_in_one_line(tmp_path):
    """A real process: no traceback. The other cases run in-process (faster)."""
    missing = tmp_path / "nope"
    proc = run_cli("--hf", str(missing), "--prompt_ids", "1,2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert_one_error_line(proc.stderr, "--hf", missing)


def _not_hf(tmp_path, _):
    (tmp_path / "plain").mkdir()
    return tmp_path / "plain", ["--prompt_ids", "1"], [tmp_path / "plain" / "config.json"]


def _unsupported(tmp_path, llama_dir):
    d = tmp_path / "other"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**json.loads((llama_dir / "config.json").read_text()),
                                              "model_type": "no_such_model"}))
    return d, ["--prompt_ids", "1"], [d / "config.json", "model_type"]


def _unsupported_rope(tmp_path, llama_dir):
    d = shutil.copytree(llama_dir, tmp_path / "rope")
    edit_json(d / "config.json", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5000.0})
    return d, ["--prompt_ids", "1"], [d / "config.json", "rope_type", "'dynamic'"]


def _missing_tensor(tmp_path, llama_dir):
    from safetensors.numpy import load_file, save_file

    d = shutil.copytree(llama_dir, tmp_path / "missing")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d, ["--prompt_ids", "1"], ["model.layers.1.mlp.down_proj.weight"]


@pytest.mark.parametrize("case", [
    _not_hf,
    _unsupported,
    _unsupported_rope,
    _missing_tensor,
    lambda tmp_path, d: (d, ["--prompt_ids", "1,x"], ["--prompt_ids", "1,x"]),
    lambda tmp_path, d: (d, ["--prompt_ids", "-1"], ["--prompt_ids"]),
    lambda tmp_path, d: (d, ["--prompt_ids", ""], ["--prompt_ids"]),
    lambda tmp_path, d: (d, ["--prompt_ids", "1,96"], ["--prompt_ids", "96", "vocab_size 96"]),
    lambda tmp_path, d: (d, ["--prompt", "hello"], [d / "tokenizer.json", "--prompt_ids"]),
    lambda tmp_path, d: (d, ["--prompt_ids", "1", "--step", "3"], ["--step"]),
], ids=["not_hf", "unsupported_model_type", "unsupported_rope_type", "missing_tensor", "ids_not_ints", "negative_id",
        "no_ids", "id_outside_vocab", "prompt_without_tokenizer", "step"])
def test_bad_input_exits_2_in_one_line(case, llama_dir, tmp_path, capsys):
    hf_dir, args, names = case(tmp_path, llama_dir)
    try:
        code = generate_cli.main(["--hf", str(hf_dir), *args, "--max_new_tokens", "2"])
    except SystemExit as e:  # argparse's checks
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_error_line(captured.err, *names)


# --- The directory's tokenizer ---------------------------------------------------------------------------

TEXTS = ["In the beginning was the word. And the word was data.", "Second paragraph, with more words.",
         "Third one: the end of the beginning."] * 4
BOS, EOS = "<s>", "<|im_end|>"  # EOS is not in tok_lib.EOS_CANDIDATES: only tokenizer_config.json names it


def make_tokenizer(hf_dir, *, template="<s> $A", config=None):
    """A byte-level BPE with BOS and EOS added, its post-processor `template` (None: none) and its
    tokenizer_config.json `config` (None: no file). Returns the BOS id."""
    tok = tok_lib.train_bpe(TEXTS, 300)
    tok.add_special_tokens([BOS, EOS])
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS)}
    if template:
        tok.post_processor = processors.TemplateProcessing(single=template, pair=f"{template} $B:1",
                                                           special_tokens=list(ids.items()))
    os.makedirs(hf_dir, exist_ok=True)
    tok.save(str(Path(hf_dir) / "tokenizer.json"))
    if config is not None:
        (Path(hf_dir) / "tokenizer_config.json").write_text(json.dumps(config))
    return ids[BOS]


CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
          "eos_token": {"__type": "AddedToken", "content": EOS, "special": True}}
TOKENIZERS = {  # name -> (post-processor template, tokenizer_config.json)
    "bos_template": ("<s> $A", CONFIG),  # Llama 3, Gemma
    "no_template": (None, CONFIG),  # Qwen
    # transformers 5 drops add_bos_token/add_eos_token when a tokenizer.json exists: no BOS here.
    "add_bos_token_only": (None, {**CONFIG, "add_bos_token": True, "add_eos_token": True}),
    "template_with_eos": (f"<s> $A {EOS}", CONFIG),
    "no_config": ("<s> $A", None),  # EOS found by name (<|endoftext|>)
}


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_directory_encodes_as_autotokenizer(name, tmp_path):
    template, config = TOKENIZERS[name]
    bos = make_tokenizer(tmp_path, template=template, config=config)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = tok_lib.load(tmp_path)
    assert ours.eos_id == (auto.eos_token_id if config else tok_lib.EOS_ID)
    for text in TEXTS[:3]:
        want = auto(text)["input_ids"]
        # A prepared document is the encoding and one EOS, which a template may already end with.
        assert ours.encode(text) + [ours.eos_id] == (want if want[-1] == ours.eos_id else want + [ours.eos_id])
        if name != "template_with_eos":
            assert ours.encode(text) == want
    assert (ours.encode("x")[0] == bos) == (template is not None)


def test_prepare_with_a_model_directory_uses_its_bos_and_eos(tmp_path):
    hf_dir = tmp_path / "model"
    bos = make_tokenizer(hf_dir, config=CONFIG)
    for name, texts in (("a.txt", TEXTS[:6]), ("b.txt", TEXTS[6:])):
        (tmp_path / name).write_text("\n\n".join(texts) + "\n")
    out = tmp_path / "data"
    # Two shards, so worker processes tokenize: they read the copy in the data dir.
    args = ["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--text_split", "paragraph",
            "--output", str(out), "--heldout_docs", "1", "--tokenizer", str(hf_dir), "--num_shards", "2"]
    assert prepare_cli.main(args) == 0
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)
    manifest = layout.load_manifest(out)
    assert manifest["eos_id"] == auto.eos_token_id == auto.convert_tokens_to_ids(EOS)
    shards = [str(out / s["file"]) for split in manifest["splits"].values() for s in split]
    source = grain.sources.ArrayRecordDataSource(shards)
    docs = sorted(np.frombuffer(r, np.dtype(manifest["dtype"]).newbyteorder("<")).tolist()
                  for r in source.__getitems__(range(len(source))))
    assert docs == sorted(auto(t)["input_ids"] + [auto.eos_token_id] for t in TEXTS)
    assert all(d[0] == bos for d in docs) and len(manifest["splits"]["train"]) == 2
    # What training and `generate --workdir` read: the same EOS and BOS, and the same tokenizer.json as the model's.
    tok = layout.load_tokenizer(str(out))
    assert tok.eos_id == auto.eos_token_id and tok.encode(TEXTS[0]) == auto(TEXTS[0])["input_ids"]
    hf.check_tokenizer(hf_dir, out)
    assert prepare_cli.main(args) == 0  # a rerun reuses the data


def test_prepare_refuses_a_directory_without_tokenizer_json(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "a.txt").write_text("some text\n\nmore text\n")
    code = prepare_cli.main(["--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "data"),
                             "--heldout_docs", "1", "--tokenizer", str(tmp_path / "model")])
    assert code == 2
    assert_one_error_line(capsys.readouterr().err, tmp_path / "model" / "tokenizer.json")
    assert not (tmp_path / "data").exists()


def test_prompt_text_uses_the_directorys_tokenizer_and_stops_at_its_eos(tmp_path, capsys):
    hf_dir = tmp_path / "llama"
    bos = make_tokenizer(hf_dir, config=CONFIG)
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)
    make_hf_dir(hf_dir, *FAMILIES["llama"], vocab_size=len(auto))  # every id the model draws is a token
    prompt = "In the beginning"
    prompt_ids = auto(prompt)["input_ids"]
    assert prompt_ids[0] == bos
    free = hf_greedy(hf_dir, prompt_ids)
    assert auto.eos_token_id not in free  # the model has no EOS (config.json's is None): all 20 come out

    def generate():
        assert generate_cli.main(greedy_args(hf_dir, "--prompt", prompt)) == 0
        return capsys.readouterr().out

    assert generate() == prompt + auto.decode(free, skip_special_tokens=False) + "\n"
    # The tokenizer's EOS (here a token greedy draws) ends the text, and is not printed.
    cut = next(i for i in range(2, NEW_TOKENS) if free[i] not in free[:i])
    edit_json(hf_dir / "tokenizer_config.json", eos_token=auto.convert_ids_to_tokens(free[cut]))
    assert generate() == prompt + auto.decode(free[:cut], skip_special_tokens=False) + "\n"
