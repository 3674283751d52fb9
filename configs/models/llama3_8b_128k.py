"""Llama 3.1 8B at its full 128K context (131,072 tokens): configs/models/llama3_8b.py with ring attention over
`mesh.sequence` (zigzag-balanced) and the weights, gradients and Adam state split over all devices (ZeRO-3 over
fsdp x sequence). 8 sequences a step (1M tokens), one per microbatch; full remat, since a device's 16K-token
share of a 128K sequence holds 32 layers of activations otherwise.

    jaxtrain plan --config configs/models/llama3_8b_128k.py --devices 8 --backend gpu --device_kind H100

On more devices, fsdp takes the rest (`--devices 16`: fsdp 2 x sequence 8). docs/parallelism.md has the
planner's table for 8-64 H100s.
"""

from pathlib import Path

from jaxtrain import files


def get_config():
    c = files.run_python_file(Path(__file__).with_name("llama3_8b.py"), "get_config", field="--config")
    c.workdir = "runs/llama3_8b_128k"
    c.model.update(context_parallel="ring", context_balance=True, remat="full")
    c.train.update(batch_size=8, seq_len=131072, microbatches=8)
    c.mesh.update(data=1, fsdp=-1, sequence=8, tensor=1, rules="fsdp_seq")
    return c
