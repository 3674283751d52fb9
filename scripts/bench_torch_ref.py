"""jaxtrain's train step against a PyTorch reference of the identical model and optimizer, in one run.

    python scripts/bench_torch_ref.py [--config configs/bench_cpu.py] [--steps 10] [--config.model.remat=full]
    python scripts/bench_torch_ref.py --config.model.dtype=bfloat16   # both in bf16: torch under torch.autocast

Times jaxtrain's jitted step, its PyTorch twin (scripts/torch_llama.py) in eager mode and under torch.compile
(default mode, a fresh inductor cache, its compile time reported apart; if it fails the run goes on with eager) on
scripts/bench_step.py's synthetic batch, all from jaxtrain's initial params. After 2 warm-up steps each, --steps
rounds time one step of each in turn and each figure is the median over the rounds: interleaved, so a shared
machine that speeds up or slows down moves all three alike; the per-round ratio's spread says how steady it was.
The first-step losses are printed side by side. torch uses os.cpu_count() threads; jaxtrain's host malloc settings
(jaxtrain/compat/glibc_malloc.py) apply to the whole process, torch included, and the header says which were used.
Prints a table (step ms, tokens/s, jaxtrain / max(eager, compile) against the 1.2x target) on stderr, then one
JSON line on stdout, e.g. {"jax_tokens_per_sec": ..., "torch_eager_tokens_per_sec": ..., "ratio": ..., ...}
"""

import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import numpy as np
from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402  (scripts/ is not a package)
from jaxtrain.compat import glibc_malloc  # noqa: E402
from jaxtrain import trainer as trainer_lib

TARGET = 1.2


def warm_torch(trainer, batch) -> dict:
    """The first step (it compiles under torch.compile), its loss and duration, then one warm-up step."""
    t = time.perf_counter()
    first = trainer.train_step(batch)
    first_s = time.perf_counter() - t
    trainer.train_step(batch)
    return {"first_step_s": first_s, "first_loss": float(first["loss"])}


def interleaved(steps_by_name: dict, rounds: int) -> dict:
    """{name: [seconds per round]}: each round times one step of every implementation in turn, so a machine that
    speeds up or slows down during the run (shared CPUs do) moves all of them alike and leaves the ratio."""
    times = {name: [] for name in steps_by_name}
    for _ in range(rounds):
        for name, step in steps_by_name.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    return times


def main(argv):
    del argv
    # A fresh inductor cache, so the reported compile time is a cold compile, not a hit on a previous run's cache.
    cache_dir = tempfile.mkdtemp(prefix="bench_torch_ref_inductor.")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        _main()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def _main():
    import jax
    import torch

    import torch_llama

    cfg = _CONFIG.value
    steps = _STEPS.value
    b, s = cfg.train.batch_size, cfg.train.seq_len
    tokens = b * s
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    # --- jaxtrain ------------------------------------------------------------------------------------------
    _, jax_startup_s, trainer, _ = bench_step.time_train_step(cfg, 1)
    model_cfg = trainer.model_cfg
    # The same init (the seed's) once more: its params seed both torch models, and one step on it gives
    # jaxtrain's first-step loss (the step is already compiled).
    state = trainer.init()
    params = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(state["params"]))  # before donation
    batch_np = bench_step.synthetic_batch(cfg)
    jax_batch = trainer_lib.global_batch(batch_np, trainer.batch_sharding)
    state, m0 = trainer.train_step(state, jax_batch)
    jax_loss0 = float(m0["loss"])
    n_params = sum(np.size(x) for x in jax.tree.leaves(params))
    batch = torch_llama.prepare_batch(batch_np)

    def jax_step():
        nonlocal state
        state, m = trainer.train_step(state, jax_batch)
        jax.block_until_ready(m)

    # --- torch eager and torch.compile ----------------------------------------------------------------------
    eager_trainer = torch_llama.TorchTrainer(cfg, model_cfg, params, compile=False)
    eager = warm_torch(eager_trainer, batch)
    fused = eager_trainer.fused
    compiled_trainer, compiled, compile_error = None, None, None
    try:
        compiled_trainer = torch_llama.TorchTrainer(cfg, model_cfg, params, compile=True)
        compiled = warm_torch(compiled_trainer, batch)
    except Exception as e:  # noqa: BLE001  (report and go on with eager)
        compile_error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        traceback.print_exc(file=sys.stderr)

    # --- timed rounds: one step of each in turn ---------------------------------------------------------------
    steps_by_name = {"jax": jax_step, "eager": lambda: eager_trainer.train_step(batch)}
    if compiled:
        steps_by_name["compile"] = lambda: compiled_trainer.train_step(batch)
    times = interleaved(steps_by_name, steps)
    jax_s = float(np.median(times["jax"]))
    eager["step_s"] = float(np.median(times["eager"]))
    if compiled:
        compiled["step_s"] = float(np.median(times["compile"]))
    # Per round: the best torch step over jaxtrain's step; its spread says how steady the machine was.
    round_ratios = [min(r[1:]) / r[0] for r in zip(*times.values())]
    del state, trainer, eager_trainer, compiled_trainer
    load_end = os.getloadavg()

    # --- report --------------------------------------------------------------------------------------------
    rows = [("jaxtrain (jax.jit)", jax_s, f"startup to warm step {jax_startup_s:.1f} s"),
            ("torch eager", eager["step_s"], "")]
    if compiled:
        compile_s = compiled["first_step_s"] - compiled["step_s"]
        rows.append(("torch.compile", compiled["step_s"],
                     f"compile {compile_s:.1f} s (first step {compiled['first_step_s']:.1f} s, excluded)"))
    best_torch_s = min(eager["step_s"], compiled["step_s"]) if compiled else eager["step_s"]
    best_torch = "torch.compile" if compiled and compiled["step_s"] < eager["step_s"] else "torch eager"
    ratio = best_torch_s / jax_s  # = jax tokens/s / best torch tokens/s

    log(f"jax {jax.__version__} ({jax.devices()[0].device_kind} x {jax.device_count()}) | torch {torch.__version__}, "
        f"torch.set_num_threads(os.cpu_count()) = {threads} threads, AdamW fused={fused} | "
        f"load avg {load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
    log(f"host memory (jaxtrain.compat.glibc_malloc; one process, so glibc's settings hold for torch too): "
        f"{glibc_malloc.status}")
    log(f"model: {n_params / 1e6:.2f}M params, vocab {model_cfg.vocab_size}, d_model {model_cfg.d_model}, "
        f"{model_cfg.n_layers} layers, {model_cfg.n_heads} heads / {model_cfg.n_kv_heads} kv of {model_cfg.head_dim}, "
        f"d_ff {model_cfg.d_ff}, {'tied' if model_cfg.tie_embeddings else 'untied'}, {model_cfg.dtype}, "
        f"remat {cfg.model.remat} | batch {b} x {s} = {tokens:,} tokens/step | median of {steps} rounds (one step of "
        f"each in turn) after 2 warm-up steps")
    loss_line = f"first-step loss: jaxtrain {jax_loss0:.6f} | torch eager {eager['first_loss']:.6f}"
    if compiled:
        loss_line += f" | torch.compile {compiled['first_loss']:.6f}"
    worst = max(abs(x - jax_loss0) / abs(jax_loss0) for x in
                [eager["first_loss"]] + ([compiled["first_loss"]] if compiled else []))
    log(loss_line + f" (max rel diff {worst:.1e})")
    log(f"{'':20s} {'step ms':>10s} {'tokens/s':>10s}")
    for name, step_s, note in rows:
        log(f"{name:20s} {1e3 * step_s:10.1f} {tokens / step_s:10,.0f}  {note}")
    log(f"per-round ratio (best torch step / jaxtrain step, the same round): median {np.median(round_ratios):.2f}x, "
        f"range {min(round_ratios):.2f}-{max(round_ratios):.2f}x over {steps} rounds")
    if compile_error:
        log(f"torch.compile failed (eager only): {compile_error}")
    log(f"jaxtrain / max(eager, compile) = {ratio:.2f}x (best torch: {best_torch}); "
        f"target >= {TARGET}x: {'MET' if ratio >= TARGET else 'NOT MET'}")

    result = {"config": cfg.workdir, "steps": steps, "tokens_per_step": tokens, "torch_threads": threads,
              "jax_step_ms": 1e3 * jax_s, "jax_tokens_per_sec": tokens / jax_s,
              "round_ratio_min": min(round_ratios), "round_ratio_max": max(round_ratios),
              "torch_eager_step_ms": 1e3 * eager["step_s"], "torch_eager_tokens_per_sec": tokens / eager["step_s"],
              "torch_compile_step_ms": 1e3 * compiled["step_s"] if compiled else None,
              "torch_compile_tokens_per_sec": tokens / compiled["step_s"] if compiled else None,
              "torch_compile_s": compile_s if compiled else None, "torch_compile_error": compile_error,
              "best_torch": best_torch, "ratio": ratio, "target": TARGET, "meets_target": ratio >= TARGET,
              "jax_first_loss": jax_loss0, "torch_eager_first_loss": eager["first_loss"],
              "torch_compile_first_loss": compiled["first_loss"] if compiled else None,
              "load_avg_start": load_start[0], "load_avg_end": load_end[0], "host_memory": glibc_malloc.status}
    print(json.dumps(result))


if __name__ == "__main__":
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_cpu.py", "Model/batch config.",
                                              lock_config=True)
    _STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per implementation (after 2 warm-up steps).")
    app.run(main)
