"""Recovery time: from a SIGKILL to the restarted run's next finished step, phase by phase, three ways.

    python scripts/bench_recovery.py [--config configs/bench_cpu.py] [--processes 1|2] [--kill_at 7] [--kills 3]

Each mode trains `--config` under `jaxtrain supervise`, checkpointing every 5 steps, and SIGKILLs the trainer once
step `--kill_at` is logged, then `--kills` - 1 more times 4 steps apart. cold: no compile cache; cache: a compile
cache (filled by the first attempt); cache+local: that and a local tier in /dev/shm saved every step
(`--local_mode`). `--processes 2`: two local processes (gloo, one CPU device each), each under a supervisor of
its own as a per-node launcher runs them; process `--kill_process` is killed, the other fails in its next
collective (gloo: "connection closed by peer") and both supervisors restart theirs; the local tier is node-local
(a directory per process). The phases come from each restart's goodput.jsonl "phases" record (process 0's;
jaxtrain.observe.goodput), detection from the kill to process 0's supervisor seeing its trainer exit, first step
from that record to the step's. Data is prepared beforehand. Prints a markdown table (medians over the
restarts) and the load average, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
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
# jax's compiler log (JAX_DEBUG_LOG_MODULES=jax._src.compiler,jaxtrain.compile_cache): a glog prefix, then the
# train step's cache outcome (a CPU process other than 0 hits an entry of its own: jaxtrain/compile_cache.py).
STEP_COMPILE = re.compile(
    r"^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*?((?:untraced )?cache hit|CACHE MISS) for 'jit_train_step'", re.M)
NOT_WRITTEN = re.compile(r"^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*Not writing persistent cache entry", re.M)


def command(config: str, workdir: Path, mode: str, cache: Path, local: Path, stop_at: int, local_mode: str,
            process: int = 0, processes: int = 1) -> list[str]:
    """Process `process`'s supervised trainer; process 0's supervisor holds the workdir (its lock, its
    supervisor.json). Each process's node-local dir is its own (`<local>/node<i>`), as on machines of their own."""
    local_dir = local / f"node{process}" if local_mode == "node" and processes > 1 else local
    return [sys.executable, "-m", "jaxtrain", "supervise", *(["--workdir", str(workdir)] if process == 0 else []),
            "--backoff_s", "0", "--max_crash_restarts", "20", "--",
            sys.executable, "-m", "jaxtrain.main", "--config", config, f"--config.workdir={workdir}",
            f"--config.train.stop_at={stop_at}", "--config.log.every_steps=1", "--config.eval.every_steps=0",
            "--config.eval.at_start=False", "--config.sample.max_new_tokens=0", "--config.checkpoint.every_steps=5",
            "--config.train.compile_cache=" + ("off" if mode == "cold" else str(cache)),
            # A backstop: a survivor stuck in a collective (rather than failing in it) exits 124 and restarts.
            *(["--config.faults.step_timeout_s=60"] if processes > 1 else []),
            *([f"--config.checkpoint.local_dir={local_dir}", "--config.checkpoint.local_every_steps=1",
               "--config.checkpoint.local_keep=1", f"--config.checkpoint.local_mode={local_mode}"]
              if mode.endswith("local") else [])]


def run_mode(config: str, mode: str, disk: Path, memory: Path, kills: list[int], local_mode: str = "shared",
             processes: int = 1, kill_process: int = 0) -> list[dict]:
    """One supervised run of `mode`, process `kill_process`'s trainer killed once each step of `kills` is logged:
    a row per restart. Workdir and cache on `disk`, the local tier in `memory`."""
    workdir = disk / mode.replace("+", "_")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    if processes > 1:  # each process's cache hits and misses, in its log (step_compiles)
        env["JAX_DEBUG_LOG_MODULES"] = "jax._src.compiler,jaxtrain.compile_cache"
    port = chaos.free_port()
    logs = [disk / f"{workdir.name}.{i}.log" for i in range(processes)]
    cache, local = disk / f"xla_cache_{workdir.name}", memory / workdir.name
    sups = [subprocess.Popen(command(config, workdir, mode, cache, local, kills[-1] + 2, local_mode, i, processes),
                             cwd=REPO, env={**env, **(chaos.process_env(port, i, processes) if processes > 1 else {})},
                             stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
            for i, log in enumerate(logs)]

    def fail(why: str):
        for sup in sups:
            sup.kill()
        raise SystemExit(f"{mode}: {why}\n" + "\n".join(f"--- process {i}:\n{log.read_text()[-2000:]}"
                                                        for i, log in enumerate(logs)))

    def ended() -> bool:
        return any(sup.poll() is not None for sup in sups)

    killed = []
    for step in kills:  # each a few steps past the last: logged only by the restarted attempt
        if not chaos.wait_until(lambda: ended() or chaos.last_step(workdir) >= step, sups[0], timeout=900,
                                poll=0.005) or ended():
            fail(f"step {step} not reached")
        os.kill(chaos.children(sups[kill_process].pid)[0], signal.SIGKILL)
        killed.append(time.time())
    for sup in sups:
        try:
            sup.wait(timeout=900)
        except subprocess.TimeoutExpired:
            fail("not finished in 900 s")
    if any(sup.returncode for sup in sups):
        fail(f"supervisor exits {[sup.returncode for sup in sups]}")
    attempts = json.loads((workdir / "supervisor.json").read_text())["attempts"]
    launches = [log.read_text().count("supervise: attempt ") for log in logs]  # one line per attempt's exit
    records = [json.loads(line) for line in (workdir / "goodput.jsonl").read_text().splitlines()]
    others = [step_compiles(log.read_text()) for log in logs[1:]]
    rows = []
    for kill in killed:
        i = next(i for i, r in enumerate(records) if r["event"] == "phases" and r["t"] > kill)
        record = records[i]
        step = next(r for r in records[i:] if r["event"] == "step")
        exited = next(a["exited_unix"] for a in attempts if a["exited_unix"] > kill)  # process 0's trainer
        row = {"mode": mode, "from_step": record["step"], "detection": exited - kill,
               **{p: record["phases"].get(p, 0.0) for p in PHASES}, "first_step": step["t"] - record["t"],
               "compile_source": record.get("compile"), "restore_tier": record.get("restore_tier"),
               "kill_to_step": step["t"] - kill, "launches": launches,
               # The other processes' train-step compile of this restart: process 0's first step waits for it.
               "others_compile": [next(((source, s) for t, source, s in events if t > kill), None)
                                  for events in others]}
        row["compile_restore_share"] = (row["compile"] + row["restore"]) / row["kill_to_step"]
        rows.append(row)
    return rows


def step_compiles(log: str) -> list[tuple[float, str, float | None]]:
    """(unix time it ended, "cache", "untraced" or "compiled", seconds compiling or None) of each train-step compile
    in a process's log (not process 0's: a miss there is followed by a cache write, not by "Not writing")."""
    def unix(md: str, hms: str) -> float:  # glog's local time, without the year
        year = datetime.date.today().year
        return datetime.datetime.strptime(f"{year}{md} {hms}", "%Y%m%d %H:%M:%S.%f").timestamp()

    out = []
    for m in STEP_COMPILE.finditer(log):
        start = unix(m.group(1), m.group(2))
        if m.group(3).endswith("cache hit"):
            out.append((start, "untraced" if m.group(3).startswith("untraced") else "cache", None))
        elif end := NOT_WRITTEN.search(log, m.end()):
            out.append((unix(end.group(1), end.group(2)), "compiled", unix(end.group(1), end.group(2)) - start))
    return out


def table(rows: list[dict]) -> str:
    """The median of each figure over a mode's restarts; the sources and tiers each restart had."""
    head = ["mode", "restarts", "kill to next step", "detection", "restart wait", "process start", "distributed init",
            "setup", "restore", "data restore", "compile", "first step", "compile + restore"]
    peers = len(rows[0]["others_compile"]) if rows else 0
    if peers:  # a step compile that only the other processes' logs show (jax's cache log; none when it is off)
        head.insert(-2, "process 1's step compile" if peers == 1 else "other processes' step compile")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in rs) for k in ("kill_to_step", "detection", "first_step",
                                                                "compile_restore_share", *PHASES)}
        tiers = "/".join(sorted({str(r["restore_tier"]) for r in rs}))
        sources = "/".join(sorted({str(r["compile_source"]) for r in rs}))
        # Trainer launches beyond the first and one per kill, per process: a relaunch that failed again.
        extra = [n - 1 - len(rs) for n in rs[0]["launches"]]
        cells = [mode, str(len(rs)) + (f" (+{'/'.join(map(str, extra))} relaunches)" if any(extra) else ""),
                 f"{med['kill_to_step']:.1f} s", f"{med['detection']:.2f}",
                 *(f"{med[p]:.2f}" + (f" ({tiers})" if p == "restore" else f" ({sources})" if p == "compile" else "")
                   for p in PHASES),
                 f"{med['first_step']:.2f}", f"{100 * med['compile_restore_share']:.0f}%"]
        if peers:
            seen = [c for r in rs for c in r["others_compile"] if c]
            timed = [s for _, s in seen if s is not None]
            cells.insert(-2, "/".join(sorted({source for source, _ in seen})) + (
                f" {statistics.median(timed):.2f}" if timed else "") if seen else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench_cpu.py")
    parser.add_argument("--kill_at", type=int, default=7, help="the first kill's step")
    parser.add_argument("--kills", type=int, default=3, help="kills per mode, 4 steps apart")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2))
    parser.add_argument("--kill_process", type=int, default=None, help="the process killed (default: the last)")
    parser.add_argument("--local_mode", choices=("shared", "node"), default=None,
                        help="cache+local's checkpoint.local_mode (default: node with 2 processes, else shared)")
    parser.add_argument("--out", default="", help="keep the workdirs here (default: a temp dir, removed)")
    args = parser.parse_args()
    if unknown := set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}")
    kill_process = args.processes - 1 if args.kill_process is None else args.kill_process
    if not 0 <= kill_process < args.processes:
        parser.error(f"--kill_process: {kill_process} is not one of the {args.processes} process(es)")
    local_mode = args.local_mode or ("node" if args.processes > 1 else "shared")
    from jaxtrain.data import corpus, layout

    cfg = runpy.run_path(str(REPO / args.config))["get_config"]()
    corpus.prepare_default_corpus(layout.default_dir(cfg.data), cfg.data.vocab_size, cfg.data.heldout_docs)
    disk = Path(args.out or tempfile.mkdtemp(prefix="bench_recovery_"))  # workdirs and caches
    disk.mkdir(parents=True, exist_ok=True)
    memory = Path(tempfile.mkdtemp(prefix="bench_recovery_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    rows, load_before = [], os.getloadavg()
    try:
        for mode in args.modes.split(","):
            rows += run_mode(args.config, mode, disk, memory, [args.kill_at + 4 * i for i in range(args.kills)],
                             local_mode, args.processes, kill_process)
            print(f"{mode}: " + ", ".join(f"{r['kill_to_step']:.1f}" for r in rows if r["mode"] == mode)
                  + " s from a kill to the next step", file=sys.stderr, flush=True)
    finally:
        if not args.out:
            shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    print(table(rows))
    load = os.getloadavg()
    print(f"\nload average {load_before[0]:.1f}, {load_before[1]:.1f}, {load_before[2]:.1f} at the start, "
          f"{load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} at the end, on {os.cpu_count()} cores")
    print(json.dumps({"config": args.config, "processes": args.processes, "kill_process": kill_process,
                      "local_mode": local_mode, "kill_at": args.kill_at, "kills": args.kills, "rows": rows,
                      "loadavg": load, "loadavg_start": load_before}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
