"""A ~1B-parameter Llama-style model for planning GPU/TPU runs (`jaxtrain plan`), not for CPU training:
d_model 2048, 18 layers, 16 heads (8 KV heads) of 128, d_ff 5632, vocab 32000 untied (0.98B parameters);
FSDP over all devices, 256 x 2048 tokens per step in 4 microbatches, remat keeps matmul outputs.

    jaxtrain plan --config configs/plan_1b.py --devices 8 --backend gpu --device_kind H100
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/plan_1b"
    c.model.update(vocab_size=32000, d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=5632,
                   tie_embeddings=False, remat="dots_with_no_batch_dims_saveable", rope_theta=500000.0)
    c.train.update(batch_size=256, seq_len=2048, microbatches=4, steps=10000)
    c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp")
    c.optim.update(lr=3e-4, warmup_steps=500, weight_decay=0.1)
    c.data.update(vocab_size=32000)
    c.sample.update(max_new_tokens=0)
    return c
