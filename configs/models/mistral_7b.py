"""Mistral 7B v0.3 (`mistralai/Mistral-7B-v0.3`): d_model 4096, 32 layers, 32 heads / 8 KV heads of 128,
d_ff 14336, vocab 32768 untied, RoPE theta 1e6, no sliding window (v0.1's was 4096: `model.sliding_window`);
7.25B parameters.

The weights come from the Hugging Face checkpoint: `--config.model.init_from=DIR` (its config.json must match
these fields; `jaxtrain hf overrides DIR` prints them), with data prepared by its tokenizer
(`jaxtrain prepare --tokenizer DIR ...`, then `--config.data.dir`). Continued pretraining / fine-tuning on GPUs:
256 x 4096 tokens a step (1M) in 32 microbatches (one sequence per device each on 8 GPUs), FSDP over all
devices, remat keeps the matmul outputs.

    jaxtrain plan --config configs/models/mistral_7b.py --devices 8 --backend gpu --device_kind H100
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/mistral_7b"
    c.model.update(family="mistral", vocab_size=32768, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                   head_dim=128, d_ff=14336, tie_embeddings=False, rope_theta=1000000.0, norm_eps=1e-5,
                   remat="dots_with_no_batch_dims_saveable", loss_chunk_tokens=4096)
    c.train.update(batch_size=256, seq_len=4096, microbatches=32, steps=5000)
    c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=32768)
    c.sample.update(max_new_tokens=0)
    return c
