"""Precision is chosen per platform: f32 on CPU, bf16 compute with f32 params on GPU/TPU, unless set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import config as config_lib, train
from jaxtrain.data import pipeline


@pytest.mark.parametrize("backend, compute", [("cpu", "float32"), ("gpu", "bfloat16"), ("tpu", "bfloat16")])
def test_auto_dtypes_per_backend(tiny_config, backend, compute):
    m = config_lib.model_config(tiny_config(), backend)
    assert (m.dtype, m.param_dtype) == (compute, "float32")


def test_explicit_dtypes_win_over_auto(tiny_config):
    m = config_lib.model_config(tiny_config(**{"model.dtype": "bfloat16", "model.param_dtype": "float32"}), "cpu")
    assert (m.dtype, m.param_dtype) == ("bfloat16", "float32")
    with pytest.raises(config_lib.ConfigError, match="model.dtype"):
        config_lib.validate(tiny_config(**{"model.dtype": "fp8"}), 8)


def test_bf16_compute_keeps_f32_master_weights_and_tracks_f32(tiny_config):
    """One step in bf16 compute: params and Adam moments stay f32, and the loss is close to the f32 one."""
    local = next(pipeline.train_iterator(tiny_config().data.dir, seq_len=32, global_batch=8, seed=0))

    def step(dtype):
        cfg = tiny_config(**{"model.dtype": dtype, "mesh.data": 1})
        facts = config_lib.validate(cfg, 1)
        trainer = train.build_trainer(cfg, facts["mesh_shape"], facts["rules"], devices=jax.devices()[:1])
        logits = jax.jit(lambda p: nnx.merge(trainer.graphdef, p)(
            jnp.asarray(local["tokens"]), jnp.asarray(local["positions"]), jnp.asarray(local["segment_ids"])))
        state = trainer.init()
        out_dtype = logits(state["params"]).dtype
        state, metrics = trainer.train_step(state, train.global_batch(local, trainer.batch_sharding))
        return state, float(metrics["loss"]), out_dtype

    state16, loss16, logits16 = step("bfloat16")
    _, loss32, logits32 = step("float32")
    assert logits16 == jnp.bfloat16 and logits32 == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(state16["params"])} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state16["opt_state"]) if x.ndim} == {jnp.dtype("float32")}
    assert np.isfinite(loss16)
    np.testing.assert_allclose(loss16, loss32, rtol=2e-2)  # bf16 has ~3 significant digits
    assert loss16 != loss32  # the bf16 path really computed in bf16
