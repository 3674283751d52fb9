"""Qwen3 8B at 128K tokens (131,072) with YaRN: configs/models/qwen3_8b.py with RoPE stretched 4x over its
native 32,768 positions (Qwen's recommended `rope_scaling` {"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 32768}), ring attention over `mesh.sequence` (zigzag-balanced) and the weights,
gradients and Adam state split over all devices (ZeRO-3 over fsdp x sequence). 8 sequences a step, one per
microbatch, full remat.

    jaxtrain plan --config configs/models/qwen3_8b_128k.py --devices 8 --backend gpu --device_kind H100

docs/parallelism.md has the planner's table for 8-64 H100s.
"""

from pathlib import Path

from jaxtrain import files


def get_config():
    c = files.run_python_file(Path(__file__).with_name("qwen3_8b.py"), "get_config", field="--config")
    c.workdir = "runs/qwen3_8b_128k"
    c.model.update(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=32768, context_parallel="ring",
                   context_balance=True, remat="full")
    c.train.update(batch_size=8, seq_len=131072, microbatches=8)
    c.mesh.update(data=1, fsdp=-1, sequence=8, tensor=1, rules="fsdp_seq")
    return c
