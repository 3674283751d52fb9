"""Every test sees 8 simulated CPU devices. Must run before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

TINY_VOCAB = 512


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """The default corpus prepared once per session with a 512-token vocab (about 2 s)."""
    from jaxtrain.data import prepare

    path = str(tmp_path_factory.mktemp("tiny_data") / f"kjv_v{TINY_VOCAB}")
    prepare.prepare_default_corpus(path, TINY_VOCAB)
    return path


@pytest.fixture
def tiny_config(tiny_data_dir, tmp_path):
    """A function returning a fresh tiny config (~60k params) that trains in well under a second a step.

    Each call returns a new ConfigDict, so a test may build several and change them independently.
    The workdir defaults to this test's tmp_path / "run".
    """
    from jaxtrain.config import base_config

    def make(**overrides):
        c = base_config()
        c.workdir = str(tmp_path / "run")
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
            node[leaf] = value
        return c

    return make
