"""Llama 2 and 3 (3.1, 3.2: `llama3` RoPE scaling): the decoder's defaults, no biases."""

from __future__ import annotations

from jaxtrain.models.families import base

NAME, MODEL_TYPES, ARCHITECTURE = "llama", ("llama",), "LlamaForCausalLM"


def from_hf(c: base.HFConfig) -> dict:
    c.absent("attention_bias", why="the model has no attention biases")
    return base.dense_fields(c, tie_default=False)


def to_hf(cfg) -> dict:
    return {**base.dense_hf(cfg, ARCHITECTURE, "llama"), "attention_bias": False, "mlp_bias": False}


def weights(cfg) -> dict:
    return base.table({**base.NORMS, **base.ATTENTION, **base.MLP})
