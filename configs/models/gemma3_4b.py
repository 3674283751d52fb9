"""Gemma 3 4B, its text model (`google/gemma-3-4b-pt`): d_model 2560, 34 layers, 8 heads / 4 KV heads of 256 with
q/k RMSNorm, GeGLU d_ff 10240, vocab 262208 tied, Gemma's norms and embedding scale, logits scaled by 256^-0.5;
1024-token sliding windows with a global layer every 6th (RoPE theta 1e6, linear scaling by 8, on the global
layers; 10000 on the sliding ones); 3.88B parameters.

The weights come from a Hugging Face `gemma3_text` checkpoint: `--config.model.init_from=DIR` (its config.json must
match these fields; `jaxtrain hf overrides DIR` prints them). The published 4B checkpoint is multimodal
(model_type `gemma3`), which jaxtrain refuses: DIR must hold its text model alone (the text_config as a
`gemma3_text` config.json and the language model's tensors as `model.*`). Data prepared by its tokenizer
(`jaxtrain prepare --tokenizer DIR ...`, then `--config.data.dir`). Continued pretraining / fine-tuning on GPUs:
256 x 4096 tokens a step (1M) in 16 microbatches, FSDP over all devices, remat keeps the matmul outputs.

    jaxtrain plan --config configs/models/gemma3_4b.py --devices 8 --backend gpu --device_kind H100
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/gemma3_4b"
    c.model.update(family="gemma3", vocab_size=262208, d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4,
                   head_dim=256, d_ff=10240, tie_embeddings=True, mlp_activation="gelu_tanh", norm_offset=True,
                   post_norms=True, embed_scale=True, qk_norm=True, attn_scale=256**-0.5, sliding_window=1024,
                   global_every=6, rope_theta=1000000.0, rope_scaling="linear", rope_factor=8.0,
                   rope_local_theta=10000.0, norm_eps=1e-6, remat="dots_with_no_batch_dims_saveable",
                   loss_chunk_tokens=4096)
    c.train.update(batch_size=256, seq_len=4096, microbatches=16, steps=5000)
    c.mesh.update(data=1, fsdp=-1, tensor=1, rules="fsdp")
    c.optim.update(lr=2e-5, warmup_steps=100, weight_decay=0.1)
    c.data.update(vocab_size=262208)
    c.sample.update(max_new_tokens=0)
    return c
