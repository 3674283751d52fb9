"""Gemma 3 1B (`google/gemma-3-1b-pt`, model_type gemma3_text): d_model 1152, 26 layers, 4 heads / 1 KV head of
256 with q/k RMSNorm, GeGLU d_ff 6912, vocab 262144 tied, (1 + w) RMSNorms before and after each sublayer,
embeddings times sqrt(d_model), logits scaled by 256^-0.5; 512-token sliding windows with a global layer every 6th
(RoPE theta 1e6 on the global layers, 10000 on the sliding ones); 1.00B parameters.

The weights come from the Hugging Face checkpoint: `--config.model.init_from=DIR` (its config.json must match
these fields; `jaxtrain hf overrides DIR` prints them), with data prepared by its tokenizer
(`jaxtrain prepare --tokenizer DIR ...`, then `--config.data.dir`). Continued pretraining / fine-tuning on GPUs:
256 x 4096 tokens a step (1M) in 8 microbatches, FSDP over all devices, remat keeps the matmul outputs.

    jaxtrain plan --config configs/models/gemma3_1b.py --devices 8 --backend gpu --device_kind H100
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/gemma3_1b"
    c.model.update(family="gemma3", vocab_size=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1,
                   head_dim=256, d_ff=6912, tie_embeddings=True, mlp_activation="gelu_tanh", norm_offset=True,
                   post_norms=True, embed_scale=True, qk_norm=True, attn_scale=256**-0.5, sliding_window=512,
                   global_every=6, rope_theta=1000000.0, rope_local_theta=10000.0, norm_eps=1e-6,
                   remat="dots_with_no_batch_dims_saveable", loss_chunk_tokens=4096)
    c.train.update(batch_size=256, seq_len=4096, microbatches=8, steps=5000)
    c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=262144)
    c.sample.update(max_new_tokens=0)
    return c
