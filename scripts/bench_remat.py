"""Step time against activation memory for each remat policy, in one run.

    python scripts/bench_remat.py [--config configs/bench_cpu.py] [--steps 10] [--config.a.b=v ...]

For every policy in jaxtrain.models.config.REMAT_POLICIES: the compiled step's temporary bytes
(`compiled.memory_analysis().temp_size_in_bytes`: the activations kept for the backward pass plus the
step's scratch) and the median step time on a synthetic batch (scripts/bench_step.py's timing), each also
as a ratio to `none` measured in the same run. Ends with one JSON line.
"""

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from bench_step import time_train_step


def temp_bytes(trainer, cfg) -> int | None:
    import jax
    import jax.numpy as jnp

    batch = {k: jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), jnp.int32,
                                     sharding=trainer.batch_sharding) for k in ("tokens", "segment_ids", "positions")}
    memory = trainer.train_step.lower(trainer.abstract_state, batch).compile().memory_analysis()
    return getattr(memory, "temp_size_in_bytes", None)


def main(argv):
    del argv
    from jaxtrain.models.config import REMAT_POLICIES

    policies = ["none"] + sorted(p for p in REMAT_POLICIES if p != "none")
    rows = []
    for policy in policies:
        cfg = _CONFIG.value.copy_and_resolve_references()
        cfg.model.remat = policy
        step_s, _, trainer, m = time_train_step(cfg, _STEPS.value)
        rows.append({"remat": policy, "step_ms": 1e3 * step_s, "temp_bytes": temp_bytes(trainer, cfg),
                     "loss": float(m["loss"])})
    base = rows[0]
    print(f"{'remat':34s} {'step ms':>9s} {'x none':>7s} {'temp MiB':>9s} {'x none':>7s}", file=sys.stderr)
    for r in rows:
        r["step_vs_none"] = r["step_ms"] / base["step_ms"]
        r["temp_vs_none"] = r["temp_bytes"] / base["temp_bytes"] if r["temp_bytes"] and base["temp_bytes"] else None
        temp = f"{r['temp_bytes'] / 2**20:9.1f}" if r["temp_bytes"] is not None else f"{'n/a':>9s}"
        ratio = f"{r['temp_vs_none']:7.2f}" if r["temp_vs_none"] is not None else f"{'n/a':>7s}"
        print(f"{r['remat']:34s} {r['step_ms']:9.1f} {r['step_vs_none']:7.2f} {temp} {ratio}", file=sys.stderr)
    print(json.dumps({"config": _CONFIG.value.workdir, "rows": rows}))


if __name__ == "__main__":
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_cpu.py", "Model/batch config.",
                                              lock_config=False)
    _STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per policy (after 2 warm-up steps).")
    app.run(main)
