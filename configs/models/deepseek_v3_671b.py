r"""DeepSeek-V3 (`deepseek-ai/DeepSeek-V3-Base`, model_type deepseek_v3): d_model 7168, 61 layers (the first 3
dense, SwiGLU width 18432), 128 heads of multi-head latent attention (q latent 1536, kv latent 512, 128 + 64 rotated
query/key dims, values of 128; YaRN x40 from 4096 positions with mscale 1), 256 routed experts of width 2048 in 8
groups (4 chosen) plus 1 shared, top-8 sigmoid routing with the correction bias and gates scaled by 2.5, vocab
129280 untied; 671B parameters, 37B active per token. Its multi-token prediction module (one more MoE layer, 11.6B
without its copies of the embedding and head) trains beside it with the paper's final weight, 0.1.

The weights come from the Hugging Face checkpoint (bf16; DeepSeek's fp8 release needs converting first):
`--config.model.init_from=DIR`, with data prepared by its tokenizer. Continued pretraining on GPUs: 1024 x 4096
tokens a step (4M) in 2 microbatches, experts over `mesh.expert` (8 here; 64 at 512 devices), FSDP over the rest,
all-to-all dispatch, the correction bias balanced at the paper's rate (0.001) and no auxiliary loss. What the
planner fits is in docs/models.md:

    jaxtrain plan --config configs/models/deepseek_v3_671b.py --devices 512 --backend gpu --device_kind H100 \
        --compiler gpu --config.mesh.expert=64
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/deepseek_v3_671b"
    c.model.update(family="deepseek_v3", vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                   head_dim=64, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128,
                   rope_interleave=True, rope_theta=10000.0, rope_scaling="yarn", rope_factor=40.0,
                   rope_original_max_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0,
                   rope_mscale_all_dim=1.0, norm_eps=1e-6, tie_embeddings=False, first_dense_layers=3,
                   dense_d_ff=18432, d_ff=2048, n_experts=256, n_shared_experts=1, moe_top_k=8, moe_score="sigmoid",
                   moe_score_bias=True, moe_groups=8, moe_topk_groups=4, moe_routed_scale=2.5, moe_renormalize=True,
                   moe_routing="dropless", moe_dispatch="all_to_all", moe_bias_rate=0.001, moe_aux_weight=0.0,
                   mtp_layers=1, mtp_loss_weight=0.1,
                   remat="dots_with_no_batch_dims_saveable", loss_chunk_tokens=4096)
    c.train.update(batch_size=1024, seq_len=4096, microbatches=2, steps=5000)
    c.mesh.update(data=1, fsdp=-1, expert=8, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=129280)
    c.sample.update(max_new_tokens=0)
    return c
