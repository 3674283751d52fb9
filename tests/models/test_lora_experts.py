"""LoRA on a mixture of experts' experts (model.lora_targets "experts"): per-expert adapters on the fused
gate-and-up and on down, under both routings; the adapted forward equals the merged weights', gradients reach
every expert adapter and none of the base; they shard like the experts, and 8 devices (expert x fsdp x tensor)
equal one; and PEFT (target_parameters on transformers' fused experts) computes the same logits from our export,
as we do from its own save."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from flax import nnx
from helpers import init_params, step_history, train_on_stream, trainer_on

from jaxtrain import config as config_lib
from jaxtrain import trainer as trainer_lib
from jaxtrain.errors import ConfigError
from jaxtrain.models import hf, lora, transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain.parallel import mesh as mesh_lib

MOE = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24, n_experts=4,
           moe_top_k=2, dtype="float32", param_dtype="float32", loss_chunk_tokens=0)


def _logits(cfg, params, tokens):
    graphdef, state = transformer.from_params(cfg, jax.tree.map(jnp.asarray, params))
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return np.asarray(nnx.merge(graphdef, state)(tokens, positions, np.ones(tokens.shape, np.int32)))


def _random_b(adapters, scale=0.3):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.random.normal(jax.random.key(len(str(p))), x.shape) * scale if "lora_b" in str(p[-1]) else x,
        adapters)


@pytest.mark.parametrize("routing", ["dropless", "capacity"])
def test_expert_adapters_equal_their_merged_weights_and_train_alone(routing):
    base_cfg = ModelConfig(**MOE, moe_routing=routing, moe_capacity_factor=4.0)
    cfg = ModelConfig(**MOE, moe_routing=routing, moe_capacity_factor=4.0, lora_rank=2, lora_alpha=4.0)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 16), 0, 64))
    adapters, base = lora.split(init_params(cfg))
    mlp = adapters["blocks"]["mlp"]
    # "all" on a mixture of experts: the attention's four and the experts' two, one pair per expert
    assert set(mlp) == {"w_gate_up_lora_a", "w_gate_up_lora_b", "w_down_lora_a", "w_down_lora_b"}
    assert mlp["w_gate_up_lora_a"].shape == (2, 4, 16, 2) and mlp["w_gate_up_lora_b"].shape == (2, 4, 2, 2, 24)
    assert mlp["w_down_lora_a"].shape == (2, 4, 24, 2) and mlp["w_down_lora_b"].shape == (2, 4, 2, 16)
    np.testing.assert_array_equal(_logits(cfg, lora.join(adapters, base), tokens), _logits(base_cfg, base, tokens))

    adapters = _random_b(adapters)
    params = lora.join(adapters, base)
    adapted = _logits(cfg, params, tokens)
    assert not np.allclose(adapted, _logits(base_cfg, base, tokens), atol=1e-3)
    merged = lora.merged(params, cfg)
    np.testing.assert_allclose(_logits(base_cfg, merged, tokens), adapted, rtol=1e-5, atol=1e-5)
    # one expert's up projection by hand: W + (alpha / r) A B[:, 1]
    a, b = mlp["w_gate_up_lora_a"], adapters["blocks"]["mlp"]["w_gate_up_lora_b"]
    np.testing.assert_allclose(merged["blocks"]["mlp"]["w_up"][1, 3],
                               base["blocks"]["mlp"]["w_up"][1, 3] + 2.0 * a[1, 3] @ b[1, 3, :, 1], rtol=1e-6, atol=1e-6)

    graphdef = transformer.from_params(cfg, params)[0]

    def loss(params):
        positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)
        return jnp.mean(nnx.merge(graphdef, params)(tokens, positions, jnp.ones_like(tokens)) ** 2)

    grads = lora.split(jax.grad(loss)(jax.tree.map(jnp.asarray, params)))[0]["blocks"]["mlp"]
    for name, g in grads.items():  # every expert's A and B (B nonzero, so A's too), all experts chosen by some token
        assert np.all(np.abs(np.asarray(g)).reshape(2, 4, -1).max(-1) > 0), name


def test_expert_adapters_shard_like_the_experts_and_eight_devices_equal_one(tiny_config, tiny_data_dir):
    moe = {"model.n_experts": 4, "model.moe_top_k": 2, "model.moe_routing": "dropless", "model.lora_rank": 4,
           "optim.lr": 1e-2}
    cfg = tiny_config(**moe, **{"mesh.expert": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    facts = config_lib.validate(cfg, 8)
    eight = trainer_lib.build_trainer(cfg, facts)
    mlp = eight.shardings["params"]["blocks"]["mlp"]
    d, f = cfg.model.d_model, cfg.model.d_ff
    # [layers, experts, embed, r] / [layers, experts, r, 2, mlp]: the 4 experts over `expert` x fsdp (one each),
    # and mlp over `tensor`, as their experts' weights
    assert mlp["w_gate_up_lora_a"].shard_shape((2, 4, d, 4)) == (2, 1, d, 4)
    assert mlp["w_gate_up_lora_b"].shard_shape((2, 4, 4, 2, f)) == (2, 1, 4, 2, f // 2)
    assert mlp["w_down_lora_b"].shard_shape((2, 4, 4, d)) == (2, 1, 4, d)
    assert mlp["w_gate"].shard_shape((2, 4, d, f)) == (2, 1, d, f // 2)
    one = trainer_on(tiny_config(**moe), {"data": 1, "fsdp": 1, "tensor": 1},
                                    mesh_lib.resolve_rules("dp_fsdp_tp"), devices=jax.devices()[:1])
    before, after, history = train_on_stream(one, tiny_data_dir, 3)
    assert after < before
    np.testing.assert_allclose(step_history(eight, tiny_data_dir, 3), history, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("override, message", [
    ({"model.lora_targets": "q,gate"}, "no dense MLP"),
    ({"model.lora_targets": "q,experts", "model.lora_dropout": 0.1}, "model.lora_dropout"),
])
def test_bad_expert_targets_name_their_field(tiny_config, override, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.validate(tiny_config(**{"model.n_experts": 4, "model.lora_rank": 4, **override}), 8)
    with pytest.raises(ConfigError, match="no mixture of experts"):
        config_lib.validate(tiny_config(**{"model.lora_rank": 4, "model.lora_targets": "experts"}), 8)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_peft_computes_our_expert_adapters_and_we_compute_its(tmp_path, family):
    """Export: PEFT's PeftModel loads `hf export --adapters` (target_parameters on the fused experts) onto the
    transformers base and gives our logits. Import: PEFT's own save_pretrained of random expert adapters gives
    PEFT's logits in jaxtrain. DeepSeek-V3 (its first layer dense, so the experts' layer is model.layers.1) adapts
    latent attention's query, key-value and output projections beside its experts."""
    config_cls, model_cls, extra = {
        "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(num_experts=4, num_experts_per_tok=2,
                                                                    moe_intermediate_size=24, norm_topk_prob=True,
                                                                    head_dim=4)),
        "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
            num_key_value_heads=4, head_dim=4, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=8, n_shared_experts=1, first_k_dense_replace=1)),
    }[family]
    modules = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj"] if family == "deepseek_v3" else ["q_proj"]
    torch.manual_seed(0)
    model_cls(config_cls(**{"vocab_size": 64, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
                            "initializer_range": 0.3, **extra})).save_pretrained(tmp_path / "base")
    fields, base = hf.import_dir(tmp_path / "base")
    cfg = ModelConfig(**{**fields, "dtype": "float32", "param_dtype": "float32", "loss_chunk_tokens": 0,
                         "lora_rank": 2, "lora_alpha": 4.0,
                         "lora_targets": "q,kv,o,experts" if family == "deepseek_v3" else "q,experts"})
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 9), 0, 64))

    def peft_logits(model):
        with torch.no_grad():
            return model.eval()(torch.tensor(tokens)).logits.numpy()

    def hf_base():
        return T.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32,
                                                      attn_implementation="eager")

    import peft  # noqa: PLC0415

    adapters = _random_b(lora.split(init_params(cfg))[0])
    ours = hf.export_adapters(lora.join(adapters, base), cfg, tmp_path / "ours")
    config = json.loads((ours / "adapter_config.json").read_text())
    assert config["target_modules"] == modules
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    theirs = peft_logits(peft.PeftModel.from_pretrained(hf_base(), ours))
    np.testing.assert_allclose(theirs, _logits(cfg, lora.join(adapters, base), tokens), rtol=1e-4, atol=1e-4)

    model = peft.get_peft_model(hf_base(), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=modules, target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        init_lora_weights=False))  # B random: the check has teeth
    model.save_pretrained(tmp_path / "theirs")
    imported = hf.import_adapters(tmp_path / "theirs", cfg)
    np.testing.assert_allclose(_logits(cfg, lora.join(imported, base), tokens), peft_logits(model),
                               rtol=1e-4, atol=1e-4)
