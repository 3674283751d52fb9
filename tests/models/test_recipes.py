"""The recipes in configs/models/ hold the published architectures and validate for 8 devices (no compile)."""

from pathlib import Path

import pytest

from jaxtrain import config as config_lib
from jaxtrain import files
from jaxtrain.models import families

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs" / "models").glob("*.py"))
# Published totals (Hugging Face model cards), in billions.
PARAMS = {"llama3_1b": 1.24, "llama3_8b": 8.03, "llama3_8b_128k": 8.03, "qwen3_0_6b": 0.60, "qwen3_8b": 8.19,
          "qwen3_8b_128k": 8.19, "mistral_7b": 7.25, "gemma3_1b": 1.00, "gemma3_4b": 3.88, "mixtral_8x7b": 46.7,
          "qwen3_moe_30b_a3b": 30.5, "deepseek_v3_671b": 671, "moonlight_16b_a3b": 16.0}
# The multi-token prediction modules' (DeepSeek-V3's card: 14B, counting the module's own copies of the embedding and
# head, which the model's are here).
MTP_PARAMS = {"deepseek_v3_671b": 14}


def n_params(m) -> float:
    d, h = m.d_model, m.n_heads
    if m.kv_lora_rank:  # latent attention: low-rank projections and their norms
        qk = m.qk_nope_head_dim + m.head_dim
        q = m.q_lora_rank * (d + 1 + h * qk) if m.q_lora_rank else d * h * qk
        attn = (q + d * (m.kv_lora_rank + m.head_dim) + m.kv_lora_rank * (1 + h * (m.qk_nope_head_dim + m.v_head_dim))
                + h * m.v_head_dim * d)
    else:
        attn = d * m.head_dim * (2 * h + 2 * m.n_kv_heads) + 2 * m.head_dim * m.qk_norm
    mlp = 3 * d * m.d_ff * (max(m.n_experts, 1) + m.n_shared_experts) + (d + m.moe_score_bias) * m.n_experts
    norms = d * (4 if m.post_norms else 2)
    embed = m.vocab_size * d * (1 if m.tie_embeddings else 2)
    dense = m.first_dense_layers * (attn + 3 * d * m.dense_d_ff + norms)
    mtp = m.mtp_layers * (attn + mlp + norms + 3 * d + 2 * d * d)  # + 2 input norms, a final one, the projection
    return ((m.n_layers - m.first_dense_layers) * (attn + mlp + norms) + dense + embed + d) / 1e9, mtp / 1e9


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_with_the_published_size(path):
    cfg = files.run_python_file(path, "get_config", field="--config")
    config_lib.validate(cfg, 8)
    assert families.get(cfg.model.family) is not None
    model, mtp = n_params(cfg.model)
    assert model == pytest.approx(PARAMS[path.stem], rel=0.01)
    copies = cfg.model.mtp_layers * 2 * cfg.model.vocab_size * cfg.model.d_model / 1e9
    assert mtp + copies == pytest.approx(MTP_PARAMS.get(path.stem, 0), rel=0.05)


def test_every_recipe_is_listed():
    assert {p.stem for p in RECIPES} == set(PARAMS)


@pytest.mark.parametrize("recipe", ["sft_full", "sft_lora", "dpo_lora"])
def test_fine_tuning_recipes_validate_on_the_cpu_model_and_the_8b_ones(recipe):
    """configs/sft_full.py, sft_lora.py and dpo_lora.py: the CPU model, and `:llama3_8b` / `:qwen3_8b` that
    model's published architecture with the same fine-tuning settings."""
    path = RECIPES[0].parents[1] / f"{recipe}.py"
    for model in ("", "llama3_8b", "qwen3_8b"):
        cfg = files.run_python_file(path, "get_config", *([model] if model else []), field="--config")
        config_lib.validate(cfg, 8)
        assert (cfg.model.lora_rank > 0) == ("lora" in recipe)
        assert cfg.train.objective == ("dpo" if recipe.startswith("dpo") else "lm")
        if model:
            published = files.run_python_file(RECIPES[0].parent / f"{model}.py", "get_config", field="--config")
            assert n_params(cfg.model)[0] == n_params(published.model)[0] == pytest.approx(PARAMS[model], rel=0.01)


def test_the_grpo_recipe_validates_with_qwen3_8b_s_architecture():
    cfg = files.run_python_file(RECIPES[0].parents[1] / "grpo_qwen3_8b.py", "get_config", field="--config")
    config_lib.validate(cfg, 8)
    published = files.run_python_file(RECIPES[0].parent / "qwen3_8b.py", "get_config", field="--config")
    assert cfg.train.objective == "grpo" and cfg.model.lora_rank > 0
    assert n_params(cfg.model)[0] == n_params(published.model)[0] == pytest.approx(PARAMS["qwen3_8b"], rel=0.01)
    assert cfg.train.batch_size % cfg.grpo.group_size == 0
