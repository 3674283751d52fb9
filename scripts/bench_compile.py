"""Compile time against depth, and startup to the first step.

    python scripts/bench_compile.py [--config configs/bench_cpu.py] [--layers 4,32] [--default configs/default.py]

1. The train step of `--config` is lowered and compiled ahead of time at each depth in `--layers`. The layers
   are a `jax.lax.scan` over stacked weights (model.scan_unroll is set to 1 here: bench_cpu unrolls its 4 layers
   for speed, which compiles in time proportional to depth), so compile time should barely grow with depth; the
   figure is the ratio of the deepest to the shallowest (target <= 1.5). Nothing is allocated (shapes only).
2. `python -m jaxtrain.main --config <default> --config.train.steps=1` is started as a fresh process and
   timed from launch to the `step 1/1` line: imports, backend start, config, data (already prepared: this
   script prepares it first and excludes that), mesh, compile and the first step (target <= 10 s). On CPU a
   run's first start on a machine also measures the matmul peak for MFU (cached afterwards); the line says
   whether this one did.
Ends with one JSON line.
"""

import json
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags
from jaxtrain import trainer as trainer_lib
from jaxtrain.data import layout

REPO = Path(__file__).resolve().parents[1]


def compile_seconds(cfg) -> tuple[float, float]:
    """(lower s, compile s) of cfg's train step, shapes only."""
    import jax
    import jax.numpy as jnp

    from jaxtrain import config as config_lib

    facts = config_lib.validate(cfg, jax.device_count(), jax.process_count())
    trainer = trainer_lib.build_trainer(cfg, facts)
    batch = {k: jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), jnp.int32,
                                     sharding=trainer.batch_sharding) for k in ("tokens", "segment_ids", "positions")}
    t = time.perf_counter()
    lowered = trainer.train_step.lower(trainer.abstract_state, batch)
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    lowered.compile()
    return lower_s, time.perf_counter() - t


def startup_seconds(config_path: str) -> tuple[float, str]:
    """Seconds from launching a 1-step run of `config_path` to its `step 1/1` line, and that run's own
    'compiled ... (startup ...)' and 'peak ...' lines."""
    from jaxtrain.data import corpus

    cfg = runpy.run_path(str(REPO / config_path))["get_config"]()
    corpus.prepare_default_corpus(layout.default_dir(cfg.data), cfg.data.vocab_size, cfg.data.heldout_docs)  # excluded
    workdir = tempfile.mkdtemp(prefix="bench_startup_")
    cmd = [sys.executable, "-m", "jaxtrain.main", "--config", config_path, f"--config.workdir={workdir}/run",
           "--config.train.steps=1", "--config.optim.warmup_steps=0", "--config.log.every_steps=1",
           "--config.eval.at_start=False", "--config.sample.max_new_tokens=0"]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step_s, run_lines = None, ""
    for line in proc.stdout:
        if line.startswith(("compiled train step", "peak ")):
            run_lines = " | ".join(filter(None, [run_lines, line.strip()]))
        if line.startswith("step 1/1") and first_step_s is None:
            first_step_s = time.perf_counter() - t
    if proc.wait() != 0 or first_step_s is None:
        raise SystemExit(f"the 1-step run failed (exit {proc.returncode}): {' '.join(cmd)}")
    return first_step_s, run_lines


def main(argv):
    del argv
    import jax

    cfg = _CONFIG.value
    depths = [int(x) for x in _LAYERS.value.split(",")]
    rows = []
    for n in depths:
        c = cfg.copy_and_resolve_references()
        c.model.n_layers = n
        c.model.scan_unroll = 1  # the claim is about the scanned loop; unrolling trades compile time for speed
        lower_s, compile_s = compile_seconds(c)
        rows.append({"layers": n, "lower_s": lower_s, "compile_s": compile_s})
        print(f"{n:3d} layers: lower {lower_s:5.2f} s, compile {compile_s:5.2f} s", file=sys.stderr)
    ratio = (rows[-1]["lower_s"] + rows[-1]["compile_s"]) / (rows[0]["lower_s"] + rows[0]["compile_s"])
    print(f"lower+compile {depths[-1]} / {depths[0]} layers: {ratio:.2f}x (target <= 1.5x)", file=sys.stderr)
    startup_s, run_lines = startup_seconds(_DEFAULT.value)
    print(f"startup to the first step of {_DEFAULT.value}: {startup_s:.1f} s (target <= 10 s; data prepared "
          f"beforehand) | {run_lines}", file=sys.stderr)
    print(json.dumps({"devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
                      "compile": rows, "deep_over_shallow": ratio, "startup_to_first_step_s": startup_s}))


if __name__ == "__main__":
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_cpu.py", "Model/batch config.",
                                              lock_config=False)
    _LAYERS = flags.DEFINE_string("layers", "4,32", "Depths to compile, comma-separated (first = reference).")
    _DEFAULT = flags.DEFINE_string("default", "configs/default.py", "Config whose startup is timed.")
    app.run(main)
