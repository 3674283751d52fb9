"""Step time and compiled memory of each pipeline schedule, in one run, on 8 fake CPU devices.

    python scripts/bench_pipeline.py [--rounds 5] [--steps 3] [--microbatches 8] [--gpu | --gpu_only]

Pipeline 4 x data 2, a small model (configs/tiny.py scaled up: 8 layers of d_model 128, 16 x 64 tokens a
step). For gpipe, circular, 1f1b, interleaved_1f1b and zero_bubble (circular and interleaved with 2 repeats):
the compiled step's temporary bytes (`compiled.memory_analysis()`) and the median step time over `rounds`
interleaved rounds of `steps` steps (each schedule timed once per round, so a change in the machine's load hits
all alike). `--gpu` also compiles configs/plan_1b.py (16 layers, S=4, M=16) for 8 described H100s with XLA:GPU
(`jaxtrain plan`, deviceless; about a minute each) and prints, per schedule, its temporaries beside the plan's
analytic ones, the HLO dot FLOPs over the model's and the roofline's MFU (`--gpu_only`: that alone). Ends with one
JSON line.
"""

import argparse
import json
import os
import subprocess
import sys
import time

SCHEDULES = {"gpipe": 1, "circular": 2, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1}  # name: repeats


def config(schedule: str, repeats: int, microbatches: int):
    from jaxtrain.config import base_config

    c = base_config()
    c.model.update(vocab_size=2048, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=256)
    c.data.vocab_size = 2048
    c.train.update(batch_size=16, seq_len=64, steps=100)
    c.optim.warmup_steps = 0
    c.mesh.update(pipeline=4, data=2, fsdp=1, rules="dp_fsdp_tp")
    c.pipeline.update(stages=4, microbatches=microbatches, schedule=schedule, repeats=repeats)
    return c


def build(schedule: str, repeats: int, microbatches: int):
    """(trainer, state, batch, temp bytes of the compiled step)."""
    import jax
    import numpy as np

    from jaxtrain import config as config_lib
    from jaxtrain import trainer as trainer_lib

    cfg = config(schedule, repeats, microbatches)
    trainer = trainer_lib.build_trainer(cfg, config_lib.validate(cfg, jax.device_count()))
    rng = np.random.default_rng(0)
    b, t = cfg.train.batch_size, cfg.train.seq_len
    batch = trainer_lib.global_batch({"tokens": rng.integers(0, 2048, (b, t), dtype=np.int32),
                                      "segment_ids": np.ones((b, t), np.int32),
                                      "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1))},
                                     trainer.batch_sharding)
    compiled = trainer.train_step.lower(trainer.abstract_state, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    state = trainer.init()
    state, m = trainer.train_step(state, batch)  # warm-up
    jax.block_until_ready(m)
    return trainer, state, batch, temp


def gpu_plans() -> dict:
    """{schedule: figures of plan_1b's deviceless XLA:GPU plan on 8 H100s}: compiled and analytic temporaries
    (bytes), HLO dot FLOPs over the model's, the roofline's MFU, the bubble and the ppermute bytes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{root}/.venv/cuda-plugin:{root}")
    out = {}
    for schedule, repeats in SCHEDULES.items():
        path = f"/tmp/bench_pipeline_plan_{schedule}.json"
        cmd = [sys.executable, "-m", "jaxtrain", "plan", "--config", "configs/plan_1b.py", "--config.mesh.pipeline=4",
               "--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.rules=dp_fsdp_tp",
               "--config.model.n_layers=16", "--config.train.microbatches=1", "--config.pipeline.stages=4",
               "--config.pipeline.microbatches=16", f"--config.pipeline.schedule={schedule}",
               f"--config.pipeline.repeats={repeats}", "--backend", "gpu",
               "--compiler", "gpu", "--devices", "8", "--device_kind", "H100", "--json", path]
        subprocess.run(cmd, cwd=root, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            r = json.load(f)
        permute = [c["bytes"] for c in r["collectives"] if c["kind"] == "collective-permute"]
        mem = r["memory"]
        out[schedule] = {"temp": mem["compiled"]["temp"], "analytic_temp": mem["analytic"]["temporaries"],
                         "dots_vs_model": r["flops"]["hlo_dots_vs_model"], "bubble": r["pipeline"]["bubble"],
                         "roofline_mfu": r["speed"]["roofline"]["mfu"], "permute_bytes": sum(permute)}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--gpu", action="store_true", help="also plan_1b's deviceless XLA:GPU compile (8 H100s)")
    p.add_argument("--gpu_only", action="store_true", help="only plan_1b's deviceless XLA:GPU compile")
    args = p.parse_args()
    if args.gpu_only:
        report_gpu({})
        return
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    runs = {name: build(name, r, args.microbatches) for name, r in SCHEDULES.items()}
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (trainer, state, batch, temp) in runs.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                state, m = trainer.train_step(state, batch)
                jax.block_until_ready(m)
                times[name].append(time.perf_counter() - t)
            runs[name] = (trainer, state, batch, temp)
    base = runs["gpipe"][3]
    rows = [{"schedule": name, "repeats": SCHEDULES[name], "step_ms": 1e3 * float(np.median(times[name])),
             "temp_bytes": int(runs[name][3]), "temp_vs_gpipe": runs[name][3] / base} for name in runs]
    print(f"S=4 M={args.microbatches} on 8 CPU devices (pipeline 4 x data 2), load average "
          f"{os.getloadavg()[0]:.1f}", file=sys.stderr)
    print(f"{'schedule':18s} {'step ms':>8s} {'temp MiB':>9s} {'x gpipe':>8s}", file=sys.stderr)
    for r in rows:
        print(f"{r['schedule']:18s} {r['step_ms']:8.1f} {r['temp_bytes'] / 2**20:9.2f} {r['temp_vs_gpipe']:8.3f}",
              file=sys.stderr)
    out = {"microbatches": args.microbatches, "rows": rows, "loadavg": os.getloadavg()[0]}
    if args.gpu:
        report_gpu(out)
    else:
        print(json.dumps(out))


def report_gpu(out: dict) -> None:
    """Runs gpu_plans, prints its table and the JSON line (`out` with the plans added)."""
    gpu = gpu_plans()
    out["gpu_plan_1b"] = gpu
    print("plan_1b on 8 H100 (XLA:GPU, deviceless), pipeline 4 x data 2, S=4 M=16", file=sys.stderr)
    print(f"{'schedule':18s} {'temp GiB':>9s} {'x gpipe':>8s} {'analytic':>9s} {'a/c':>5s} {'dots/model':>10s} "
          f"{'roofline MFU':>12s} {'bubble':>7s} {'permute GiB':>11s}", file=sys.stderr)
    for name, g in gpu.items():
        print(f"{name:18s} {g['temp'] / 2**30:9.2f} {g['temp'] / gpu['gpipe']['temp']:8.3f} "
              f"{g['analytic_temp'] / 2**30:9.2f} {g['analytic_temp'] / g['temp']:5.2f} {g['dots_vs_model']:10.2f} "
              f"{g['roofline_mfu']:12.1%} {g['bubble']:7.1%} {g['permute_bytes'] / 2**30:11.2f}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
