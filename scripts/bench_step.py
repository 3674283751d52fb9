"""Train-step throughput and MFU against the matmul peak measured in the same run.

    python scripts/bench_step.py [--config configs/bench_cpu.py] [--steps 20] [--config.model.remat=full]

The batch is synthetic (uniform random tokens, one document per row) so only the step is timed; the data
pipeline has its own benchmark. Ends with one JSON line, e.g.
{"tokens_per_sec": ..., "mfu": ..., "peak_gflops": ..., "step_ms": ..., ...}
"""

import json
import sys
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

def synthetic_batch(cfg) -> dict:
    """Uniform random tokens (seed 0), one document per row: only the step is timed."""
    b, s = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(2, cfg.data.vocab_size, (b, s), dtype=np.int32),
            "segment_ids": np.ones((b, s), np.int32),
            "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()}


def time_train_step(cfg, steps: int):
    """(median step seconds, seconds to a warm step, trainer, last metrics): `steps` timed steps on a
    synthetic batch, after compiling and one warm-up step."""
    import jax

    from jaxtrain import config as config_lib, host_memory, train

    host_memory.keep_freed_memory()  # as train.run does (CPU runs); a no-op once jax has started
    t = time.perf_counter()
    facts = config_lib.validate(cfg, jax.device_count(), jax.process_count())
    trainer = train.build_trainer(cfg, facts["mesh_shape"], facts["rules"])
    state = trainer.init()
    batch = train.global_batch(synthetic_batch(cfg), trainer.batch_sharding)
    for _ in range(2):  # compile + one warm step
        state, m = trainer.train_step(state, batch)
    jax.block_until_ready(m)
    startup_s = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = trainer.train_step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), startup_s, trainer, m


def main(argv):
    del argv
    import jax

    from jaxtrain import host_memory, metrics
    from jaxtrain.models import transformer

    cfg = _CONFIG.value
    b, s = cfg.train.batch_size, cfg.train.seq_len
    step_s, startup_s, trainer, m = time_train_step(cfg, _STEPS.value)

    # Peak measured after the steps, on the same (now warm) machine.
    peak = metrics.measure_matmul_flops()
    flops_per_token = transformer.train_flops_per_token(trainer.model_cfg, s)
    tok_s = b * s / step_s
    result = {"config": cfg.workdir, "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
              "dtype": trainer.model_cfg.dtype, "remat": cfg.model.remat, "step_ms": 1e3 * step_s,
              "tokens_per_sec": tok_s, "model_gflops_per_sec": tok_s * flops_per_token / 1e9,
              "peak_gflops": peak / 1e9, "mfu": tok_s * flops_per_token / peak,
              "startup_to_warm_s": startup_s, "loss": float(m["loss"]), "host_memory": host_memory.status}
    print(f"step {1e3 * step_s:.1f} ms (median of {_STEPS.value}) | {tok_s:,.0f} tok/s | "
          f"{result['model_gflops_per_sec']:.1f} model GFLOP/s | peak {peak / 1e9:.0f} GFLOP/s | "
          f"MFU {100 * result['mfu']:.1f}% | host memory: {host_memory.status}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_cpu.py", "Model/batch config.",
                                              lock_config=True)
    _STEPS = flags.DEFINE_integer("steps", 20, "Timed steps (after 2 warm-up steps).")
    app.run(main)
