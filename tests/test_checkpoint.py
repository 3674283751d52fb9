"""Checkpointer round trip, including the relative workdir every README example uses."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import checkpoint
from jaxtrain.data import pipeline


def test_relative_directory_round_trip(tmp_path, monkeypatch, tiny_config):
    monkeypatch.chdir(tmp_path)
    c = tiny_config()
    make_iter = lambda: pipeline.train_iterator(c.data.dir, seq_len=c.train.seq_len, global_batch=8, seed=0)
    it = make_iter()
    next(it)
    state = {"step": jnp.asarray(3, jnp.int32), "w": jnp.arange(6.0).reshape(2, 3)}
    ckpt = checkpoint.Checkpointer("runs/rel/checkpoints", keep=2)
    ckpt.save(3, state, it)
    ckpt.wait()
    ckpt.close()
    assert (tmp_path / "runs/rel/checkpoints/3").is_dir()

    fresh = make_iter()
    ckpt = checkpoint.Checkpointer("runs/rel/checkpoints", keep=2)
    assert ckpt.latest_step() == 3
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore(3, abstract, fresh)
    ckpt.close()
    np.testing.assert_array_equal(restored["w"], state["w"])
    # The restored iterator continues where the saved one was.
    assert pipeline.tokens_per_batch_fingerprint(next(fresh)) == pipeline.tokens_per_batch_fingerprint(next(it))
