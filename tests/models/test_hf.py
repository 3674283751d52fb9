"""Hugging Face Llama interop: bit-exact round trips, logits equal to transformers' LlamaForCausalLM, clear refusals,
and the export / overrides CLI on a real workdir."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from helpers import tree_digest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxtrain.models import hf
from jaxtrain.models import transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain import trainer as trainer_lib
from jaxtrain.data import layout
from jaxtrain.tools import hf as hf_cli

REPO = Path(__file__).resolve().parents[2]
# The tiny run config's model: H != KV, so grouped-query attention is exercised.
TINY = dict(vocab_size=512, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64)


def tiny_model(tie=True, **overrides):
    # Not the defaults: a wrong theta or eps would otherwise agree by accident.
    return ModelConfig(**{**TINY, "tie_embeddings": tie, "rope_theta": 5000.0, "norm_eps": 1e-6,
                                      **overrides})


def random_params(cfg, seed=0, std=0.2):
    """Every parameter drawn at random (norm scales around 1), so that each visibly moves the logits."""
    # Shapes only: building the model for real runs its initializers eagerly, seconds per config on 2 cores.
    params = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(transformer.build(cfg, seed))))
    rng = np.random.default_rng(seed)

    def draw(path, x):
        is_scale = str(getattr(path[-1], "key", path[-1])) == "scale"
        return ((1.0 if is_scale else 0.0) + rng.normal(0.0, std, x.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, params)


def assert_same_tree(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.tobytes() == y.tobytes(), path  # bitwise: -0.0 and NaNs too


def tensors_of(path):
    with safe_open(path, framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# --- Export and import ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_import_is_bit_exact(tmp_path, tie):
    cfg = tiny_model(tie)
    params = random_params(cfg)
    out = hf.export(params, cfg, tmp_path / "hf", max_position_embeddings=64)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (32, 64, 4)
    assert config["tie_word_embeddings"] is tie and config["torch_dtype"] == "float32"
    assert config["max_position_embeddings"] == 64 and config["rope_theta"] == 5000.0
    tensors = tensors_of(out / "model.safetensors")
    assert ("lm_head.weight" in tensors) is not tie
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (4 * 8, 32)  # [out, in]
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (32, 8 * 8)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (32, 64)

    fields, back = hf.import_dir(out)
    assert fields == {f: getattr(cfg, f) for f in hf.FIELDS}
    assert_same_tree(params, back)


def test_bfloat16_export_rounds_once_and_imports_as_float32(tmp_path):
    cfg = tiny_model(tie=False)
    params = random_params(cfg)
    out = hf.export(params, cfg, tmp_path / "hf", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in tensors_of(out / "model.safetensors").values()} == {np.dtype(ml_dtypes.bfloat16)}

    _, back = hf.import_dir(out)
    rounded = jax.tree_util.tree_map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    assert_same_tree(rounded, back)
    _, back16 = hf.import_dir(out, dtype="bfloat16")
    assert_same_tree(jax.tree_util.tree_map(lambda x: x.astype(ml_dtypes.bfloat16), params), back16)


def test_sharded_checkpoint_imports(tmp_path):
    cfg = tiny_model(tie=False)
    params = random_params(cfg)
    out = hf.export(params, cfg, tmp_path / "hf")
    tensors = tensors_of(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_tree(params, hf.import_dir(out)[1])


def test_export_refuses_a_non_empty_dir_and_replaces_only_an_export(tmp_path):
    cfg = tiny_model()
    params = random_params(cfg)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(hf.HFError, match="not empty"):
        hf.export(params, cfg, busy)
    with pytest.raises(hf.HFError, match=r"holds notes.txt\) and not written by jaxtrain hf export"):
        hf.export(params, cfg, busy, overwrite=True)  # overwrite never deletes what an export did not write
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    hf_dir = tmp_path / "from_elsewhere"  # a model directory, but not one jaxtrain exported
    hf.export(params, cfg, hf_dir)
    (hf_dir / hf.EXPORT_MARKER).unlink()
    with pytest.raises(hf.HFError, match="not written by jaxtrain hf export"):
        hf.export(params, cfg, hf_dir, overwrite=True)
    assert (hf_dir / "model.safetensors").is_file()

    out = hf.export(params, cfg, tmp_path / "hf")
    other = random_params(cfg, seed=1)
    hf.export(other, cfg, out, overwrite=True)
    assert_same_tree(other, hf.import_dir(out)[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "from_elsewhere", "hf"]  # no temp dirs left

    empty = tmp_path / "empty"
    empty.mkdir()
    hf.export(params, cfg, empty)  # an empty dir is fine
    assert (empty / "model.safetensors").is_file()


def test_failed_export_leaves_no_directory(tmp_path, monkeypatch):
    cfg = tiny_model()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        hf.export(random_params(cfg), cfg, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


# --- Logits equal transformers' ------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers_llama(tmp_path, tie):
    cfg = tiny_model(tie)
    params = random_params(cfg, seed=3)
    out = hf.export(params, cfg, tmp_path / "hf")
    B, T = 2, 24
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: transformer.build(cfg, 0)))
    ours = np.asarray(nnx.merge(graphdef, params)(tokens, positions, np.ones((B, T), np.int32)))

    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(tokens).long(),
                       position_ids=torch.from_numpy(positions.copy()).long()).logits.numpy()
    assert theirs.shape == ours.shape
    assert np.abs(ours).max() > 1.0  # logits large enough that the tolerance below means something
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


# --- Refusals ------------------------------------------------------------------------------------------


@pytest.fixture
def exported(tmp_path):
    cfg = tiny_model(tie=False)
    params = random_params(cfg)
    return cfg, params, hf.export(params, cfg, tmp_path / "hf")


@pytest.mark.parametrize("field,value", [("n_kv_heads", 2), ("d_ff", 48), ("tie_embeddings", True),
                                         ("rope_theta", 10000.0), ("norm_eps", 1e-5)])
def test_load_params_names_the_mismatching_field(exported, field, value):
    cfg, params, out = exported
    assert_same_tree(params, hf.load_params(out, cfg))
    with pytest.raises(hf.HFMismatch) as e:
        hf.load_params(out, dataclasses.replace(cfg, **{field: value}))
    assert e.value.field == f"model.{field}"
    assert str(e.value).startswith(f"model.{field}: {value!r} in the config")
    assert repr(getattr(cfg, field)) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_load_params_casts_to_the_param_dtype(exported):
    cfg, params, out = exported
    loaded = hf.load_params(out, dataclasses.replace(cfg, param_dtype="bfloat16"))
    assert {x.dtype for x in jax.tree_util.tree_leaves(loaded)} == {np.dtype(ml_dtypes.bfloat16)}


def edit_config(out, **changes):
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("changes,named", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
])
def test_unrepresentable_configs_are_refused(exported, changes, named):
    _, _, out = exported
    edit_config(out, **changes)
    with pytest.raises(hf.HFError, match=f"config.json: {named}: "):
        hf.import_dir(out)


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**9), ("vocab_size", 2**40),
                                         ("num_attention_heads", 4096)])
def test_absurd_sizes_are_refused_before_anything_is_built_from_them(exported, field, value):
    """A damaged or hostile config.json: refused at read, naming the field, before any tensor name is made (a
    billion layers' names would exhaust memory first)."""
    _, _, out = exported
    edit_config(out, **{field: value})
    with pytest.raises(hf.HFError, match=rf"config.json: {field}: {value}; more than jaxtrain reads"):
        hf.read_config(out)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/outside.safetensors", "sub/../../x.safetensors"])
def test_a_weight_map_stays_inside_its_directory_and_may_follow_symlinks(tmp_path, name):
    """A sharded index names files of its directory only; a shard that is a symlink (the HF cache's blobs) loads."""
    cfg = tiny_model(tie=False)
    params = random_params(cfg)
    out = hf.export(params, cfg, tmp_path / "hf")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (out / "model.safetensors").rename(blobs / "abc123")
    (out / "model-00001-of-00001.safetensors").symlink_to(blobs / "abc123")
    tensors = tensors_of(out / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_tree(params, hf.import_dir(out)[1])
    index["weight_map"][sorted(tensors)[0]] = name
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf.HFError, match=rf"weight_map names {re.escape(repr(name))}, outside the directory"):
        hf.import_dir(out)


def test_legacy_config_defaults(tmp_path):
    """Older configs leave out head_dim (= hidden/heads), num_key_value_heads (= heads) and rope_parameters."""
    cfg = tiny_model(tie=False, head_dim=4, n_kv_heads=8)
    params = random_params(cfg)
    out = hf.export(params, cfg, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    for key in ("head_dim", "num_key_value_heads", "rope_parameters", "rope_scaling", "dtype"):
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    fields, back = hf.import_dir(out)
    assert fields == {f: getattr(cfg, f) for f in hf.FIELDS}
    assert_same_tree(params, back)


@pytest.mark.parametrize("edit,message", [
    ("drop", "missing tensor model.layers.1.mlp.up_proj.weight"),
    ("extra", "unexpected tensor(s) the model has no place for: model.layers.0.self_attn.q_proj.bias"),
    ("shape", "tensor model.layers.1.mlp.up_proj.weight has shape [64, 31], config.json implies [64, 32]"),
    ("nan", "model.layers.1.mlp.up_proj.weight in "),
])
def test_bad_tensors_are_named(exported, edit, message):
    _, _, out = exported
    tensors = tensors_of(out / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    if edit == "drop":
        del tensors[name]
    elif edit == "extra":
        tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    elif edit == "nan":  # a damaged checkpoint: named at load, not as a non-finite loss at the first step
        tensors[name] = tensors[name].copy()
        tensors[name][3, 5] = np.nan
    else:
        tensors[name] = tensors[name][:, :31].copy()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf.HFError) as e:
        hf.import_dir(out)
    assert message in str(e.value)


def test_tied_export_with_a_redundant_lm_head_imports(exported):
    cfg, params, out = exported
    tensors = tensors_of(out / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    edit_config(out, tie_word_embeddings=True)
    fields, back = hf.import_dir(out)
    assert fields["tie_embeddings"] and "unembed" not in back


# --- CLI -----------------------------------------------------------------------------------------------


def test_overrides_parse_into_a_config_that_matches(exported, capsys):
    from absl import flags
    from ml_collections import config_flags

    from jaxtrain import config as config_lib

    cfg, _, out = exported
    assert hf_cli.main(["overrides", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1] == f"--config.model.init_from={out}"
    argv = ["prog", *printed[:-1]]  # config_flags reads the overrides from sys_argv, not from the call
    values = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", config_lib.base_config(), flag_values=values, sys_argv=argv)
    values(argv)
    assert {f: values.config.model[f] for f in hf.FIELDS} == {f: getattr(cfg, f) for f in hf.FIELDS}


def test_cli_bad_input_is_one_error_line(tmp_path, capsys):
    assert hf_cli.main(["overrides", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json: not found" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        hf_cli.main(["export", "--workdir", str(tmp_path)])  # no --output
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--output" in err and err.count("\n") == 1
    assert hf_cli.main(["export", "--workdir", str(tmp_path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: workdir: ") and err.count("\n") == 1


def run_hf_cli(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "jaxtrain", "hf", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.slow
def test_export_cli_on_a_trained_workdir(tiny_config, tmp_path):
    from jaxtrain import train

    config = tiny_config(**{"train.steps": 2})
    train.run(config, print_fn=lambda *a, **k: None)
    out = tmp_path / "hf"
    result = run_hf_cli("export", "--workdir", config.workdir, "--output", str(out))
    assert result.returncode == 0, result.stderr

    _, model_cfg, _, trained = trainer_lib.restore_params(config.workdir)
    fields, back = hf.import_dir(out)
    assert fields == {f: getattr(model_cfg, f) for f in hf.FIELDS}
    assert_same_tree(jax.device_get(trained), back)
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["max_position_embeddings"] == config.train.seq_len
    tok = layout.load_tokenizer(config.data.dir)
    assert hf_config["eos_token_id"] == tok.eos_id
    assert (out / "tokenizer.json").read_bytes() == (Path(config.data.dir) / "tokenizer.json").read_bytes()
    # transformers reads the copied tokenizer as jaxtrain does.
    text = "In the beginning God created the heaven and the earth."
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eos_id

    before = sorted(p.name for p in out.iterdir())
    again = run_hf_cli("export", "--workdir", config.workdir, "--output", str(out))
    assert again.returncode == 2
    assert again.stderr.startswith("error: ") and "not empty" in again.stderr and again.stderr.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == before
    assert run_hf_cli("export", "--workdir", config.workdir, "--output", str(out), "--overwrite").returncode == 0

    # --overwrite onto the workdir itself (it holds a config.json too) deletes nothing.
    workdir_files = tree_digest(config.workdir)
    onto = run_hf_cli("export", "--workdir", config.workdir, "--output", config.workdir, "--overwrite")
    assert onto.returncode == 2 and onto.stdout == ""
    assert onto.stderr.splitlines() == [
        f"error: {config.workdir}: not empty (it holds checkpoints, config.json, goodput.jsonl, metrics.jsonl, ...) "
        f"and not written by jaxtrain hf export; choose another output directory"]
    assert tree_digest(config.workdir) == workdir_files

    # model.init_from: a fresh run starts from the export, so its step-0 eval is the trained run's last.
    tuned = tiny_config(**{"train.steps": 1, "optim.warmup_steps": 0, "model.init_from": str(out)})
    train.run(tuned, print_fn=lambda *a, **k: None)
    evals = {name: [r for r in map(json.loads, open(Path(c.workdir) / "metrics.jsonl")) if "eval_loss" in r]
             for name, c in (("trained", config), ("tuned", tuned))}
    assert evals["tuned"][0]["step"] == 0 and evals["trained"][-1]["step"] == 2
    assert evals["tuned"][0]["eval_loss"] == pytest.approx(evals["trained"][-1]["eval_loss"], rel=1e-6)
    assert evals["trained"][0]["eval_loss"] != pytest.approx(evals["trained"][-1]["eval_loss"], rel=1e-6)  # moved

    # A different architecture, or data made with another tokenizer, stops before the workdir exists.
    from jaxtrain.config import ConfigError

    wrong = tiny_config(**{"model.d_ff": 48, "model.init_from": str(out)})
    with pytest.raises(ConfigError, match=r"^model.d_ff: 48 in the config.*has 64; set --config.model.d_ff=64"):
        train.run(wrong, print_fn=lambda *a, **k: None)
    assert not Path(wrong.workdir).exists()
    other_tok = tmp_path / "other_tok"
    other_tok.mkdir()
    for f in out.iterdir():
        (other_tok / f.name).write_bytes(f.read_bytes())
    vocab = json.loads((out / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {k: (v + 1) % len(vocab["model"]["vocab"]) for k, v in vocab["model"]["vocab"].items()}
    (other_tok / "tokenizer.json").write_text(json.dumps(vocab))
    foreign = tiny_config(**{"model.init_from": str(other_tok)})
    with pytest.raises(ConfigError, match=r"^model.init_from: .* ships its own tokenizer"):
        train.run(foreign, print_fn=lambda *a, **k: None)
    assert not Path(foreign.workdir).exists()
