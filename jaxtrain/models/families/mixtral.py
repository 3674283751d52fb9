"""Mixtral: Mistral's attention and a dropless mixture of experts (w1 gate, w3 up, w2 down per expert)."""

from __future__ import annotations

from jaxtrain.models.families import base

NAME, MODEL_TYPES, ARCHITECTURE = "mixtral", ("mixtral",), "MixtralForCausalLM"
EXPERTS = {
    ("mlp", "w_router"): ("block_sparse_moe.gate.weight", 1),
    ("mlp", "w_gate"): ("block_sparse_moe.experts.{e}.w1.weight", 1),
    ("mlp", "w_up"): ("block_sparse_moe.experts.{e}.w3.weight", 1),
    ("mlp", "w_down"): ("block_sparse_moe.experts.{e}.w2.weight", 1),
}


def from_hf(c: base.HFConfig) -> dict:
    return {**base.dense_fields(c), **base.window_fields(c), "n_experts": c.size("num_local_experts"),
            "moe_top_k": c.size("num_experts_per_tok"), "moe_routing": "dropless", "moe_renormalize": True}


def to_hf(cfg) -> dict:
    return {**base.dense_hf(cfg, ARCHITECTURE, "mixtral"), "sliding_window": cfg.sliding_window or None,
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.moe_top_k}


def weights(cfg) -> dict:
    return base.table({**base.NORMS, **base.ATTENTION, **EXPERTS})
