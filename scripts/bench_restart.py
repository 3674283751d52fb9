"""A restart's time to its first step, with and without the persistent compilation cache (train.compile_cache).

    python scripts/bench_restart.py [--config configs/bench_cpu.py] [--repeats 2]

Two workdirs train to step 2 (a checkpoint) as `jaxtrain train` processes, one with the cache off and one with
a fresh cache directory (filled by that first start). Then each is restarted `--repeats` times, alternately (the
machine may be shared, so both are measured in the same minutes), one more step each time: from launch to the
restart's first step line (imports, backend, restore, compile or cache load, the step), and the run's own
"compiled train step in" figure. Data is prepared beforehand and excluded. Ends with one JSON line.
"""

import json
import os
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

REPO = Path(__file__).resolve().parents[1]
_CONFIG = flags.DEFINE_string("config", "configs/bench_cpu.py", "Config to restart.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Restarts of each kind.")


def start(config: str, workdir: str, cache: str, stop_at: int) -> dict:
    """One `jaxtrain train` process to `stop_at`: seconds to its step line, and its compile line's seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    cmd = [sys.executable, "-m", "jaxtrain.main", "--config", config, f"--config.workdir={workdir}",
           f"--config.train.compile_cache={cache}", f"--config.train.stop_at={stop_at}", "--config.log.every_steps=1",
           "--config.eval.at_start=False", "--config.eval.every_steps=0", "--config.sample.max_new_tokens=0",
           "--config.checkpoint.every_steps=1"]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step_s, compile_s, out = None, None, []
    for line in proc.stdout:
        out.append(line)
        if m := re.match(r"compiled train step in ([\d.]+)s", line):
            compile_s = float(m.group(1))
        if re.match(rf"step +{stop_at}/", line) and first_step_s is None:
            first_step_s = time.perf_counter() - t
    if proc.wait() != 0 or first_step_s is None:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n{''.join(out[-20:])}")
    return {"first_step_s": first_step_s, "compile_s": compile_s}


def main(argv):
    del argv
    from jaxtrain.data import corpus, layout

    cfg = runpy.run_path(str(REPO / _CONFIG.value))["get_config"]()
    corpus.prepare_default_corpus(layout.default_dir(cfg.data), cfg.data.vocab_size, cfg.data.heldout_docs)
    root = Path(tempfile.mkdtemp(prefix="bench_restart_"))
    kinds = {"no cache": "off", "cache": str(root / "xla_cache")}
    for kind, cache in kinds.items():  # the first start: compiles (and fills the cache)
        first = start(_CONFIG.value, str(root / f"run_{kind.replace(' ', '_')}"), cache, 2)
        print(f"first start, {kind}: step 2 at {first['first_step_s']:.1f} s (compile {first['compile_s']:.1f} s)",
              file=sys.stderr)
    entries = len(os.listdir(root / "xla_cache"))
    rows = {kind: [] for kind in kinds}
    for i in range(_REPEATS.value):
        for kind, cache in kinds.items():
            rows[kind].append(start(_CONFIG.value, str(root / f"run_{kind.replace(' ', '_')}"), cache, 3 + i))
            print(f"restart {i + 1}, {kind}: first step at {rows[kind][-1]['first_step_s']:.1f} s "
                  f"(compile {rows[kind][-1]['compile_s']:.2f} s)", file=sys.stderr)
    med = {kind: {k: statistics.median(r[k] for r in rows[kind]) for k in ("first_step_s", "compile_s")}
           for kind in kinds}
    ratio = med["no cache"]["first_step_s"] / med["cache"]["first_step_s"]
    print(f"restart to first step: {med['no cache']['first_step_s']:.1f} s without the cache, "
          f"{med['cache']['first_step_s']:.1f} s with it ({ratio:.2f}x); train step compile "
          f"{med['no cache']['compile_s']:.1f} s -> {med['cache']['compile_s']:.2f} s; {entries} cache entries",
          file=sys.stderr)
    print(json.dumps({"config": _CONFIG.value, "median": med, "speedup": ratio, "cache_entries": entries,
                      "runs": rows}))
    shutil.rmtree(root, ignore_errors=True)  # the workdirs' checkpoints and the cache


if __name__ == "__main__":
    app.run(main)
