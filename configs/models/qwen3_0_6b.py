"""Qwen3 0.6B (`Qwen/Qwen3-0.6B-Base`): d_model 1024, 28 layers, 16 heads / 8 KV heads of 128 with q/k RMSNorm,
d_ff 3072, vocab 151936 tied, RoPE theta 1e6; 0.60B parameters.

The weights come from the Hugging Face checkpoint: `--config.model.init_from=DIR` (its config.json must match
these fields; `jaxtrain hf overrides DIR` prints them), with data prepared by its tokenizer
(`jaxtrain prepare --tokenizer DIR ...`, then `--config.data.dir`). Continued pretraining / fine-tuning on GPUs:
256 x 4096 tokens a step (1M) in 8 microbatches, FSDP over all devices, remat keeps the matmul outputs.

    jaxtrain plan --config configs/models/qwen3_0_6b.py --devices 8 --backend gpu --device_kind H100
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/qwen3_0_6b"
    c.model.update(family="qwen3", qk_norm=True, vocab_size=151936, d_model=1024, n_layers=28, n_heads=16,
                   n_kv_heads=8, head_dim=128, d_ff=3072, tie_embeddings=True, rope_theta=1000000.0, norm_eps=1e-6,
                   remat="dots_with_no_batch_dims_saveable", loss_chunk_tokens=4096)
    c.train.update(batch_size=256, seq_len=4096, microbatches=8, steps=5000)
    c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=151936)
    c.sample.update(max_new_tokens=0)
    return c
