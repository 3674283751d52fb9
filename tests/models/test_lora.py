"""LoRA: step 0 is the base model, the adapted forward equals the merged weights', training moves the adapters only
(the base bit for bit unchanged, no optimizer state for it), adapters shard like their weights, and 8 devices
equal one."""

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import init_params, step_history, trainer_on

from jaxtrain import config as config_lib
from jaxtrain import optim
from jaxtrain import trainer as trainer_lib
from jaxtrain.data import pipeline
from jaxtrain.errors import ConfigError
from jaxtrain.models import lora, transformer
from jaxtrain.models.config import Layout, ModelConfig
from jaxtrain.parallel import mesh as mesh_lib

CFG = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32, dtype="float32",
           loss_chunk_tokens=0)


def _params(cfg, seed=0):
    return init_params(cfg, seed)


def _logits(cfg, params, tokens):
    graphdef, state = transformer.from_params(cfg, params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return nnx.merge(graphdef, state)(tokens, positions, jnp.ones_like(tokens))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (2, 12), 0, 64)


def test_step_zero_is_the_base_model(tokens):
    base_cfg, lora_cfg = ModelConfig(**CFG), ModelConfig(**CFG, lora_rank=4)
    base = _params(base_cfg)
    adapters, _ = lora.split(_params(lora_cfg))
    assert {k for k in adapters["blocks"]["attn"]} == {f"w{n}_lora_{s}" for n in "qkvo" for s in "ab"}
    assert all(not np.any(b) for k, b in jax.tree_util.tree_leaves_with_path(adapters) if "lora_b" in str(k[-1]))
    np.testing.assert_array_equal(_logits(lora_cfg, lora.join(adapters, base), tokens), _logits(base_cfg, base, tokens))


def test_adapted_forward_equals_the_merged_weights(tokens):
    cfg = ModelConfig(**CFG, lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,gate,down")
    adapters, base = lora.split(_params(cfg))
    # nonzero B everywhere, so every adapter moves the output
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.random.normal(jax.random.key(len(str(p))), x.shape) * 0.1 if "lora_b" in str(p[-1]) else x,
        adapters)
    params = lora.join(adapters, base)
    adapted = _logits(cfg, params, tokens)
    assert not np.allclose(adapted, _logits(ModelConfig(**CFG), base, tokens), atol=1e-3)
    merged = lora.merged(params, cfg)
    assert lora.split(merged)[0] == {}
    np.testing.assert_allclose(_logits(ModelConfig(**CFG), merged, tokens), adapted, rtol=2e-5, atol=2e-5)
    # one weight by hand: W + (alpha / r) A B
    a, b = adapters["blocks"]["attn"]["wq_lora_a"], adapters["blocks"]["attn"]["wq_lora_b"]
    expected = base["blocks"]["attn"]["wq"] + 2.0 * np.einsum("ldr,lrhk->ldhk", a, b)
    np.testing.assert_allclose(merged["blocks"]["attn"]["wq"], expected, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def undropped_run(tiny_config, tiny_data_dir):
    """8 steps of a LoRA model (no dropout) on one device: (trainer, params before, params after, [(loss, grad
    norm) per step]); its first 3 steps are the undropped side of the dropout check below."""
    cfg = tiny_config(**{"model.lora_rank": 4, "optim.lr": 1e-2})
    one = trainer_on(cfg, {"data": 1, "fsdp": 1, "tensor": 1}, mesh_lib.resolve_rules("dp_fsdp_tp"),
                                    devices=jax.devices()[:1])
    state = one.init()
    before = jax.device_get(state["params"])
    stream = pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=8, seed=0)
    history = []
    for _ in range(8):
        state, m = one.train_step(state, trainer_lib.global_batch(next(stream), one.batch_sharding))
        history.append((float(m["loss"]), float(m["grad_norm"])))
    stream.close()
    return one, before, jax.device_get(state["params"]), np.array(history)


def test_training_moves_only_the_adapters(undropped_run):
    one, before, after, history = undropped_run
    # the optimizer state holds the adapters' moments only
    paths = {optim.param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(one.abstract_state["opt_state"])}
    moments = [p for p in paths if "/.mu/" in p or "/.nu/" in p]
    assert len(moments) == 2 * 14 and all(p.endswith(lora.SUFFIXES) for p in moments)
    adapters_before, base_before = lora.split(before)
    adapters_after, base_after = lora.split(after)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(base_before), jax.tree.leaves(base_after)):
        assert np.array_equal(x, y), jax.tree_util.keystr(path)
    moved = [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(adapters_after))]
    assert all(moved)
    assert history[-1, 0] < history[0, 0]


def test_adapters_shard_like_their_weights_and_eight_devices_equal_one(tiny_config, tiny_data_dir, undropped_run):
    """With dropout on (its masks drawn per row, whatever the mesh or the microbatches), and moving the loss."""
    lora_cfg = {"model.lora_rank": 4, "optim.lr": 1e-2, "model.lora_dropout": 0.3}
    cfg = tiny_config(**lora_cfg, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.microbatches": 2})
    facts = config_lib.validate(cfg, 8)
    eight = trainer_lib.build_trainer(cfg, facts)
    attn = eight.shardings["params"]["blocks"]["attn"]
    mlp = eight.shardings["params"]["blocks"]["mlp"]
    # wq [layers 2, embed 32, heads 8, head_dim 8]: A [2, 32, r] splits embed over fsdp; B [2, r, 8, 8] the heads
    assert attn["wq_lora_a"].shard_shape((2, 32, 4)) == (2, 16, 4)
    assert attn["wq_lora_b"].shard_shape((2, 4, 8, 8)) == (2, 4, 4, 8)
    assert mlp["w_down_lora_a"].shard_shape((2, 64, 4)) == (2, 32, 4)  # d_ff over tensor, as w_down's
    one = trainer_on(tiny_config(**lora_cfg), {"data": 1, "fsdp": 1, "tensor": 1},
                                    mesh_lib.resolve_rules("dp_fsdp_tp"), devices=jax.devices()[:1])
    history = step_history(one, tiny_data_dir, 3)
    np.testing.assert_allclose(step_history(eight, tiny_data_dir, 3), history, rtol=1e-5, atol=1e-7)
    without = undropped_run[3][:3]  # the same model and data with lora_dropout 0
    assert without[0, 0] == pytest.approx(history[0, 0], rel=1e-6)  # B = 0: the adapters add nothing yet
    assert np.all(np.abs(without[:, 1] / history[:, 1] - 1) > 0.05)  # but B's gradient sees the dropped inputs


class _Adapted(nnx.Module):
    def __init__(self, cfg):
        self.cfg = cfg
        rngs = nnx.Rngs(0)
        lora.add(self, "wq", "q", (8, 2, 3), ("embed", "q_heads", "head_dim"), 1, cfg, rngs)
        self.wq_lora_b = nnx.Param(jax.random.normal(jax.random.key(3), (4, 2, 3)))


def test_dropout_drops_the_adapters_input_as_peft_does():
    """PEFT's lora_B(lora_A(dropout(x))) * alpha / r: each element of A's input zeroed with probability p, the rest
    scaled by 1 / (1 - p); per row key and weight; off without keys (eval, the DPO reference, decoding)."""
    from jaxtrain.models.layers import project  # noqa: PLC0415
    from jaxtrain.step import dropout_keys  # noqa: PLC0415

    p = 0.25
    module = _Adapted(ModelConfig(**CFG, lora_rank=4, lora_alpha=8.0, lora_dropout=p))
    keys = dropout_keys(0, 5, 4)
    assert keys.shape[0] == 4 and keys.dtype == jnp.uint32
    ones = jnp.ones((4, 500, 8))
    dropped = np.asarray(lora.dropout(ones, keys, "wq", p))
    assert set(np.unique(dropped)) == {0.0, np.float32(1 / (1 - p))}
    assert abs((dropped == 0).mean() - p) < 0.01
    assert not np.array_equal(dropped[0], dropped[1])  # rows draw their own masks
    assert not np.array_equal(dropped, np.asarray(lora.dropout(ones, keys, "wk", p)))  # and each weight its own
    assert not np.array_equal(dropped, np.asarray(lora.dropout(ones, dropout_keys(0, 6, 4), "wq", p)))  # and step
    np.testing.assert_array_equal(dropped, lora.dropout(ones, dropout_keys(0, 5, 4), "wq", p))

    x = jax.random.normal(jax.random.key(4), (4, 500, 8))
    a, b = np.asarray(module.wq_lora_a[...]), np.asarray(module.wq_lora_b[...])
    expected = np.einsum("btd,dr,rhk->bthk", np.asarray(x) * dropped, a, b) * 2.0
    np.testing.assert_allclose(lora.delta(module, "wq", x, 1, project, keys), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lora.delta(module, "wq", x, 1, project), np.einsum("btd,dr,rhk->bthk", x, a, b) * 2.0,
                               rtol=1e-5, atol=1e-5)


def test_dropout_under_a_pipeline_equals_one_stage():
    """Each layer folds the keys it was given into the next layer's, so a pipelined model draws the same masks."""
    from jaxtrain.step import dropout_keys  # noqa: PLC0415

    cfg = ModelConfig(**{**CFG, "n_layers": 4}, lora_rank=4, lora_dropout=0.5)
    adapters, base = lora.split(_params(cfg))
    params = lora.join(jax.tree.map(lambda x: x + 0.1, adapters), base)
    staged = Layout(pipeline_stages=2, pipeline_microbatches=2)
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, 64)
    positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)

    @functools.partial(jax.jit, static_argnums=0)  # one program each: op by op, the pipeline compiles hundreds
    def hidden(layout, keys):
        graphdef, state = transformer.from_params(cfg, params, layout)
        return nnx.merge(graphdef, state).hidden(tokens, positions, jnp.ones_like(tokens), keys)[0]

    keys = dropout_keys(0, 0, 4)
    plain = hidden(Layout(), keys)
    np.testing.assert_allclose(hidden(staged, keys), plain, rtol=1e-5, atol=1e-5)
    assert not np.allclose(plain, hidden(Layout(), None), atol=1e-3)


@pytest.mark.parametrize("override, field", [
    ({"model.lora_rank": -1}, "model.lora_rank"),
    ({"model.lora_rank": 4, "model.lora_targets": "q,x"}, "model.lora_targets"),
    ({"model.lora_rank": 4, "model.lora_alpha": 0.0}, "model.lora_alpha"),
    ({"model.lora_rank": 4, "model.lora_dropout": 1.0}, "model.lora_dropout"),
])
def test_bad_lora_settings_name_their_field(tiny_config, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_lib.validate(tiny_config(**override), 8)


def test_all_and_the_list_it_stands_for_resume_alike(tiny_config):
    """A workdir saved with the targets listed resumes under "all" (the default), and not under fewer targets."""
    cfg = tiny_config(**{"model.lora_rank": 4})
    saved = cfg.to_dict()
    saved["model"]["lora_targets"] = "v,q,k,o,gate,up,down"
    config_lib.check_resumable(saved, cfg, "runs/x")
    saved["model"]["lora_targets"] = "q,v"
    with pytest.raises(ConfigError, match=r"model\.lora_targets.*'all'.*'q,v'"):
        config_lib.check_resumable(saved, cfg, "runs/x")


def test_the_alpha_is_fixed_for_a_lora_workdir(tiny_config):
    """The saved adapters compute with their alpha, and both exports write it: a resume may not change it. Without
    adapters it scales nothing, and may."""
    saved = tiny_config(**{"model.lora_rank": 4, "model.lora_alpha": 8.0}).to_dict()
    with pytest.raises(ConfigError, match=r"model\.lora_alpha.*16\.0.*8\.0"):
        config_lib.check_resumable(saved, tiny_config(**{"model.lora_rank": 4, "model.lora_alpha": 16.0}), "w")
    config_lib.check_resumable(saved, tiny_config(**{"model.lora_rank": 4, "model.lora_alpha": 8.0}), "w")
    saved = tiny_config(**{"model.lora_alpha": 8.0}).to_dict()
    config_lib.check_resumable(saved, tiny_config(**{"model.lora_alpha": 16.0}), "w")


def test_hf_export_folds_the_adapters_in_and_init_from_starts_at_the_base(tmp_path, tokens, tiny_config):
    """`hf export` of a LoRA model writes the merged weights (its logits are the adapted model's), and a LoRA run
    started from a Hugging Face directory (model.init_from) gets fresh adapters: step 0 is that model."""
    from jaxtrain.models import hf  # noqa: PLC0415

    cfg = ModelConfig(**CFG, lora_rank=4, tie_embeddings=False)
    adapters, base = lora.split(_params(cfg))
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # B no longer zero
    adapted = _logits(cfg, lora.join(adapters, base), tokens)
    out = hf.export(lora.join(adapters, base), cfg, tmp_path / "hf")
    fields, imported = hf.import_dir(out)
    plain = ModelConfig(**{**fields, "dtype": "float32", "param_dtype": "float32", "loss_chunk_tokens": 0})
    np.testing.assert_allclose(_logits(plain, imported, tokens), adapted, rtol=2e-5, atol=2e-5)
    assert lora.split(imported)[0] == {}

    # model.init_from's path: the directory's weights, fresh adapters beside them, step 0 = that model
    sizes = {f"model.{k}": v for k, v in CFG.items() if k != "dtype"}
    run = tiny_config(**sizes, **{"model.tie_embeddings": False, "model.lora_rank": 4})
    trainer = trainer_on(run, {"data": 1, "fsdp": 1, "tensor": 1}, mesh_lib.resolve_rules("dp"),
                                        devices=jax.devices()[:1])
    state = trainer.init_from_host(imported)
    started = jax.device_get(state["params"])
    assert lora.split(started)[0]  # adapters added
    np.testing.assert_array_equal(_logits(ModelConfig(**CFG, lora_rank=4, tie_embeddings=False), started, tokens),
                                  _logits(plain, imported, tokens))


def test_peft_loads_the_exported_adapters_onto_the_transformers_base(tmp_path, tokens):
    """`hf export --adapters`: PEFT's PeftModel, given the exported base and the adapter directory, computes
    jaxtrain's adapted logits."""
    torch = pytest.importorskip("torch")
    import peft  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from jaxtrain.models import hf  # noqa: PLC0415

    cfg = ModelConfig(**CFG, lora_rank=4, lora_alpha=8.0, tie_embeddings=False)
    adapters, base = lora.split(_params(cfg))
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.random.normal(jax.random.key(len(str(p))), x.shape) * 0.1 if "lora_b" in str(p[-1]) else x,
        adapters)
    adapted = _logits(cfg, lora.join(adapters, base), tokens)
    base_dir = hf.export(base, ModelConfig(**CFG, tie_embeddings=False), tmp_path / "base")
    adapter_dir = hf.export_adapters(lora.join(adapters, base), cfg, tmp_path / "adapters")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(theirs, adapted, rtol=1e-4, atol=1e-4)


def test_a_peft_adapter_directory_imports_as_the_adapters_peft_computes(tmp_path, tokens):
    """hf.import_adapters reads PEFT's own save_pretrained output: jaxtrain with those adapters computes the
    PeftModel's logits. And export_adapters -> import_adapters gives back the same arrays."""
    torch = pytest.importorskip("torch")
    import peft  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from jaxtrain.errors import HFError  # noqa: PLC0415
    from jaxtrain.models import hf  # noqa: PLC0415

    cfg = ModelConfig(**CFG, lora_rank=4, lora_alpha=8.0, tie_embeddings=False)
    adapters, base = lora.split(_params(cfg))
    base_dir = hf.export(base, ModelConfig(**CFG, tie_embeddings=False), tmp_path / "base")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                       init_lora_weights=False))  # B random: the check has teeth
    model.save_pretrained(tmp_path / "theirs")
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(np.asarray(tokens))).logits.numpy()
    imported = hf.import_adapters(tmp_path / "theirs", cfg)
    np.testing.assert_allclose(_logits(cfg, lora.join(imported, base), tokens), theirs, rtol=1e-4, atol=1e-4)

    hf.export_adapters(lora.join(imported, base), cfg, tmp_path / "ours")
    again = hf.import_adapters(tmp_path / "ours", cfg)
    for x, y in zip(jax.tree.leaves(imported), jax.tree.leaves(again)):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(HFError, match="lora_alpha"):
        hf.import_adapters(tmp_path / "ours", ModelConfig(**CFG, lora_rank=4, lora_alpha=16.0, tie_embeddings=False))
    with pytest.raises(HFError, match="no place for"):
        hf.import_adapters(tmp_path / "ours", ModelConfig(**CFG, lora_rank=4, lora_alpha=8.0, tie_embeddings=False,
                                                          lora_targets="q,v"))

    # What PEFT computes and jaxtrain does not (rsLoRA's alpha / sqrt(r), per-module alphas) is refused by name,
    # as PEFT's own save_pretrained writes it; so are the fields that add to plain LoRA, and damaged weights.
    for name, extra, field in (("rslora", {"use_rslora": True}, "use_rslora"),
                               ("pattern", {"alpha_pattern": {"q_proj": 16}}, "alpha_pattern")):
        theirs = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                     peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **extra))
        theirs.save_pretrained(tmp_path / name)
        with pytest.raises(HFError, match=rf"adapter_config\.json: {field} is"):
            hf.import_adapters(tmp_path / name, cfg)
    plain = json.loads((tmp_path / "ours" / hf.ADAPTER_CONFIG).read_text())
    for field, value in (("use_dora", True), ("fan_in_fan_out", True), ("layers_to_transform", [0]), ("bias", "all"),
                         ("modules_to_save", ["lm_head"]), ("rank_pattern", {"q_proj": 2})):
        (tmp_path / "ours" / hf.ADAPTER_CONFIG).write_text(json.dumps({**plain, field: value}))
        with pytest.raises(HFError, match=re.escape(f"{field} is {value!r}")):
            hf.import_adapters(tmp_path / "ours", cfg)
    (tmp_path / "ours" / hf.ADAPTER_CONFIG).write_text(json.dumps(plain))
    weights = tmp_path / "ours" / hf.ADAPTER_WEIGHTS
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(HFError, match="not a readable safetensors file"):
        hf.import_adapters(tmp_path / "ours", cfg)
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415
    weights.write_bytes(good)
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = np.full_like(tensors[first], np.nan)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(HFError, match=f"{first} holds NaN"):
        hf.import_adapters(tmp_path / "ours", cfg)


def test_a_run_starts_from_a_peft_adapter_directory(tmp_path, tiny_config):
    """model.init_adapters: a LoRA run over model.init_from's base starts with a PEFT directory's adapters, so
    its step-0 eval loss is the merged model's; without a base, or with another rank, it exits before the run."""
    from jaxtrain import train  # noqa: PLC0415
    from jaxtrain.models import hf  # noqa: PLC0415

    sizes = {f"model.{k}": v for k, v in CFG.items() if k != "dtype"}
    sizes = {**sizes, "model.vocab_size": 512, "model.tie_embeddings": False}
    cfg = ModelConfig(**{**CFG, "vocab_size": 512}, lora_rank=4, lora_alpha=8.0, tie_embeddings=False)
    adapters, base = lora.split(_params(cfg))
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)
    base_dir = hf.export(base, ModelConfig(**{**CFG, "vocab_size": 512}, tie_embeddings=False), tmp_path / "base")
    hf.export_adapters(lora.join(adapters, base), cfg, tmp_path / "adapters")
    merged_dir = hf.export(lora.join(adapters, base), cfg, tmp_path / "merged")
    quiet = {"print_fn": lambda *a, **k: None}
    lora_run = {**sizes, "model.lora_rank": 4, "model.lora_alpha": 8.0, "model.init_from": str(base_dir),
                "model.init_adapters": str(tmp_path / "adapters"), "train.steps": 2}
    started = train.run(tiny_config(**lora_run), **quiet)["eval"][0]
    merged = train.run(tiny_config(**sizes, **{"model.init_from": str(merged_dir), "train.steps": 2}), **quiet)["eval"][0]
    assert started[0] == merged[0] == 0 and started[1] == pytest.approx(merged[1], rel=1e-5)
    for bad, field in (({"model.init_from": ""}, "model.init_adapters"), ({"model.lora_alpha": 16.0}, "model.init_adapters")):
        with pytest.raises(ConfigError, match=field):  # the run's input checks, before its workdir exists
            train.check_inputs(tiny_config(**{**lora_run, **bad}))


def test_latent_attention_adapters_decode_from_the_latent_cache_and_merge():
    """LoRA on latent attention (lora_targets q,kv,o: both query projections, both key-value ones, the output) with
    every adapter non-zero: decoding from the latent cache, where the key-value up-projection's adapters are folded
    into it, gives the forward's last logits, and the merged weights give the adapted model's logits."""
    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, head_dim=8, d_ff=48, kv_lora_rank=16,
                      q_lora_rank=12, qk_nope_head_dim=8, v_head_dim=6, rope_interleave=True, lora_rank=4,
                      lora_targets="q,kv,o", dtype="float32", param_dtype="float32")
    rng = np.random.default_rng(1)  # numpy: a jax draw per shape would compile a program each
    params = jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.normal(size=x.shape).astype(np.float32),
                          init_params(cfg))  # B non-zero
    adapted = sorted(k for k in params["blocks"]["attn"] if lora.is_adapter(k))
    assert adapted == [f"{w}_lora_{s}" for w in ("wkv_a", "wkv_b", "wo", "wq_a", "wq_b") for s in "ab"]
    tokens = jnp.arange(16).reshape(2, 8) % 128
    positions, segments = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def run(cfg, params):
        model = nnx.merge(*transformer.from_params(cfg, params))
        return model(tokens, positions, segments), model.decode(tokens, model.init_cache(2, 16), 0)[0]

    full, decoded = run(cfg, params)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full)[:, -1], rtol=1e-5, atol=1e-5)
    merged, _ = run(dataclasses.replace(cfg, lora_rank=0), lora.merged(params, cfg))
    np.testing.assert_allclose(np.asarray(merged), np.asarray(full), rtol=1e-5, atol=1e-5)
