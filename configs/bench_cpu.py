"""Reference model for CPU benchmarks (scripts/bench_step.py): Llama-style, vocab 32000, d_model 256,
4 layers, 4 heads (4 KV heads) of 64, d_ff 1024, untied embeddings, batch 4 x 512 tokens."""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/bench_cpu"
    c.model.update(vocab_size=32000, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=1024,
                   tie_embeddings=False)
    # How the step runs, not what the model is (the PyTorch twin ignores these): the 4 layers unrolled instead of a
    # scan, and causal attention in query blocks of 128 that skip the masked upper triangle (BUILD.md, performance).
    c.model.update(scan_unroll=4, attention_block=128)
    c.train.update(batch_size=4, seq_len=512, steps=100)
    c.optim.update(lr=1e-3, warmup_steps=10)
    return c
