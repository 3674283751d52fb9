"""One process of a multi-process run (spawned by tests/e2e/test_multihost.py; not a test module).

argv: CONFIG_JSON OUT_NPZ [gloo-coordinator]. jaxtrain.parallel.distributed reads JAXTRAIN_COORDINATOR /
_NUM_PROCESSES / _PROCESS_ID. With a third argument, a single process joins a 1-process jax.distributed
group at that address first, so that its 8 devices use gloo's collectives as a multi-process run does.
JAXTRAIN_TEST_POISON="step:process" makes that process's batch of that step non-finite (tests/helpers.py);
JAXTRAIN_TEST_SLOW="process:seconds" makes that process sleep so long before each batch (a straggler).
Exits with jaxtrain.main's codes. After a finished run, process 0 writes the final params (gathered from
every process) to OUT_NPZ.
"""

import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from helpers import install_poison
from jaxtrain import compile_cache, main as main_lib, train
from jaxtrain.data import pipeline


def main(config_path: str, out_path: str, gloo_coordinator: str = "") -> int:
    if gloo_coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(gloo_coordinator, num_processes=1, process_id=0)
    config = ml_collections.ConfigDict(json.loads(open(config_path).read()))
    if poison := os.environ.get("JAXTRAIN_TEST_POISON"):  # "step:process": that process's batch is bad
        bad_step, process = map(int, poison.split(":"))
        install_poison(setattr, bad_step, only_process=process)
    if slow := os.environ.get("JAXTRAIN_TEST_SLOW"):
        process, seconds = slow.split(":")
        if os.environ.get("JAXTRAIN_PROCESS_ID") == process:  # jax.process_index() would start jax too early
            fetch = pipeline.TrainIterator.__next__
            pipeline.TrainIterator.__next__ = lambda self: time.sleep(float(seconds)) or fetch(self)
    summaries = []
    run = train.run
    train.run = lambda cfg, print_fn=print: summaries.append(run(cfg, print_fn)) or summaries[-1]
    code = main_lib.run(config)  # the CLI's exit codes (75 when preempted, ...)
    if code or "state" not in summaries[0]:
        return code
    summary = summaries[0]
    params = multihost_utils.process_allgather(summary["state"]["params"], tiled=True)
    if jax.process_index() == 0:
        flat = {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(out_path, **flat)
    print(f"process {jax.process_index()}/{jax.process_count()} devices {jax.device_count()} "
          f"step {summary['step']} compile cache {compile_cache.counts()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
