"""Tokens/s and compiled memory of each context-parallel mode, in one run, on 8 fake CPU devices.

    python scripts/bench_long_context.py [--seq_len 4096] [--rounds 3] [--steps 2] [--packed] [--json PATH]

Sequence 8 (no other split), a narrow model whose step attention dominates at long sequences: 2 layers of
d_model 128, 8 query and 8 KV heads of 16 (Ulysses over 8 needs the KV heads), d_ff 256, vocab 512, one row of
`--seq_len` tokens a step, one document (`--packed`: documents of 256-2048 tokens). Modes: allgather (K/V gathered
whole; one jax.nn.dot_product_attention call over them), ring (zigzag layout), ulysses, and usp (the ring across
2 groups of Ulysses 4). For each: the compiled step's temporary bytes (`compiled.memory_analysis()`) and the
median step time over `rounds` interleaved rounds of `steps` steps (each mode timed once per round, so a change
in the machine's load hits all alike), both also as ratios against allgather. The 8 devices share this machine's
cores, so the times add the devices' work, as one device would run it all. Ends with one JSON line (also written to
`--json`).
"""

import argparse
import json
import os
import sys
import time

MODES = {"allgather": {}, "ring": {}, "ulysses": {}, "usp": {"ulysses_ways": 4}}


def config(mode: str, seq_len: int):
    from jaxtrain.config import base_config

    c = base_config()
    c.model.update(vocab_size=512, d_model=128, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=16, d_ff=256,
                   context_parallel=mode, **MODES[mode])
    c.data.vocab_size = 512
    c.train.update(batch_size=1, seq_len=seq_len, steps=100)
    c.optim.warmup_steps = 0
    c.mesh.update(data=1, fsdp=1, sequence=8)
    return c


def rows(seq_len: int, packed: bool, rng):
    """(segment ids, positions) [1, seq_len]: one document, or documents of 256-2048 tokens."""
    import numpy as np

    seg, pos, at = np.zeros((1, seq_len), np.int32), np.zeros((1, seq_len), np.int32), 0
    while at < seq_len:
        n = min(int(rng.integers(256, 2049)) if packed else seq_len, seq_len - at)
        seg[0, at:at + n], pos[0, at:at + n] = seg[0, at - 1] + 1 if at else 1, np.arange(n)
        at += n
    return seg, pos


def build(mode: str, seq_len: int, packed: bool):
    """(trainer, state, batch, temp bytes of the compiled step)."""
    import jax
    import numpy as np

    from jaxtrain import config as config_lib
    from jaxtrain import trainer as trainer_lib

    cfg = config(mode, seq_len)
    trainer = trainer_lib.build_trainer(cfg, config_lib.validate(cfg, jax.device_count()))
    rng = np.random.default_rng(0)
    seg, pos = rows(seq_len, packed, rng)
    batch = trainer_lib.global_batch({"tokens": rng.integers(1, 512, seg.shape, dtype=np.int32),
                                      "segment_ids": seg, "positions": pos}, trainer.batch_sharding)
    compiled = trainer.train_step.lower(trainer.abstract_state, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    state = trainer.init()
    state, m = compiled(state, batch)  # warm-up
    jax.block_until_ready(m)
    return compiled, state, batch, temp


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--packed", action="store_true", help="documents of 256-2048 tokens instead of one")
    p.add_argument("--json", default="", help="also write the JSON result here")
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    runs = {mode: list(build(mode, args.seq_len, args.packed)) for mode in MODES}
    times = {mode: [] for mode in runs}
    for _ in range(args.rounds):
        for mode, run in runs.items():
            step, state, batch, _ = run
            for _ in range(args.steps):
                t = time.perf_counter()
                state, m = step(state, batch)
                jax.block_until_ready(m)
                times[mode].append(time.perf_counter() - t)
            run[1] = state
    tokens = args.seq_len  # one row a step
    out = {}
    for mode in runs:
        step_s = float(np.median(times[mode]))
        out[mode] = {"step_ms": 1e3 * step_s, "tokens_per_sec": tokens / step_s, "temp_bytes": int(runs[mode][3])}
    for r in out.values():
        r["tokens_per_sec_vs_allgather"] = r["tokens_per_sec"] / out["allgather"]["tokens_per_sec"]
        r["temp_vs_allgather"] = r["temp_bytes"] / out["allgather"]["temp_bytes"]
    load = os.getloadavg()[0]
    print(f"seq_len {args.seq_len} ({'packed' if args.packed else 'one document'}), sequence 8 on 8 CPU devices, "
          f"median of {args.rounds} x {args.steps} steps, load average {load:.1f}", file=sys.stderr)
    print(f"{'mode':10s} {'step ms':>8s} {'tokens/s':>9s} {'x allgather':>12s} {'temp MiB':>9s} {'x allgather':>12s}",
          file=sys.stderr)
    for mode, r in out.items():
        print(f"{mode:10s} {r['step_ms']:8.0f} {r['tokens_per_sec']:9.0f} {r['tokens_per_sec_vs_allgather']:12.2f} "
              f"{r['temp_bytes'] / 2**20:9.1f} {r['temp_vs_allgather']:12.2f}", file=sys.stderr)
    result = {"seq_len": args.seq_len, "packed": args.packed, "modes": out, "loadavg": load}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
