r"""Qwen3-30B-A3B (`Qwen/Qwen3-30B-A3B-Base`, model_type qwen3_moe): d_model 2048, 48 layers, 32 heads / 4 KV heads
of 128 with q/k RMSNorm, 128 SwiGLU experts of width 768 per layer, top-8 dropless routing with renormalised gates
(norm_topk_prob), vocab 151936 untied, RoPE theta 1e6; 30.5B parameters, 3.3B active per token.

The weights come from the Hugging Face checkpoint: `--config.model.init_from=DIR` (its config.json must match
these fields; `jaxtrain hf overrides DIR` prints them), with data prepared by its tokenizer
(`jaxtrain prepare --tokenizer DIR ...`, then `--config.data.dir`). Continued pretraining / fine-tuning on GPUs:
256 x 4096 tokens a step (1M) in 32 microbatches, FSDP over all devices, remat keeps the matmul outputs.

It does not fit 8 H100s: f32 weights and Adam's moments are 43 GiB a device, and the compiled step needs more than
the rest. Expert parallelism is `--config.mesh.expert=E` (E divides the 128 experts; fsdp=-1 takes the rest of the
devices): each device then holds 1/E of the experts and the batch splits over fsdp x expert; the microbatch must
still split over all devices (train.microbatches <= 256 / devices). What the planner fits (docs/models.md), 16
H100s with capacity routing:

    jaxtrain plan --config configs/models/qwen3_moe_30b_a3b.py --devices 16 --backend gpu --device_kind H100 \
        --compiler gpu --config.train.microbatches=16 --config.model.moe_routing=capacity

and on 8 (does not fit):

    jaxtrain plan --config configs/models/qwen3_moe_30b_a3b.py --devices 8 --backend gpu --device_kind H100
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/qwen3_moe_30b_a3b"
    c.model.update(family="qwen3_moe", qk_norm=True, vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                   n_kv_heads=4, head_dim=128, d_ff=768, n_experts=128, moe_top_k=8, moe_routing="dropless",
                   moe_renormalize=True, tie_embeddings=False, rope_theta=1000000.0, norm_eps=1e-6,
                   remat="dots_with_no_batch_dims_saveable", loss_chunk_tokens=4096)
    c.train.update(batch_size=256, seq_len=4096, microbatches=32, steps=5000)
    c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=151936)
    c.sample.update(max_new_tokens=0)
    return c
