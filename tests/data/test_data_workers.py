"""data.num_workers: train batches built in Grain worker processes equal the in-process ones, resume
exactly, and the workers never outlive the trainer."""

import json
import multiprocessing
import os
from pathlib import Path
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxtrain.data import pipeline

REPO = str(Path(__file__).resolve().parents[2])
KW = dict(seq_len=64, global_batch=8, seed=3)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.keys() == e.keys()
        for key in e:
            assert type(a[key]) is np.ndarray  # a plain copy, not Grain's shared memory
            np.testing.assert_array_equal(a[key], e[key])


def test_workers_give_the_same_batches_and_resume_exactly(tiny_data_dir):
    reference = pipeline.train_iterator(tiny_data_dir, **KW)
    expected = take(reference, 9)
    reference.close()
    before = {p.pid for p in multiprocessing.active_children()}

    it = pipeline.train_iterator(tiny_data_dir, num_workers=2, **KW)
    assert_batches_equal(take(it, 6), expected[:6])
    assert it.get_state()["next_token"] == 6 * 8 * 64
    assert len({p.pid for p in multiprocessing.active_children()} - before) == 2

    # Resume at batch 3, as from a checkpoint: the workers restart there (the old ones are stopped).
    state = {**json.loads(json.dumps(it.get_state())), "next_token": 3 * 8 * 64}
    it.set_state(state)
    assert_batches_equal(take(it, 6), expected[3:9])
    it.close()
    assert {p.pid for p in multiprocessing.active_children()} == before


def test_workers_on_two_processes_resume_into_the_same_global_batches(tiny_data_dir):
    reference = pipeline.train_iterator(tiny_data_dir, **KW)
    take(reference, 2)
    state = json.loads(json.dumps(reference.get_state()))
    expected = take(reference, 3)
    reference.close()
    parts = []
    for process_index, workers in ((0, 2), (1, 1)):  # hosts may pick different worker counts
        it = pipeline.train_iterator(tiny_data_dir, process_index=process_index, process_count=2,
                                     num_workers=workers, **KW)
        it.set_state(state)
        parts.append(it)
    for whole in expected:
        local = [next(it) for it in parts]
        assert_batches_equal([{k: np.concatenate([b[k] for b in local]) for k in whole}], [whole])
    assert parts[0].get_state() == parts[1].get_state() == reference.get_state()
    for it in parts:
        it.close()


WORKER_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, signal, sys
    import jax, jax.numpy as jnp
    from jaxtrain.data import pipeline

    if __name__ == "__main__":
        jnp.ones(4).block_until_ready()  # XLA's threads are running before the workers start
        it = pipeline.train_iterator(sys.argv[1], seq_len=64, global_batch=8, seed=0, num_workers=2)
        for _ in range(3):
            next(it)
        workers = multiprocessing.active_children()
        # A fresh interpreter (exec'd by the spawn method), not a fork of this process and its XLA threads:
        print(all(b"spawn_main" in open(f"/proc/{p.pid}/cmdline", "rb").read() for p in workers))
        print(" ".join(str(p.pid) for p in workers), flush=True)
        if sys.argv[2] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        # "exit": leaves without close(); the iterator's finalizer stops the workers
""")


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_workers_are_spawned_and_never_outlive_the_trainer(tiny_data_dir, how):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, tiny_data_dir, how], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == (-signal.SIGKILL if how == "sigkill" else 0), proc.stderr
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    spawned, pids = proc.stdout.splitlines()
    pids = [int(p) for p in pids.split()]
    assert spawned == "True" and len(pids) == 2
    while any(map(alive, pids)) and time.monotonic() - start < 60:
        time.sleep(0.2)
    leftover = [p for p in pids if alive(p)]
    for pid in leftover:  # don't leak them into the rest of the suite, then fail
        os.kill(pid, signal.SIGKILL)
    assert not leftover, f"worker processes {leftover} outlived the trainer ({how})"


def test_a_run_with_a_worker_process_equals_the_in_process_run(tiny_config):
    from helpers import read_jsonl

    from jaxtrain import train

    runs = []
    for workers in (0, 1):
        cfg = tiny_config(**{"train.steps": 3, "eval.at_start": False, "eval.every_steps": 0,
                             "checkpoint.every_steps": 3, "data.num_workers": workers, "log.fingerprints": True})
        summary = train.run(cfg, print_fn=lambda *a: None)
        records = read_jsonl(os.path.join(cfg.workdir, "metrics.jsonl"))
        prints = read_jsonl(os.path.join(cfg.workdir, "data_fingerprints.0.jsonl"))
        runs.append(([r["loss"] for r in records if "loss" in r], summary["eval"], prints, summary["state_checksum"]))
    (losses0, eval0, prints0, checksum0), (losses1, eval1, prints1, checksum1) = runs
    assert len(losses0) == 3 and losses1 == losses0
    assert eval1 == eval0 and prints1 == prints0
    assert checksum1 == checksum0  # bit-identical parameters and optimizer state


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_num_workers_must_be_a_non_negative_integer(tiny_config, value):
    import jax

    from jaxtrain import config as config_lib

    cfg = tiny_config()
    with cfg.unlocked(), cfg.ignore_type():  # as a Python config file could set it
        cfg.data.num_workers = value
    with pytest.raises(config_lib.ConfigError, match=r"data.num_workers: must be a non-negative integer") as e:
        config_lib.validate(cfg, jax.device_count())
    assert e.value.field == "data.num_workers"
