r"""Moonlight-16B-A3B (`moonshotai/Moonlight-16B-A3B`, model_type deepseek_v3): DeepSeek-V3's architecture at
d_model 2048, 27 layers (the first dense, SwiGLU width 11264), 16 heads of multi-head latent attention (kv latent
512, no q latent, 128 + 64 rotated query/key dims, values of 128), 64 routed experts of width 1408 plus 2 shared,
top-6 sigmoid routing with the correction bias and gates scaled by 2.446, vocab 163840 untied, RoPE theta 5e4;
16B parameters, 3B active per token.

The weights come from the Hugging Face checkpoint: `--config.model.init_from=DIR` (its config.json must match
these fields; `jaxtrain hf overrides DIR` prints them), with data prepared by its tokenizer
(`jaxtrain prepare --tokenizer DIR ...`, then `--config.data.dir`). Continued pretraining / fine-tuning on GPUs:
256 x 4096 tokens a step (1M), FSDP over the devices, experts over `mesh.expert`, all-to-all dispatch, the
correction bias balanced at DeepSeek-V3's rate. What the planner fits is in docs/models.md:

    jaxtrain plan --config configs/models/moonlight_16b_a3b.py --devices 16 --backend gpu --device_kind H100 \
        --compiler gpu
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/moonlight_16b_a3b"
    c.model.update(family="deepseek_v3", vocab_size=163840, d_model=2048, n_layers=27, n_heads=16, n_kv_heads=16,
                   head_dim=64, kv_lora_rank=512, q_lora_rank=0, qk_nope_head_dim=128, v_head_dim=128,
                   rope_interleave=True, rope_theta=50000.0, norm_eps=1e-5, tie_embeddings=False,
                   first_dense_layers=1, dense_d_ff=11264, d_ff=1408, n_experts=64, n_shared_experts=2,
                   moe_top_k=6, moe_score="sigmoid", moe_score_bias=True, moe_groups=1, moe_topk_groups=1,
                   moe_routed_scale=2.446, moe_renormalize=True, moe_routing="dropless", moe_dispatch="all_to_all",
                   moe_bias_rate=0.001, moe_aux_weight=0.0, remat="dots_with_no_batch_dims_saveable",
                   loss_chunk_tokens=4096)
    c.train.update(batch_size=256, seq_len=4096, microbatches=16, steps=5000)
    c.mesh.update(data=1, fsdp=-1, expert=8, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=163840)
    c.sample.update(max_new_tokens=0)
    return c
