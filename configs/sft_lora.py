"""Supervised fine-tuning with LoRA adapters (rank 16 on every projection) over frozen weights: sft_full.py's
settings, with a learning rate for the adapters (docs/fine-tuning.md#lora).

    python -m jaxtrain.main --config configs/sft_lora.py --config.model.init_from=HF_DIR --config.data.dir=DATA_DIR
    jaxtrain hf export --workdir runs/sft_lora --output ADAPTER_DIR --adapters   # PEFT's format
    jaxtrain plan --config configs/sft_lora.py:qwen3_8b --devices 1 --backend gpu --device_kind H100
"""

from pathlib import Path

from jaxtrain import files


def get_config(model: str = ""):
    c = files.run_python_file(Path(__file__).with_name("sft_full.py"), "get_config", model, field="--config")
    c.workdir = f"runs/{Path(__file__).stem}{'_' + model if model else ''}"
    c.model.update(lora_rank=16, lora_alpha=32.0)
    c.optim.update(lr=1e-3 if not model else 2e-4)
    return c
