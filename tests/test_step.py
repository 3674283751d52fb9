"""The train step (gradient accumulation, learning) and the optimizer (weight-decay mask, schedules)."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxtrain import config as config_lib
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain import optim
from jaxtrain.tools.plan.collectives import collectives
from jaxtrain.tools.plan.planner import per_device_bytes
from jaxtrain.config import base_config
from jaxtrain.data import pipeline
from jaxtrain.models import transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain import trainer as trainer_lib
from helpers import trainer_on


def by_path(tree):
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def adam_mu(opt_state):
    (adam,) = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    return adam.mu


def build(cfg, devices=None):
    facts = config_lib.validate(cfg, jax.device_count())
    return trainer_lib.build_trainer(cfg, facts, devices=devices)


# --- Gradient accumulation --------------------------------------------------------------------------------


def test_microbatches_equal_one_big_batch(tiny_config, tiny_data_dir):
    batch = next(pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=16, seed=0))
    # Make the microbatches (rows 0,4,8,12 / 1,5,9,13 / ...) hold very different numbers of scored tokens,
    # so that normalising per microbatch instead of by the whole batch's token count would show.
    batch["tokens"][0, 4:] = batch["segment_ids"][0, 4:] = batch["positions"][0, 4:] = 0
    batch["tokens"][4, 10:] = batch["segment_ids"][4, 10:] = batch["positions"][4, 10:] = 0

    lr = 3e-3
    results = {}
    for n in (1, 4):
        # Mesh 2x2x2: each microbatch of 4 rows still spans the 4 data-parallel shards.
        # eps: see the comment on the parameter check below.
        cfg = tiny_config(
            **{
                "train.batch_size": 16,
                "train.microbatches": n,
                "optim.warmup_steps": 0,
                "optim.lr": lr,
                "optim.eps": 0.1,
                "mesh.data": 2,
                "mesh.fsdp": 2,
                "mesh.tensor": 2,
            }
        )
        trainer = build(cfg)
        state = trainer.init()
        before = by_path(state["params"])
        if n > 1:  # each data replica accumulates on its own copy: the gradients cross `data` once, not 4 times
            global_batch = trainer_lib.global_batch(batch, trainer.batch_sharding)
            text = trainer.train_step.lower(state, global_batch).compile().as_text()
            mesh_shape = {a: trainer.mesh.shape[a] for a in mesh_lib.AXES}
            over_data = [op for op in collectives(text, mesh_shape) if "data" in op["axes"]]
            assert {op["kind"] for op in over_data} == {"all-reduce"}
            assert sum(op["bytes"] for op in over_data) == pytest.approx(per_device_bytes(state["params"]), rel=0.01)
        state, metrics = trainer.train_step(state, trainer_lib.global_batch(batch, trainer.batch_sharding))
        results[n] = before, jax.device_get(state), jax.device_get(metrics)

    before, one, m1 = results[1]
    _, four, m4 = results[4]
    assert bool(m1["finite"]) and bool(m4["finite"])
    assert float(m1["tokens"]) == float(m4["tokens"]) < 16 * 31 - 40  # the padding above removed tokens
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-6)

    # The accumulated gradient itself: after one step Adam's first moment is (1 - b1) * g (unclipped here,
    # grad_norm < clip_norm), whatever the lr. Relative to each tensor's largest entry.
    assert float(m1["grad_norm"]) < cfg.optim.clip_norm
    mu1, mu4 = by_path(adam_mu(one["opt_state"])), by_path(adam_mu(four["opt_state"]))
    for k in mu1:
        assert np.abs(mu4[k] - mu1[k]).max() <= 1e-6 * np.abs(mu1[k]).max(), k

    # The parameters. AdamW's first update is lr * g / (|g| + eps) (+ decay): about lr for every element
    # whatever its gradient, so "relative to the parameter" means nothing; the update's scale is lr. With
    # the default eps (1e-8) an element whose gradient is at float-rounding level (|g| ~ eps) has a
    # first update anywhere in [-lr, lr], and reduction-order noise alone (~3e-7 of the largest gradient,
    # the same for any two summation orders) moves it by ~1e-3 * lr: not a property of accumulation.
    # eps = 0.1 makes the update a smooth function of g (slope <= lr / eps), so a 1e-6 relative gradient
    # agreement must show as params within 1e-6 * lr, plus one float32 rounding of the new value.
    p1, p4 = by_path(one["params"]), by_path(four["params"])
    for k in p1:
        moved = np.abs(p1[k] - before[k]).max()
        assert moved > 1e-4 * lr, k  # the step did move this tensor (100x the tolerance below)
        tol = 1e-6 * lr + np.spacing(np.abs(p1[k]))
        assert np.all(np.abs(p4[k] - p1[k]) <= tol), (k, np.abs(p4[k] - p1[k]).max() / lr)


# --- Learning ---------------------------------------------------------------------------------------------


def test_overfits_one_batch(tiny_config, tiny_data_dir):
    batch = next(pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=8, seed=1))
    steps = 80
    cfg = tiny_config(
        **{"train.steps": steps, "optim.lr": 1e-2, "optim.warmup_steps": 10, "optim.schedule": "constant"}
    )
    # One device: the fastest way to run 80 steps of a 40k-parameter model on 2 cores.
    trainer = trainer_on(
        cfg, {"data": 1, "fsdp": 1, "tensor": 1}, mesh_lib.resolve_rules("dp_fsdp_tp"), devices=jax.devices()[:1]
    )
    state = trainer.init()
    initial = by_path(state["params"])
    gb = trainer_lib.global_batch(batch, trainer.batch_sharding)
    losses, lrs = [], []
    for step in range(1, steps + 1):
        state, metrics = trainer.train_step(state, gb)
        losses.append(metrics["loss"])
        lrs.append(metrics["lr"])
        if step == 1:  # warmup starts at lr 0: the first step leaves the weights where they were
            after = by_path(state["params"])
            assert all(np.array_equal(after[k], initial[k]) for k in initial)
    losses, lrs = np.array(jax.device_get(losses)), np.array(jax.device_get(lrs))
    # metrics["lr"] of step k is the lr that step applied: schedule(k - 1), 10 warmup steps to 1e-2.
    np.testing.assert_allclose(
        lrs[:12], [0, 1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7e-3, 8e-3, 9e-3, 1e-2, 1e-2], rtol=1e-6, atol=1e-9
    )
    assert int(state["step"]) == steps
    assert losses[0] > 5.0  # starts near ln(512) = 6.24
    assert losses[-1] < 0.1, losses[::10]
    # eval_step (summed loss, token count, summed metrics) sees the same memorised batch the same way.
    loss_sum, count, metrics = jax.device_get(trainer.eval_step(state["params"], None, gb))
    assert metrics == {}
    assert loss_sum / count < 0.1


# --- Optimizer: weight-decay mask --------------------------------------------------------------------------

TINY_MODEL = ModelConfig(
    vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24
)
NORM_SCALES = {"blocks/attn_norm/scale", "blocks/mlp_norm/scale", "final_norm/scale"}


def test_weight_decay_mask_excludes_exactly_norm_scales():
    for tie in (True, False):
        cfg = dataclasses.replace(TINY_MODEL, tie_embeddings=tie)
        abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda cfg=cfg: transformer.build(cfg, 0))))
        mask = {k: bool(v) for k, v in by_path(optim.decay_mask(abstract)).items()}
        assert {k for k, v in mask.items() if not v} == NORM_SCALES
        assert {k for k, v in mask.items() if v} == (
            {
                "embed",
                "blocks/attn/wq",
                "blocks/attn/wk",
                "blocks/attn/wv",
                "blocks/attn/wo",
                "blocks/mlp/w_gate",
                "blocks/mlp/w_up",
                "blocks/mlp/w_down",
            }
            | (set() if tie else {"unembed"})
        )


def test_weight_decay_applies_to_weights_not_norms():
    """With zero gradients Adam's update is 0, so one step is pure decoupled weight decay:
    p <- p * (1 - lr * wd) for decayed weights, unchanged for norm scales."""
    o = base_config().optim
    o.update(lr=0.5, warmup_steps=0, schedule="constant", weight_decay=0.1)
    tx = optim.make_optimizer(o, total_steps=10)
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: transformer.build(TINY_MODEL, 0))))
    rng = np.random.default_rng(0)  # random values (norm scales too, so that decaying them would show)
    params = jax.tree.map(lambda x: rng.normal(1.0, 0.5, x.shape).astype(np.float32), abstract)
    grads = jax.tree.map(np.zeros_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = by_path(optax.apply_updates(params, updates))
    old = by_path(params)
    for k in old:
        want = old[k] if k in NORM_SCALES else old[k] * (1 - 0.5 * 0.1)
        np.testing.assert_allclose(new[k], want, rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("max_norm", [0.5, 100.0], ids=["clips", "leaves_alone"])
def test_clip_matches_optax_and_uses_the_norm_it_is_given(max_norm):
    """optim.clip_by_global_norm equals optax's (to rounding: it scales instead of dividing), keeps its state (so
    checkpoints do not change), and clips by the `global_norm` the step passes rather than recomputing it."""
    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(64, 32)).astype(np.float32), "b": {"c": rng.normal(size=(7,)).astype(np.float32)}}
    norm = optax.tree.norm(grads)
    ours, reference = optim.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    assert jax.tree.structure(ours.init(grads)) == jax.tree.structure(reference.init(grads))
    want, _ = reference.update(grads, reference.init(grads))
    for given in (None, norm):  # computes the norm itself, or takes the caller's
        got, _ = ours.update(grads, ours.init(grads), global_norm=given)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), got, want)
    halved, _ = ours.update(grads, ours.init(grads), global_norm=2 * norm)
    if max_norm < norm:  # a norm twice the true one clips twice as hard
        jax.tree.map(lambda h, w: np.testing.assert_allclose(h, w / 2, rtol=1e-6), halved, want)
    else:
        jax.tree.map(np.testing.assert_array_equal, halved, grads)  # unclipped is exact


def test_optimizer_state_tree_is_optax_clip_then_adamw():
    """The checkpointed optimizer state keeps the layout of optax.chain(clip_by_global_norm, adamw)."""
    o = base_config().optim
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: transformer.build(TINY_MODEL, 0))))
    reference = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                            optax.adamw(optim.schedule(o, 10), weight_decay=o.weight_decay, mask=optim.decay_mask))
    ours = optim.make_optimizer(o, total_steps=10)
    assert jax.tree.structure(jax.eval_shape(ours.init, params)) == jax.tree.structure(
        jax.eval_shape(reference.init, params))


# --- Optimizer: schedules ----------------------------------------------------------------------------------


def schedule(kind, warmup=10, total=100, lr=0.01, ratio=0.1, decay_fraction=0.2):
    o = base_config().optim
    o.update(lr=lr, warmup_steps=warmup, schedule=kind, min_lr_ratio=ratio, decay_fraction=decay_fraction)
    s = optim.schedule(o, total)
    return lambda step: float(s(step))


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "constant"])
def test_schedule_warmup(kind):
    s = schedule(kind)
    assert s(0) == 0.0
    assert s(5) == pytest.approx(0.005, rel=1e-6)
    assert s(10) == pytest.approx(0.01, rel=1e-6)
    values = [s(i) for i in range(11)]
    assert all(a < b for a, b in itertools.pairwise(values))


@pytest.mark.parametrize(
    "kind, at_40",
    [
        ("cosine", 0.01 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi / 3)))),  # 30 of 90 decay steps: cos(pi/3)
        ("linear", 0.01 * (1 - 0.9 / 3)),
        ("wsd", 0.01),  # still stable
    ],
)
def test_decaying_schedules_reach_the_floor(kind, at_40):
    s = schedule(kind)
    assert s(40) == pytest.approx(at_40, rel=1e-5)
    assert s(100) == pytest.approx(0.001, rel=1e-5)  # lr * min_lr_ratio at the end
    assert s(150) == pytest.approx(0.001, rel=1e-5)  # and stays there
    after = [s(i) for i in range(10, 101)]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(after))  # never rises after warmup


def test_constant_schedule_stays_constant():
    s = schedule("constant")
    assert all(s(i) == pytest.approx(0.01, rel=1e-6) for i in (10, 11, 50, 99, 100, 1000))
    assert schedule("constant", warmup=0)(0) == pytest.approx(0.01, rel=1e-6)


def test_wsd_holds_peak_until_the_decay_window():
    # 90 steps after warmup, decay_fraction 0.2 -> the last 18 steps (82..100) decay linearly to the floor.
    s = schedule("wsd")
    assert all(s(i) == pytest.approx(0.01, rel=1e-6) for i in range(10, 83))
    assert s(83) < 0.01
    assert s(91) == pytest.approx(0.01 - 0.009 * 9 / 18, rel=1e-5)
    assert s(100) == pytest.approx(0.001, rel=1e-5)


@pytest.mark.parametrize("platform, primitive", [("cpu", "cond"), ("gpu", "select_n"), ("tpu", "select_n")])
def test_a_non_finite_step_keeps_the_old_state_as_a_cond_on_cpu_and_a_select_elsewhere(platform, primitive):
    """The guard's two forms (step.unless_non_finite): the same values, a cond only where it is cheaper (CPU)."""
    from jaxtrain.step import unless_non_finite

    old = {"w": jnp.arange(4.0), "m": (jnp.ones(3), jnp.zeros((), jnp.int32))}

    def guarded(finite, scale):
        def update(_):
            return jax.tree.map(lambda x: (x * scale + 1).astype(x.dtype), old)
        return unless_non_finite(finite, update, old, platform)

    assert primitive in str(jax.make_jaxpr(guarded)(True, 2.0))
    assert ("cond" in str(jax.make_jaxpr(guarded)(True, 2.0))) == (platform == "cpu")
    kept = jax.jit(guarded)(False, jnp.nan)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), kept, old)
    applied = jax.jit(guarded)(True, 2.0)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, (b * 2 + 1).astype(b.dtype)), applied, old)
