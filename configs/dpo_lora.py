"""DPO with LoRA adapters on preference pairs, after SFT: sft_lora.py's settings with train.objective=dpo. The
reference is the starting model (the base, adapters off), so the weights are not held twice
(docs/fine-tuning.md#dpo). Rows hold whole pairs: twice sft's sequence length on the CPU.

    python -m jaxtrain.main --config configs/dpo_lora.py --config.model.init_from=SFT_HF_DIR \\
        --config.data.dir=PAIRS_DIR       # from `jaxtrain prepare --preference --tokenizer SFT_HF_DIR ...`
"""

from pathlib import Path

from jaxtrain import files


def get_config(model: str = ""):
    c = files.run_python_file(Path(__file__).with_name("sft_lora.py"), "get_config", model, field="--config")
    c.workdir = f"runs/{Path(__file__).stem}{'_' + model if model else ''}"
    c.train.update(objective="dpo", steps=100 if not model else 1000)
    if not model:
        c.train.update(seq_len=512, batch_size=8)
    c.dpo.update(beta=0.1)
    c.optim.update(lr=5e-4 if not model else 5e-5)
    return c
