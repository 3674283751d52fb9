"""Train-step throughput and MFU.

    python scripts/bench_step.py [--config configs/bench_cpu.py] [--steps 20] [--config.model.remat=full]
    python scripts/bench_step.py --config configs/bench_gpu.py --steps 10      # one H100/H200, ~1B params, bf16
    python scripts/bench_step.py --compare model.quant=none,fp8,int8 --compare optim.name=adamw,muon,adafactor,lion,sgd

MFU is model FLOP/s over a peak: on CPU the matmul peak in the compute dtype measured in the same run (no vendor figure
applies); on GPU/TPU the vendor's dense peak (`metrics.PEAK_FLOPS`, e.g. H100 989 TFLOP/s bf16, as MaxText and
torchtitan quote MFU), with `mfu_vs_measured` against an 8192^2 matmul in the model's compute dtype measured in
the same run beside it. The batch is synthetic (uniform random tokens, one document per row) so only the step is
timed; the data pipeline has its own benchmark. Ends with one JSON line, e.g.
{"tokens_per_sec": ..., "mfu": ..., "peak_gflops": ..., "step_ms": ..., ...}
"""

import json
import sys
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags
from jaxtrain import trainer as trainer_lib

def synthetic_batch(cfg) -> dict:
    """Uniform random tokens (seed 0), one document per row: only the step is timed."""
    b, s = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(2, cfg.data.vocab_size, (b, s), dtype=np.int32),
            "segment_ids": np.ones((b, s), np.int32),
            "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()}


def warm_trainer(cfg):
    """(trainer, state, batch, last metrics, seconds to a warm step): the train step on a synthetic batch,
    compiled and run once warm."""
    import jax

    from jaxtrain import compat, config as config_lib

    compat.install()  # as train.run does; the CPU malloc settings only apply before jax starts
    t = time.perf_counter()
    facts = config_lib.validate(cfg, jax.device_count(), jax.process_count())
    trainer = trainer_lib.build_trainer(cfg, facts)
    state = trainer.init()
    batch = trainer_lib.global_batch(synthetic_batch(cfg), trainer.batch_sharding)
    for _ in range(2):  # compile + one warm step
        state, m = trainer.train_step(state, batch)
    jax.block_until_ready(m)
    return trainer, state, batch, m, time.perf_counter() - t


def time_train_step(cfg, steps: int):
    """(median step seconds, seconds to a warm step, trainer, last metrics): `steps` timed steps on a
    synthetic batch, after compiling and one warm-up step."""
    import jax

    trainer, state, batch, m, startup_s = warm_trainer(cfg)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = trainer.train_step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), startup_s, trainer, m


def compare(cfg, specs, steps: int) -> dict:
    """{field: {value: tokens/s}} for each `FIELD=v1,v2,...` of `specs`, every variant timed in this process (one
    after another, so run them on an otherwise idle machine), with its ratio to the field's first value."""
    import jax

    from jaxtrain import config as config_lib

    out = {}
    for spec in specs:
        field, _, values = spec.partition("=")
        group, key = field.split(".")
        out[field] = {}
        for value in values.split(","):
            c = cfg.copy_and_resolve_references()
            with c.unlocked():
                c[group][key] = type(c[group][key])(value) if not isinstance(c[group][key], str) else value
            config_lib.validate(c, jax.device_count())
            step_s = time_train_step(c, steps)[0]
            out[field][value] = tok_s = c.train.batch_size * c.train.seq_len / step_s
            first = next(iter(out[field].values()))
            print(f"{field}={value}: step {1e3 * step_s:.1f} ms | {tok_s:,.0f} tok/s | {tok_s / first:.3f}x "
                  f"{field}={values.split(',')[0]}", file=sys.stderr)
    return out


def main(argv):
    del argv
    import jax

    if _COMPARE.value:
        print(json.dumps({"config": _CONFIG.value.workdir, "compare": compare(_CONFIG.value, _COMPARE.value,
                                                                               _STEPS.value)}))
        return

    from jaxtrain.compat import glibc_malloc
    from jaxtrain.observe import metrics
    from jaxtrain.models import transformer

    cfg = _CONFIG.value
    b, s = cfg.train.batch_size, cfg.train.seq_len
    step_s, startup_s, trainer, m = time_train_step(cfg, _STEPS.value)
    # The allocator's high-water mark over init, compile and the steps (None on CPU, whose allocator keeps none).
    mem_peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")

    # Peaks measured after the steps, on the same (now warm) machine.
    on_cpu = jax.devices()[0].platform == "cpu"  # CPU devices (fake ones too) share the cores one matmul uses
    dtype = trainer.model_cfg.dtype
    measured = (metrics.measure_matmul_flops(dtype=dtype) if on_cpu else
                jax.device_count() * metrics.measure_matmul_flops(8192, dtype=dtype))
    peak, peak_source = (measured, f"measured {dtype} matmul") if on_cpu else metrics.peak_flops()
    flops_per_token = transformer.train_flops_per_token(trainer.model_cfg, s)
    tok_s = b * s / step_s
    model_flops = tok_s * flops_per_token
    result = {"config": cfg.workdir, "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
              "dtype": trainer.model_cfg.dtype, "remat": cfg.model.remat, "step_ms": 1e3 * step_s,
              "tokens_per_sec": tok_s, "model_gflops_per_sec": model_flops / 1e9,
              "peak_gflops": peak / 1e9, "peak_source": peak_source, "mfu": model_flops / peak,
              "measured_matmul_gflops": measured / 1e9, "mfu_vs_measured": model_flops / measured,
              "startup_to_warm_s": startup_s, "loss": float(m["loss"]), "host_memory": glibc_malloc.status,
              "peak_bytes_in_use": mem_peak}
    print(f"step {1e3 * step_s:.1f} ms (median of {_STEPS.value}) | {tok_s:,.0f} tok/s | "
          f"{model_flops / 1e9:,.1f} model GFLOP/s | peak {peak / 1e9:,.0f} GFLOP/s ({peak_source}) | "
          f"MFU {100 * result['mfu']:.1f}%" + ("" if on_cpu else f" ({100 * result['mfu_vs_measured']:.1f}% of a "
                                               f"measured {trainer.model_cfg.dtype} matmul)")
          + ("" if mem_peak is None else f" | memory peak {mem_peak / 2**30:.1f} GiB")
          + f" | host memory: {glibc_malloc.status}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_cpu.py", "Model/batch config.",
                                              lock_config=True)
    _STEPS = flags.DEFINE_integer("steps", 20, "Timed steps (after 2 warm-up steps).")
    _COMPARE = flags.DEFINE_multi_string("compare", [], "FIELD=v1,v2,...: tokens/s of each value of a config field "
                                         "instead of the one run, e.g. model.quant=none,fp8,int8 (repeatable).")
    app.run(main)
