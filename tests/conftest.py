"""Every test sees 8 simulated CPU devices. Must run before jax is imported anywhere."""

import os
import shutil
import tempfile

from helpers import cpu_flags  # noqa: E402 - no jax import there

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cpu_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the session, which xdist's workers and the tests' subprocesses inherit (the
# controller sets it before they start): most tests compile the same tiny programs, and compiling is most of their
# time. Set JAX_COMPILATION_CACHE_DIR to keep one across runs.
# No size limit: with one, jax re-reads every entry's access time on each write, which grows quadratic. (A read
# that meets an entry another process is still writing warns and compiles instead.)
_SESSION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxtrain-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest


def pytest_unconfigure(config):
    if _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)

TINY_VOCAB = 512


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """The default corpus prepared once per session with a 512-token vocab (about 2 s)."""
    from jaxtrain.data import corpus

    path = str(tmp_path_factory.mktemp("tiny_data") / f"kjv_v{TINY_VOCAB}")
    corpus.prepare_default_corpus(path, TINY_VOCAB)
    return path


@pytest.fixture(scope="session")
def tiny_config(tiny_data_dir, tmp_path_factory):
    """A function returning a fresh tiny config (~40k params, 8 x 32 tokens a step).

    `tiny_config(workdir=None, **overrides)`: overrides are dotted paths, e.g.
    `tiny_config(**{"train.steps": 3, "mesh.rules": "fsdp"})`. Each call returns a new ConfigDict with a
    new empty workdir under pytest's tmp dir unless `workdir` is given.
    """
    from jaxtrain.config import base_config

    def make(workdir=None, **overrides):
        c = base_config()
        c.workdir = str(workdir or tmp_path_factory.mktemp("run") / "workdir")
        c.model.update(vocab_size=TINY_VOCAB, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64)
        c.train.update(batch_size=8, seq_len=32, steps=10)
        c.optim.update(warmup_steps=2)
        c.data.update(dir=tiny_data_dir, vocab_size=TINY_VOCAB)
        c.eval.update(batches=1, every_steps=5)
        c.checkpoint.update(every_steps=5)
        c.log.update(every_steps=1)
        c.sample.update(max_new_tokens=0)
        for path, value in overrides.items():
            node = c
            *parents, leaf = path.split(".")
            for p in parents:
                node = node[p]
            if leaf not in node:
                raise KeyError(f"tiny_config: unknown override {path}")
            node[leaf] = value
        return c

    return make


# ===== Time: the suite's budget and each file's (tests/budgets.json), reported at the end, never asserted ======
# pytest-xdist's controller receives every worker's reports, so the sums cover the whole suite.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    import json
    from pathlib import Path

    if not _FILE_SECONDS:
        return
    budgets = json.loads((Path(__file__).parent / "budgets.json").read_text())
    over = [(path, s, budgets["files"].get(path)) for path, s in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
            if s > budgets["files"].get(path, budgets["default_file_s"])]
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"test time: {total / 60:.1f} min summed over {len(_FILE_SECONDS)} files, "
                                    f"budget {budgets['suite_min']} min (tests/budgets.json)")
    for path, s, budget in over:
        terminalreporter.write_line(f"over budget: {path} {s:.0f} s (budget {budget or budgets['default_file_s']} s)")
    if out := os.environ.get("JAXTRAIN_TEST_TIMES"):  # each file's seconds, to set budgets.json from a measured run
        Path(out).write_text(json.dumps({p: round(s, 1) for p, s in sorted(_FILE_SECONDS.items())}, indent=1) + "\n")


@pytest.fixture
def cache_counts(monkeypatch):
    """jaxtrain.compile_cache's counts of hits and compiles, as `jaxtrain train` installs them (the suite's cache
    dir is this file's)."""
    from jaxtrain import compile_cache

    monkeypatch.setattr(compile_cache, "_counts", {"hits": 0, "misses": 0})
    compile_cache.listen()
    yield
    compile_cache.unlisten()
