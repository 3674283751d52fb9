"""model.quant: the layers' weight matmuls in fp8 or int8 (jaxtrain.models.quant, through qwix).

The forward and both gradients equal a numpy reference of the recipe: fp8 per-tensor (e4m3 forward, e5m2
gradients), int8 per channel, both with current absmax scales. Training tracks the unquantized run, and the
state is the same whatever the mode, so a resumed run may switch it.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import trainer_on
from jaxtrain.models.layers import project

F32 = np.float32


def fp8(x, dtype):
    """Per-tensor absmax scaling to `dtype`'s largest value, rounded to it: (values as f32, scale)."""
    scale = F32(np.abs(x).max() / F32(ml_dtypes.finfo(dtype).max))
    return (x * np.reciprocal(scale)).astype(dtype).astype(F32), scale


def int8(x, axis):
    """Symmetric int8 with one absmax scale per slice along `axis` (the contracted one), bound 127.5 as qwix's;
    x times the scale's f32 reciprocal, as qwix computes it (x / scale rounds the bound's ties the other way)."""
    scale = (np.abs(x).max(axis=axis, keepdims=True) / F32(127.5)).astype(F32)
    return np.clip(np.round(x * np.reciprocal(scale)), -128, 127).astype(F32), scale


def reference(mode, x, w, g):
    """(y, dx, dw) of y = x @ w with cotangent g, as the recipe computes them: the backward reuses the forward's
    quantized operands and folds their scales into the gradient before quantizing it (qwix's scale shifting)."""
    if mode == "fp8":
        (xq, sx), (wq, sw) = fp8(x, ml_dtypes.float8_e4m3fn), fp8(w, ml_dtypes.float8_e4m3fn)
        y = xq @ wq * sx * sw
        gq, sg = fp8(g * sw, ml_dtypes.float8_e5m2)
        dx = gq @ wq.T * sg
        gq, sg = fp8(g * sx, ml_dtypes.float8_e5m2)
        dw = xq.T @ gq * sg
    else:
        (xq, sx), (wq, sw) = int8(x, axis=1), int8(w, axis=0)  # a scale per row of x, per column of w
        y = xq @ wq * sx * sw
        gq, sg = int8(g * sw, axis=1)  # dx = g @ w.T contracts the columns: a scale per row of g
        dx = gq @ wq.T * sg
        gq, sg = int8(g * sx, axis=0)  # dw = x.T @ g contracts the rows: a scale per column of g
        dw = xq.T @ gq * sg
    return y, dx, dw


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_quantized_projection_and_its_gradients_equal_the_numpy_recipe(mode):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 32)).astype(F32)
    w = (rng.normal(size=(32, 24)) * 0.1).astype(F32)
    g = rng.normal(size=(12, 24)).astype(F32)
    # Each slice's absmax element lands on int8's bound, +-127.5: a negative one rounds to -128 or -127 by the last
    # ulp of the scale's reciprocal, which XLA's fusion and numpy need not share. Positive extremes (6 sigma) in
    # every row and column leave no such tie (both give 127).
    x[np.arange(12), np.arange(12)] = 6.0
    w[np.arange(24) % 32, np.arange(24)] = 0.6
    g[np.arange(24) % 12, np.arange(24)] = 20.0
    x, g = x.reshape(2, 6, 32), g.reshape(2, 6, 24)

    def loss(x, w):
        return jnp.sum(project(x, w, quant=mode) * g)

    y = project(x, w, quant=mode)
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    want_y, want_dx, want_dw = reference(mode, x.reshape(12, 32), w, g.reshape(12, 24))
    np.testing.assert_allclose(np.asarray(y).reshape(12, 24), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx).reshape(12, 32), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
    # Quantized, not exact: the error is that of the formats (e4m3 keeps 3 mantissa bits, int8 ~7)
    exact = np.asarray(x).reshape(12, 32) @ w
    error = np.abs(want_y - exact).max() / np.abs(exact).max()
    assert {"fp8": 2e-2 < error < 0.15, "int8": 1e-3 < error < 2e-2}[mode], error


def test_the_train_step_carries_fp8_operands_forward_and_e5m2_gradients_over_the_same_state(tiny_config):
    """The lowered step holds e4m3 and e5m2 arrays (XLA:CPU then computes them in f32; XLA:GPU runs fp8 GEMMs,
    which tests/tools/test_plan_gpu.py checks in the compiled H100 program)."""
    from jaxtrain import config as config_lib
    from jaxtrain.parallel import mesh as mesh_lib

    text, states = {}, {}
    for mode in ("none", "fp8", "int8"):
        cfg = tiny_config(**{"model.quant": mode})
        trainer = trainer_on(cfg, {"data": 1, "fsdp": 1, "tensor": 1},
                                            mesh_lib.resolve_rules("dp"), devices=jax.devices()[:1])
        batch = {k: jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=trainer.batch_sharding)
                 for k in ("tokens", "positions", "segment_ids")}
        text[mode] = trainer.train_step.lower(trainer.abstract_state, batch).as_text()
        states[mode] = trainer.abstract_state
        assert config_lib.model_config(cfg, "cpu").quant == mode
    # A compute choice: the same state (params in their dtype, moments) whatever the mode, so a checkpoint restores
    # under another one (model.quant is not among config.RESUME_FIXED: tests/test_optim.py).
    assert states["fp8"] == states["none"] == states["int8"]
    assert "f8E4M3FN" in text["fp8"] and "f8E5M2" in text["fp8"]
    assert "xi8>" in text["int8"] and "f8E4M3FN" not in text["int8"]
    assert "f8E4M3FN" not in text["none"] and "xi8>" not in text["none"]


def test_quantized_training_tracks_bf16(tiny_config, tiny_data_dir):
    """10 steps in bf16, fp8 and int8 end within 3% of each other's held-out loss (a larger model over 200 steps:
    docs/quantization.md). Measured: each falls ~0.66 from ~6.25, and the modes end within 0.02% of each other."""
    from jaxtrain import trainer as trainer_lib
    from jaxtrain.data import pipeline
    from jaxtrain.parallel import mesh as mesh_lib

    modes = ("none", "fp8", "int8")
    trainers = {mode: trainer_on(tiny_config(**{"model.dtype": "bfloat16", "model.quant": mode, "optim.lr": 1e-2}),
                                 {"data": 1, "fsdp": 1, "tensor": 1}, mesh_lib.resolve_rules("dp"),
                                 devices=jax.devices()[:1]) for mode in modes}
    # helpers.train_on_stream's run for each mode, the three steps in one program (one compile instead of three)
    stream = pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=8, seed=0)
    held_out = list(pipeline.eval_batches(tiny_data_dir, seq_len=32, global_batch=8, num_batches=2))
    states = {mode: trainers[mode].init() for mode in modes}
    before = {mode: trainers[mode].evaluate(states[mode]["params"], held_out) for mode in modes}
    step = jax.jit(lambda states, batch: {m: trainers[m].train_step(states[m], batch) for m in modes})
    for _ in range(10):
        out = step(states, trainer_lib.global_batch(next(stream), trainers["none"].batch_sharding))
        states = {mode: state for mode, (state, _) in out.items()}
    final = {mode: trainers[mode].evaluate(states[mode]["params"], held_out) for mode in modes}
    for mode in modes:
        assert final[mode] < before[mode] - 0.5, (mode, before, final)  # the runs do train
    for mode in ("fp8", "int8"):
        assert abs(final[mode] / final["none"] - 1) < 0.03, final
