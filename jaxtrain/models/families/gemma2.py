"""Gemma 2: Gemma 3's layout without q/k norms, with logit soft-capping in attention and on the output, and one
RoPE for every layer."""

from __future__ import annotations

from jaxtrain.models.families import base, gemma3

NAME, MODEL_TYPES, ARCHITECTURE = "gemma2", ("gemma2",), "Gemma2ForCausalLM"


def from_hf(c: base.HFConfig) -> dict:
    return gemma3.gemma_fields(c)


def to_hf(cfg) -> dict:
    return gemma3.gemma_hf(cfg, ARCHITECTURE, "gemma2")


def weights(cfg) -> dict:
    return base.table({**gemma3.NORMS, **base.ATTENTION, **base.MLP})
