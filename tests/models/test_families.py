"""Every model family against `transformers` (tiny seeded random models, nothing downloaded): logits on a
batch longer than the sliding window and on two documents packed in a row, greedy decoding through `jaxtrain
generate --hf`, export loaded back by `transformers`, export then import bit-exact; and 3 training steps on 8
fake devices against one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from flax import nnx
from helpers import init_params

from jaxtrain.models import families, hf, transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain.tools import generate as generate_cli

# head_dim 12, not hidden_size / heads = 8: the families must read it, not derive it.
SIZES = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=12, intermediate_size=64, max_position_embeddings=128, initializer_range=0.5,
             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
WINDOW, T_LEN = 4, 12  # the batch is 3 windows long
GEMMA = dict(query_pre_attn_scalar=6, sliding_window=WINDOW, tie_word_embeddings=True,
             layer_types=["sliding_attention", "full_attention"])
# family -> (config class, model class, what the family exercises)
FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(rope_parameters=dict(
        rope_type="linear", rope_theta=5000.0, factor=2.0))),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=8))),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(GEMMA, attn_logit_softcapping=5.0,
                                                          final_logit_softcapping=3.0)),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(GEMMA, rope_parameters=dict(
        full_attention=dict(rope_type="linear", rope_theta=100000.0, factor=2.0),
        sliding_attention=dict(rope_type="default", rope_theta=1000.0)))),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=WINDOW)),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[])),
    # Latent attention with both low-rank projections and interleaved YaRN (DeepSeek's mscales), one dense layer,
    # then 8 experts in 4 groups (2 chosen), a shared expert and the scaled gates.
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
        num_key_value_heads=4, head_dim=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12,
        v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=32,
                             mscale=0.8, mscale_all_dim=0.9))),
}


def test_every_family_is_tested():
    assert set(FAMILIES) == set(families.FAMILIES)


def make_hf_dir(path, name, seed=0):
    config_cls, model_cls, overrides = FAMILIES[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SIZES, **overrides})).to(torch.float32)
    with torch.no_grad():
        for key, p in model.named_parameters():
            # transformers starts biases at 0 and norm scales at 1 (Gemma's 1 + w at w = 0), where a swapped or
            # dropped tensor would go unseen: random ones check that each is mapped where it belongs.
            if key.endswith("bias") or "norm" in key:
                p.add_(0.5 * torch.randn_like(p))
        for key, b in model.named_buffers():  # DeepSeek's router bias, a buffer
            if key.endswith("e_score_correction_bias"):
                b.add_(0.5 * torch.randn_like(b))
        if model.config.tie_word_embeddings:  # else a token's own embedding dominates the tied head's logits, and
            model.get_input_embeddings().weight.mul_(0.1)  # greedy decoding only repeats the last prompt token
    model.save_pretrained(path)
    return path


def hf_model(path):
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model, tokens):
    """`model`'s logits: a loaded model, or the path of a directory to load."""
    model = hf_model(model) if not isinstance(model, torch.nn.Module) else model
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def our_logits(fields, params, tokens, positions=None, segment_ids=None):
    cfg = ModelConfig(**{**fields, "dtype": "float32", "param_dtype": "float32", "loss_chunk_tokens": 0})
    graphdef, state = transformer.from_params(cfg, jax.tree.map(jnp.asarray, params))
    b, t = tokens.shape
    if positions is None:
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    if segment_ids is None:
        segment_ids = np.ones((b, t), np.int32)
    return np.asarray(nnx.merge(graphdef, state)(tokens, positions, segment_ids))


def greedy(model, prompt, n):
    """transformers' n greedy tokens; asserts the reference is worth matching: top-2 logits further apart than
    twice the logits' tolerance (else the comparison tests rounding), and not one token repeated (what a model
    ignoring its context could also produce)."""
    with torch.no_grad():
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        out = model.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=n, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    gap = min(float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores)
    assert gap > 2e-4 and len(set(ids)) >= 5, f"a degenerate reference: {ids}, smallest top-2 gap {gap:.1e}"
    return ids


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_transformers_both_ways(name, tmp_path, capsys):
    src = make_hf_dir(tmp_path / "hf", name)
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, T_LEN), dtype=np.int32)
    fields, params = hf.import_dir(src)
    assert fields["family"] == name
    reference = hf_model(src)  # loaded once for every comparison with the source directory
    want = hf_logits(reference, tokens)
    np.testing.assert_allclose(our_logits(fields, params, tokens), want, atol=1e-4, rtol=1e-4)

    # Two documents packed in a row (positions restart at the second, 7 tokens: beyond the window) each equal
    # the document alone.
    cut = 5
    positions = np.concatenate([np.arange(cut), np.arange(T_LEN - cut)])[None].astype(np.int32)
    segments = np.array([[1] * cut + [2] * (T_LEN - cut)], np.int32)
    packed = our_logits(fields, params, tokens[:1], positions, segments)
    np.testing.assert_allclose(packed[:, :cut], hf_logits(reference, tokens[:1, :cut]), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(packed[:, cut:], hf_logits(reference, tokens[:1, cut:]), atol=1e-4, rtol=1e-4)

    # Export: transformers loads it as it is and computes the same logits; importing it gives the same params.
    cfg = ModelConfig(**{**fields, "dtype": "float32", "param_dtype": "float32"})
    out = hf.export(params, cfg, tmp_path / "out", max_position_embeddings=128, shard_bytes=20_000)
    assert (out / hf.WEIGHTS_INDEX).is_file()  # sharded: more than one file
    np.testing.assert_allclose(hf_logits(out, tokens), want, atol=1e-5, rtol=1e-5)
    fields_back, params_back = hf.import_dir(out)
    assert fields_back == fields
    jax.tree.map(np.testing.assert_array_equal, params_back, params)

    # 20 greedy tokens from the directory, as `jaxtrain generate --hf` prints them.
    prompt = [5, 17, 42, 3, 88, 1]
    assert generate_cli.main(["--hf", str(src), "--prompt_ids", ",".join(map(str, prompt)),
                              "--max_new_tokens", "20", "--temperature", "0"]) == 0
    ids = capsys.readouterr().out.strip().splitlines()[-1]
    assert ids == ",".join(map(str, greedy(reference, prompt, 20)))


def test_export_refuses_what_the_family_cannot_write(tmp_path):
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                      qk_norm=True, dtype="float32", param_dtype="float32")
    params = init_params(cfg)
    with pytest.raises(hf.HFError, match=r"model.qk_norm: True cannot be written as a llama checkpoint"):
        hf.export(params, cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    hf.export(params, dataclasses.replace(cfg, family="qwen3"), tmp_path / "out")


@pytest.mark.parametrize("field,value,named", [
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "rope_parameters.rope_type"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("hidden_activation", "gelu", "hidden_activation"),
])
def test_unsupported_family_settings_are_named(tmp_path, field, value, named):
    import json
    src = make_hf_dir(tmp_path / "hf", "gemma3")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(hf.HFError, match=f"config.json: {named}"):
        hf.import_dir(src)


SIZE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "tie_embeddings",
               "norm_eps")
MESHES = {"mistral": {"sequence": 2, "fsdp": 2, "tensor": 2}, "qwen3_moe": {"expert": 2, "fsdp": 2, "tensor": 2},
          "deepseek_v3": {"expert": 2, "fsdp": 2, "tensor": 2}}


@pytest.mark.slow
# Llama's options are the defaults every test in tests/parallel trains; Qwen3's q/k norms are Qwen3-MoE's and Gemma 3's;
# Mixtral's softmax top-2 router is the tiny MoE's that tests/parallel trains on these axes.
@pytest.mark.parametrize("name", sorted(set(FAMILIES) - {"llama", "qwen3", "mixtral"}))
def test_family_trains_on_8_devices_like_one(name, tiny_config, tmp_path):
    """The family's options (read from its tiny HF config) on the tiny model: fsdp x tensor, the MoE families on
    the expert axis, Mistral's window under sequence parallelism."""
    from parallel.test_parallelism import assert_same_training, configure, single_device
    from parallel_worker import synthetic_batches

    fields = hf.read_config(make_hf_dir(tmp_path / "hf", name))
    options = {f"model.{k}": v for k, v in fields.items() if k not in SIZE_FIELDS}
    cfg = configure(tiny_config, MESHES.get(name, {"fsdp": 2, "tensor": 2}), **options)
    assert_same_training(cfg, single_device(cfg), synthetic_batches(1, 8, 32, 512) * 3)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_overrides_give_the_directory_s_model(name, tmp_path):
    """`jaxtrain hf overrides DIR` parsed over the base config: every field the directory determines matches, so
    the config check against `model.init_from` passes."""
    from absl import flags
    from ml_collections import config_flags

    from jaxtrain import config as config_lib

    src = make_hf_dir(tmp_path / "hf", name)
    argv = ["prog", *hf.override_flags(src)]
    values = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", config_lib.base_config(), flag_values=values, sys_argv=argv)
    values(argv)
    fields = hf.read_config(src)
    assert {f: values.config.model[f] for f in fields} == fields
    hf.check_init_from(src, config_lib.model_config(values.config, "cpu"))
    # Without the flags: model.init_from alone gives the same model (train.run's first step).
    from jaxtrain import train

    base = config_lib.base_config()
    base.model.init_from = str(src)
    followed = train.following_init_from(base)
    assert {f: followed.model[f] for f in fields} == fields and base.model.d_model != followed.model.d_model
    hf.check_init_from(src, config_lib.model_config(followed, "cpu"))
