"""~1B-parameter Llama-style model for one H100/H200 (`scripts/bench_step.py --config configs/bench_gpu.py`):
the architecture of configs/plan_1b.py (d_model 2048, 18 layers, 16 heads / 8 KV heads of 128, d_ff 5632,
vocab 32000 untied; 0.98B parameters), bf16 compute (`auto` on GPU) with f32 master weights and Adam moments,
8 x 2048 tokens a step. Attention is the library call with XLA's kernel (jax's default on GPUs too; cuDNN's flash
kernel is `--config.model.attention_impl=cudnn`, scripts/gpu_bench.sh's `cudnn` variant); the fused loss runs 4096
tokens per chunk; remat keeps the matmul outputs. The layers run in a scan, as every earlier figure did;
`--config.model.scan_unroll=18` (no layer loop) is 7% faster in bf16 and 12% in fp8 on one H200. Planned with
`jaxtrain plan --config configs/bench_gpu.py --devices 1 --backend gpu`.
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/bench_gpu"
    c.model.update(vocab_size=32000, d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=5632,
                   tie_embeddings=False, remat="dots_with_no_batch_dims_saveable", rope_theta=500000.0,
                   attention_block=0, loss_chunk_tokens=4096)
    c.train.update(batch_size=8, seq_len=2048, steps=100)
    c.mesh.update(data=-1, fsdp=1, tensor=1)
    c.optim.update(lr=3e-4, warmup_steps=10, weight_decay=0.1)
    c.data.update(vocab_size=32000)
    c.sample.update(max_new_tokens=0)
    return c
