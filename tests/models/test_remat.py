"""Every named remat policy recomputes the same function: loss and gradients equal the no-remat step."""

import jax
import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain.data import pipeline
from jaxtrain.models.config import REMAT_POLICIES
from jaxtrain import trainer as trainer_lib


@pytest.fixture(scope="module")
def batch(tiny_config):
    c = tiny_config()
    it = pipeline.train_iterator(c.data.dir, seq_len=c.train.seq_len, global_batch=c.train.batch_size, seed=0)
    return next(it)


def test_remat_policies_match_no_remat(tiny_config, batch):
    trainers = {}
    for policy in REMAT_POLICIES:
        cfg = tiny_config(**{"mesh.data": 1, "model.remat": policy})
        trainers[policy] = trainer_lib.build_trainer(cfg, config_lib.validate(cfg, 1), devices=jax.devices()[:1])
    one = trainers["none"]
    inputs = lambda: (one.init(), trainer_lib.global_batch(batch, one.batch_sharding))  # noqa: E731 (steps donate)
    # "none" and the default policy step alone: the programs the next test's plan() compiles, which the session's
    # cache then serves. The other policies' steps run in one program: one compile instead of four.
    steps = {p: trainers[p].train_step(*inputs()) for p in ("none", "dots_with_no_batch_dims_saveable")}
    rest = [p for p in REMAT_POLICIES if p not in steps]
    steps.update(jax.jit(lambda s, b: {p: trainers[p].train_step(s, b) for p in rest})(*inputs()))
    ref_state, ref_metrics = jax.device_get(steps.pop("none"))
    assert sorted(steps) == sorted(p for p in REMAT_POLICIES if p != "none")
    for policy, (state, metrics) in jax.device_get(steps).items():
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6, err_msg=policy)
        np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5, err_msg=policy)
        for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=policy)


def test_unknown_remat_policy_is_a_config_error(tiny_config):
    with pytest.raises(config_lib.ConfigError, match="model.remat"):
        config_lib.validate(tiny_config(**{"model.remat": "sometimes"}), 8)


def _dot_flops(tiny_config, devices, **overrides):
    """All devices' matmul FLOPs in the compiled train step (jaxtrain.tools.plan counts them in the HLO)."""
    from jaxtrain.tools.plan import planner  # noqa: PLC0415

    return planner.plan(tiny_config(**overrides), devices, "cpu", peak_flops=1e12)["flops"]["hlo_dots_total"]


def test_dots_policy_saves_weight_matmuls_under_a_vmap_over_weight_copies(tiny_config):
    """Per-replica gradient accumulation and pipeline stages vmap the layers over weight copies, which gives every
    weight matmul a batch dimension; jax's own dots_with_no_batch_dims_saveable then saved none of them (= full
    remat). Ours must recompute only what it recomputes without the vmap: attention's score and value products."""
    dots = {"model.remat": "dots_with_no_batch_dims_saveable"}
    one = {"mesh.data": 1}
    alone = _dot_flops(tiny_config, 1, **one, **dots)
    recomputed = alone - _dot_flops(tiny_config, 1, **one)
    assert 0 < recomputed < 0.1 * alone  # attention's products only, not the projections
    # Two replicas, each accumulating 2 microbatches on its own weight copy: the same work in all.
    assert _dot_flops(tiny_config, 2, **{"mesh.data": 2, "train.microbatches": 2}, **dots) == pytest.approx(alone)
    # Two pipeline stages, 2 microbatches: 3 ticks of a microbatch each, so 3/2 of everything, recompute included.
    pp = {"mesh.data": 1, "mesh.pipeline": 2, "pipeline.stages": 2, "pipeline.microbatches": 2}
    pipelined = _dot_flops(tiny_config, 2, **pp, **dots)
    assert pipelined - _dot_flops(tiny_config, 2, **pp) == pytest.approx(1.5 * recomputed)


def test_dots_policy_saves_the_cudnn_attention_forward():
    """The default policy keeps cuDNN attention's forward outputs, so the backward does not run that kernel again
    (a GPU-only kernel: here the policy is checked on jax's own primitive, by name, as remat sees it)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention  # noqa: PLC0415

    from jaxtrain.models.config import CUDNN_ATTENTION_FWD  # noqa: PLC0415

    policy = REMAT_POLICIES["dots_with_no_batch_dims_saveable"]
    fwd = cudnn_attention._dot_product_attention_fwd_p_wrapper
    assert fwd.name == CUDNN_ATTENTION_FWD  # jax renaming it would silently bring the recompute back
    assert policy(fwd)
    assert not policy(jax.lax.exp_p)
    assert not REMAT_POLICIES["full"](fwd)
