"""Mistral: Llama's layout, with a sliding window over every layer where the config sets one (v0.1)."""

from __future__ import annotations

from jaxtrain.models.families import base

NAME, MODEL_TYPES, ARCHITECTURE = "mistral", ("mistral",), "MistralForCausalLM"


def from_hf(c: base.HFConfig) -> dict:
    return {**base.dense_fields(c), **base.window_fields(c)}


def to_hf(cfg) -> dict:
    return {**base.dense_hf(cfg, ARCHITECTURE, "mistral"), "sliding_window": cfg.sliding_window or None}


def weights(cfg) -> dict:
    return base.table({**base.NORMS, **base.ATTENTION, **base.MLP})
