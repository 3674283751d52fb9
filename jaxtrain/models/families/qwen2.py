"""Qwen2 and Qwen2.5: Llama's layout plus biases on q, k and v."""

from __future__ import annotations

from jaxtrain.models.families import base

NAME, MODEL_TYPES, ARCHITECTURE = "qwen2", ("qwen2",), "Qwen2ForCausalLM"


def from_hf(c: base.HFConfig) -> dict:
    c.absent("use_sliding_window", why="Qwen2's windows on the upper layers only are not supported")
    return {**base.dense_fields(c), "qkv_bias": True}


def to_hf(cfg) -> dict:
    return {**base.dense_hf(cfg, ARCHITECTURE, "qwen2"), "use_sliding_window": False}


def weights(cfg) -> dict:
    return base.table({**base.NORMS, **base.ATTENTION, **base.QKV_BIAS, **base.MLP})
