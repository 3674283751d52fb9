"""Supervised fine-tuning of every weight, on chat data (docs/fine-tuning.md).

`--config configs/sft_full.py`: the CPU-sized default model (what `make train` trains), e.g. over its
Hugging Face export; `--config configs/sft_full.py:llama3_8b` (or `:qwen3_8b`, any of configs/models/) the same
settings for that model on GPUs. Either way set the weights and the data:

    python -m jaxtrain.main --config configs/sft_full.py --config.model.init_from=HF_DIR \\
        --config.data.dir=DATA_DIR        # from `jaxtrain prepare --chat --tokenizer HF_DIR ...`
    jaxtrain plan --config configs/sft_full.py:llama3_8b --devices 8 --backend gpu --device_kind H100
"""

from pathlib import Path

from jaxtrain import files
from jaxtrain.config import base_config


def get_config(model: str = ""):
    if not model:  # CPU: the default model, 256-token rows of whole conversations
        c = base_config()
        c.train.update(steps=200, batch_size=16, seq_len=256)
        c.optim.update(lr=1e-4, warmup_steps=10)
        c.eval.update(every_steps=50, batches=4)
    else:  # GPUs: 64 sequences of 4096 tokens a step, one per device per microbatch on 8 devices
        c = files.run_python_file(Path(__file__).parent / "models" / f"{model}.py", "get_config", field="--config")
        c.train.update(steps=2000, batch_size=64, seq_len=4096, microbatches=8)
        c.optim.update(lr=1e-5, warmup_steps=50, weight_decay=0.0)
        c.eval.update(every_steps=200, batches=8)
    c.workdir = f"runs/{Path(__file__).stem}{'_' + model if model else ''}"
    c.checkpoint.update(every_steps=c.eval.every_steps)
    c.sample.update(max_new_tokens=0)
    return c
