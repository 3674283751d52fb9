"""Every test sees 8 simulated CPU devices. Must run before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

TINY_VOCAB = 512


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """The default corpus prepared once per session with a 512-token vocab (about 2 s)."""
    from jaxtrain.data import prepare

    path = str(tmp_path_factory.mktemp("tiny_data") / f"kjv_v{TINY_VOCAB}")
    prepare.prepare_default_corpus(path, TINY_VOCAB)
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
