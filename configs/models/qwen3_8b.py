"""Qwen3 8B (`Qwen/Qwen3-8B-Base`): d_model 4096, 36 layers, 32 heads / 8 KV heads of 128 with q/k RMSNorm,
d_ff 12288, vocab 151936 untied, RoPE theta 1e6; 8.19B parameters.

The weights come from the Hugging Face checkpoint: `--config.model.init_from=DIR` (its config.json must match
these fields; `jaxtrain hf overrides DIR` prints them), with data prepared by its tokenizer
(`jaxtrain prepare --tokenizer DIR ...`, then `--config.data.dir`). Continued pretraining / fine-tuning on GPUs:
256 x 4096 tokens a step (1M) in 32 microbatches (one sequence per device each on 8 GPUs), FSDP over all
devices, remat keeps the matmul outputs. For 8192-token sequences at the same 1M tokens:
`--config.train.seq_len=8192 --config.train.batch_size=128 --config.train.microbatches=16
--config.model.attention_impl=cudnn` (with XLA's attention that step is over an H100's memory; docs/models.md).

    jaxtrain plan --config configs/models/qwen3_8b.py --devices 8 --backend gpu --device_kind H100
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/qwen3_8b"
    c.model.update(family="qwen3", qk_norm=True, vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
                   n_kv_heads=8, head_dim=128, d_ff=12288, tie_embeddings=False, rope_theta=1000000.0, norm_eps=1e-6,
                   remat="dots_with_no_batch_dims_saveable", loss_chunk_tokens=4096)
    c.train.update(batch_size=256, seq_len=4096, microbatches=32, steps=5000)
    c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=151936)
    c.sample.update(max_new_tokens=0)
    return c
