"""Model families: each module maps one Hugging Face architecture onto the one decoder.

A family module holds NAME, MODEL_TYPES (the config.json `model_type`s it reads), ARCHITECTURE (the
`*ForCausalLM` class it writes), `from_hf(HFConfig) -> ModelConfig fields`, `to_hf(cfg) -> config.json entries`
and `weights(cfg) -> {param path: (HF tensor name, layout)}` (see `base`). Adding a family adds one module here;
`jaxtrain.models.hf` moves the weights through its table.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def _discover() -> dict[str, ModuleType]:
    modules = (importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
               if m.name != "base")
    return {m.NAME: m for m in modules}


FAMILIES = _discover()


def get(name: str) -> ModuleType | None:
    return FAMILIES.get(name)


def for_model_type(model_type) -> ModuleType | None:
    return next((f for f in FAMILIES.values() if model_type in f.MODEL_TYPES), None)


def model_types() -> list[str]:
    return sorted(t for f in FAMILIES.values() for t in f.MODEL_TYPES)
