"""Recovery time: from a SIGKILL to the restarted run's next finished step, phase by phase, three ways.

    python scripts/bench_recovery.py [--config configs/bench_cpu.py] [--kill_at 7] [--kills 3] [--modes ...]

Each mode trains `--config` under `jaxtrain supervise` (one process), checkpointing every 5 steps, and SIGKILLs
the trainer once step `--kill_at` is logged, then `--kills` - 1 more times 4 steps apart; the supervisor restarts
it. cold: no compile cache; cache: a compile cache (filled by the first attempt); cache+local: that and a local
tier in /dev/shm saved every step. The phases come from each restart's goodput.jsonl "phases" record
(jaxtrain.observe.goodput), detection from the kill to the supervisor seeing the exit, first step from that
record to the step's. Data is prepared beforehand. Prints a markdown table (medians over the restarts) and the
load average, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chaos  # noqa: E402 - scripts/chaos.py: its process helpers

REPO = chaos.REPO
MODES = ("cold", "cache", "cache+local")
PHASES = ("restart_wait", "process_start", "distributed_init", "setup", "restore", "data_restore", "compile")


def command(config: str, workdir: Path, mode: str, cache: Path, local: Path, stop_at: int) -> list[str]:
    return [sys.executable, "-m", "jaxtrain", "supervise", "--workdir", str(workdir), "--backoff_s", "0", "--",
            sys.executable, "-m", "jaxtrain.main", "--config", config, f"--config.workdir={workdir}",
            f"--config.train.stop_at={stop_at}", "--config.log.every_steps=1", "--config.eval.every_steps=0",
            "--config.eval.at_start=False", "--config.sample.max_new_tokens=0", "--config.checkpoint.every_steps=5",
            "--config.train.compile_cache=" + ("off" if mode == "cold" else str(cache)),
            *([f"--config.checkpoint.local_dir={local}", "--config.checkpoint.local_every_steps=1",
               "--config.checkpoint.local_keep=1"] if mode.endswith("local") else [])]


def run_mode(config: str, mode: str, disk: Path, memory: Path, kills: list[int]) -> list[dict]:
    """One supervised run of `mode`, its trainer killed once each step of `kills` is logged: a row per restart.
    Workdir and cache on `disk`, the local tier in `memory`."""
    workdir = disk / mode.replace("+", "_")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    cmd = command(config, workdir, mode, disk / f"xla_cache_{workdir.name}", memory / workdir.name, kills[-1] + 2)
    sup = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = []
    for step in kills:  # each a few steps past the last: logged only by the restarted attempt
        if not chaos.wait_until(lambda: chaos.last_step(workdir) >= step, sup, timeout=900, poll=0.005):
            raise SystemExit(f"{mode}: step {step} not reached: {sup.communicate()[0][-2000:]}")
        os.kill(chaos.children(sup.pid)[0], signal.SIGKILL)
        killed.append(time.time())
    out = sup.communicate(timeout=900)[0]
    if sup.returncode != 0:
        raise SystemExit(f"{mode}: supervisor exit {sup.returncode}: {out[-2000:]}")
    attempts = json.loads((workdir / "supervisor.json").read_text())["attempts"]
    records = [json.loads(line) for line in (workdir / "goodput.jsonl").read_text().splitlines()]
    at = [i for i, r in enumerate(records) if r["event"] == "phases"][1:]  # the first start is no restart
    rows = []
    for kill, attempt, i in zip(killed, attempts, at):
        record = records[i]
        step = next(r for r in records[i:] if r["event"] == "step")
        row = {"mode": mode, "from_step": record["step"], "detection": attempt["exited_unix"] - kill,
               **{p: record["phases"].get(p, 0.0) for p in PHASES}, "first_step": step["t"] - record["t"],
               "compile_source": record.get("compile"), "restore_tier": record.get("restore_tier"),
               "kill_to_step": step["t"] - kill}
        row["compile_restore_share"] = (row["compile"] + row["restore"]) / row["kill_to_step"]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The median of each figure over a mode's restarts; the sources and tiers each restart had."""
    head = ["mode", "restarts", "kill to next step", "detection", "restart wait", "process start", "distributed init",
            "setup", "restore", "data restore", "compile", "first step", "compile + restore"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in rs) for k in ("kill_to_step", "detection", "first_step",
                                                                "compile_restore_share", *PHASES)}
        tiers = "/".join(sorted({str(r["restore_tier"]) for r in rs}))
        sources = "/".join(sorted({str(r["compile_source"]) for r in rs}))
        cells = [mode, str(len(rs)), f"{med['kill_to_step']:.1f} s", f"{med['detection']:.2f}",
                 *(f"{med[p]:.2f}" + (f" ({tiers})" if p == "restore" else f" ({sources})" if p == "compile" else "")
                   for p in PHASES),
                 f"{med['first_step']:.2f}", f"{100 * med['compile_restore_share']:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench_cpu.py")
    parser.add_argument("--kill_at", type=int, default=7, help="the first kill's step")
    parser.add_argument("--kills", type=int, default=3, help="kills per mode, 4 steps apart")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="", help="keep the workdirs here (default: a temp dir, removed)")
    args = parser.parse_args()
    if unknown := set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}")
    from jaxtrain.data import corpus, layout

    cfg = runpy.run_path(str(REPO / args.config))["get_config"]()
    corpus.prepare_default_corpus(layout.default_dir(cfg.data), cfg.data.vocab_size, cfg.data.heldout_docs)
    disk = Path(args.out or tempfile.mkdtemp(prefix="bench_recovery_"))  # workdirs and caches
    disk.mkdir(parents=True, exist_ok=True)
    memory = Path(tempfile.mkdtemp(prefix="bench_recovery_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    rows = []
    try:
        for mode in args.modes.split(","):
            rows += run_mode(args.config, mode, disk, memory, [args.kill_at + 4 * i for i in range(args.kills)])
            print(f"{mode}: " + ", ".join(f"{r['kill_to_step']:.1f}" for r in rows if r["mode"] == mode)
                  + " s from a kill to the next step", file=sys.stderr, flush=True)
    finally:
        if not args.out:
            shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    print(table(rows))
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} on {os.cpu_count()} cores")
    print(json.dumps({"config": args.config, "kill_at": args.kill_at, "kills": args.kills, "rows": rows,
                      "loadavg": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
