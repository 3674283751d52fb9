"""Qwen3-MoE: Qwen3's attention and a dropless mixture of experts in every layer (norm_topk_prob: the top-k gates
renormalised or raw)."""

from __future__ import annotations

from jaxtrain.models.families import base

NAME, MODEL_TYPES, ARCHITECTURE = "qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM"
EXPERTS = {
    ("mlp", "w_router"): ("mlp.gate.weight", 1),
    ("mlp", "w_gate"): ("mlp.experts.{e}.gate_proj.weight", 1),
    ("mlp", "w_up"): ("mlp.experts.{e}.up_proj.weight", 1),
    ("mlp", "w_down"): ("mlp.experts.{e}.down_proj.weight", 1),
}


def from_hf(c: base.HFConfig) -> dict:
    c.absent("attention_bias", why="the model has no attention biases")
    c.absent("use_sliding_window", why="Qwen3's windows on the upper layers only are not supported")
    c.absent("mlp_only_layers", why="every layer must be a mixture of experts")
    if c.get("decoder_sparse_step", 1) != 1:
        c.refuse("decoder_sparse_step", f"{c.values['decoder_sparse_step']}; every layer must be a mixture of experts")
    n_experts = c.size("num_experts" if c.get("num_experts") is not None else "num_local_experts")
    fields = base.dense_fields(c)
    return {**fields, "qk_norm": True, "d_ff": c.size("moe_intermediate_size"), "n_experts": n_experts,
            "moe_top_k": c.size("num_experts_per_tok"), "moe_routing": "dropless",
            "moe_renormalize": bool(c.get("norm_topk_prob", False))}


def to_hf(cfg) -> dict:
    return {**base.dense_hf(cfg, ARCHITECTURE, "qwen3_moe"), "attention_bias": False, "use_sliding_window": False,
            "moe_intermediate_size": cfg.d_ff, "num_experts": cfg.n_experts, "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.moe_top_k, "norm_topk_prob": cfg.moe_renormalize, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def weights(cfg) -> dict:
    return base.table({**base.NORMS, **base.ATTENTION, **base.QK_NORM, **EXPERTS})
