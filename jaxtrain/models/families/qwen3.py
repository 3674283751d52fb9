"""Qwen3 (dense): Llama's layout plus RMSNorm on each head's q and k; head_dim set on its own."""

from __future__ import annotations

from jaxtrain.models.families import base

NAME, MODEL_TYPES, ARCHITECTURE = "qwen3", ("qwen3",), "Qwen3ForCausalLM"


def from_hf(c: base.HFConfig) -> dict:
    c.absent("attention_bias", why="the model has no attention biases")
    c.absent("use_sliding_window", why="Qwen3's windows on the upper layers only are not supported")
    return {**base.dense_fields(c), "qk_norm": True}


def to_hf(cfg) -> dict:
    return {**base.dense_hf(cfg, ARCHITECTURE, "qwen3"), "attention_bias": False, "use_sliding_window": False}


def weights(cfg) -> dict:
    return base.table({**base.NORMS, **base.ATTENTION, **base.QK_NORM, **base.MLP})
