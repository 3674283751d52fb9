r"""Mixtral 8x7B (`mistralai/Mixtral-8x7B-v0.1`): Mistral 7B's attention (d_model 4096, 32 layers, 32 heads / 8 KV
heads of 128, RoPE theta 1e6, no sliding window), 8 SwiGLU experts of width 14336 per layer, top-2 dropless routing
with renormalised gates, vocab 32000 untied; 46.7B parameters, 12.9B active per token.

The weights come from the Hugging Face checkpoint: `--config.model.init_from=DIR` (its config.json must match
these fields; `jaxtrain hf overrides DIR` prints them), with data prepared by its tokenizer
(`jaxtrain prepare --tokenizer DIR ...`, then `--config.data.dir`). Continued pretraining / fine-tuning on GPUs:
256 x 4096 tokens a step (1M) in 32 microbatches, FSDP over all devices, remat keeps the matmul outputs.

It does not fit 8 H100s: f32 weights and Adam's moments alone are 65 GiB a device. Expert parallelism is
`--config.mesh.expert=E` (E divides the 8 experts; fsdp=-1 takes the rest of the devices): each device then holds
1/E of the experts and the batch splits over fsdp x expert; the microbatch must still split over all devices
(train.microbatches <= 256 / devices). What the planner fits (docs/models.md), 32 H100s with capacity routing:

    jaxtrain plan --config configs/models/mixtral_8x7b.py --devices 32 --backend gpu --device_kind H100 \
        --compiler gpu --config.mesh.expert=8 --config.train.microbatches=8 --config.model.moe_routing=capacity

and on 8 (does not fit):

    jaxtrain plan --config configs/models/mixtral_8x7b.py --devices 8 --backend gpu --device_kind H100
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/mixtral_8x7b"
    c.model.update(family="mixtral", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                   head_dim=128, d_ff=14336, n_experts=8, moe_top_k=2, moe_routing="dropless", moe_renormalize=True,
                   tie_embeddings=False, rope_theta=1000000.0, norm_eps=1e-5,
                   remat="dots_with_no_batch_dims_saveable", loss_chunk_tokens=4096)
    c.train.update(batch_size=256, seq_len=4096, microbatches=32, steps=5000)
    c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=32000)
    c.sample.update(max_new_tokens=0)
    return c
