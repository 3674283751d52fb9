"""Pipeline parallelism (jaxtrain.pipeline): equal to a plain scan over the layers, forward and gradients,
with and without a mesh; the schedules' bookkeeping; config errors."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline

L, B, T, D = 8, 8, 4, 16  # T != D so that only the weights have a trailing [D, D]
RULES = {"stages": ("pipeline",), "layers": ("pipeline",), "batch": ("data",)}


def plain_layer(p, c):
    return {**c, "x": c["x"] + jnp.tanh(c["x"] @ p["w"] + p["b"])}


def extras_layer(p, c):
    """Uses a per-row extra, and divides by the row's RMS: zeros fed to an idle stage would give inf/NaN."""
    x = c["x"]
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
    return {**c, "x": x + c["scale"][:, None, None] * jnp.tanh(normed @ p["w"] + p["b"])}


LAYERS = {"plain": plain_layer, "extras": extras_layer}


def make_inputs():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k[0], (L, D, D)) * 0.3, "b": jax.random.normal(k[1], (L, D)) * 0.1}
    carry = {"x": jax.random.normal(k[2], (B, T, D)),
             "scale": jnp.linspace(0.5, 1.5, B),                      # float extra the layer reads
             "positions": jnp.arange(B * T, dtype=jnp.int32).reshape(B, T)}  # int extra passed through
    weights = jax.random.normal(k[3], (B, T, D))  # makes every output element matter to the loss
    return params, carry, weights


def stored(params, stages, repeats):
    """Model-order stacked params ({"w", "b"}: [L, ...]) in the pipeline's layer order."""
    return pipeline.reorder_layers({"blocks": params}, None, pipeline.layer_order(L, stages, repeats))["blocks"]


def value_and_grads(layer, weights, in_model_order=True, **pipe):
    """jitted (params, carry) -> ((loss, final carry), (d params, d x)); plain scan when `pipe` is empty. The
    params (and their gradients) are in the model's layer order, or with in_model_order=False in the pipeline's."""
    def forward(params, x, extras):
        carry = {"x": x, **extras}
        if pipe:
            if in_model_order:
                params = stored(params, pipe["stages"], pipe.get("repeats", 1))
            out = pipeline.run(layer, params, carry, **pipe)
        else:
            out = jax.lax.scan(lambda c, p: (layer(p, c), None), carry, params)[0]
        return jnp.sum(jnp.sin(out["x"]) * weights), out

    grad_fn = jax.value_and_grad(forward, argnums=(0, 1), has_aux=True)

    def f(params, carry):
        extras = {k: v for k, v in carry.items() if k != "x"}
        return grad_fn(params, carry["x"], extras)

    return f


def loss_scale(out, weights) -> float:
    """The magnitude of the terms the loss sums, sum |sin(x) * weights|: the scale its rounding error follows.
    The sum itself cancels (a few tenths against terms summing to hundreds), so a tolerance relative to it
    would hold only on a machine that happens to sum in the reference's order."""
    return float(np.sum(np.abs(np.sin(np.asarray(out["x"], np.float64)) * np.asarray(weights, np.float64))))


def assert_close(actual, expected, rtol=1e-5, scale=None):
    """Every leaf within rtol of the reference, relative to the reference leaf's largest magnitude (or to
    `scale`, for a leaf that is a cancelling sum: loss_scale)."""
    flat_a, tree_a = jax.tree.flatten(actual)
    flat_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e
    for a, e in zip(flat_a, flat_e):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype
        assert np.all(np.isfinite(a)), "non-finite values"
        magnitude = scale if scale is not None else max(float(np.max(np.abs(e))), 1e-30)
        err = float(np.max(np.abs(a.astype(np.float64) - e)))
        assert err <= rtol * magnitude, f"max error {err:.3g} > {rtol} * {magnitude:.3g}"


@pytest.fixture(scope="module")
def reference():
    """reference[layer name]: the plain scan's ((loss, carry), grads), computed once per layer on first use."""
    class Cache(dict):
        def __missing__(self, name):
            params, carry, weights = make_inputs()
            self[name] = jax.jit(value_and_grads(LAYERS[name], weights))(params, carry)
            return self[name]

    return Cache()


@pytest.mark.parametrize("layer,schedule,stages,microbatches,repeats", [
    ("extras", "gpipe", 2, 2, 1),
    ("extras", "gpipe", 2, 4, 1),
    ("extras", "gpipe", 4, 4, 1),
    ("extras", "gpipe", 4, 8, 1),
    ("extras", "gpipe", 4, 2, 1),  # fewer microbatches than stages: allowed, just a big bubble
    ("extras", "circular", 2, 2, 2),
    ("extras", "circular", 2, 4, 2),  # M > S: outputs wait on stage 0 before their next repeat
    ("plain", "gpipe", 2, 4, 1),
    ("plain", "circular", 2, 4, 2),
    ("plain", "gpipe", 1, 2, 1),  # one stage: a plain scan
])
def test_matches_plain_scan(reference, layer, schedule, stages, microbatches, repeats):
    params, carry, weights = make_inputs()
    f = value_and_grads(LAYERS[layer], weights, stages=stages, microbatches=microbatches, schedule=schedule,
                        repeats=repeats)
    (loss, out), grads = jax.jit(f)(params, carry)
    (ref_loss, ref_out), ref_grads = reference[layer]
    assert_close(out, ref_out)  # every leaf, extras included, in the original row order
    assert_close(loss, ref_loss, scale=loss_scale(ref_out, weights))
    assert_close(grads, ref_grads)  # d params and d x


def _mesh():
    return jax.make_mesh((4, 2), ("pipeline", "data"), axis_types=(AxisType.Auto,) * 2)


def _gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Result shapes of every all-gather in compiled HLO text (tuple results give several)."""
    shapes = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(\(.*?\)|\S+)\s+all-gather(?:-start)?\(", line)
        if m:
            shapes += [tuple(int(d) for d in dims.split(",") if d)
                       for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))]
    return shapes


@pytest.mark.parametrize("schedule,microbatches,repeats", [("gpipe", 4, 1), ("circular", 4, 2)])
def test_sharded_over_pipeline_axis(reference, schedule, microbatches, repeats):
    mesh = _mesh()
    params, carry, weights = make_inputs()
    f = value_and_grads(extras_layer, weights, in_model_order=False, stages=4, microbatches=microbatches,
                        schedule=schedule, repeats=repeats)

    def sharded(params, carry):
        with mesh_lib.activation_sharding(mesh, RULES):
            return f(params, carry)

    params = stored(params, 4, repeats)  # the pipeline's order: each device's slice of dim 0 is its stage's chunks
    params = jax.device_put(params, NamedSharding(mesh, P("pipeline")))  # layer dim split over the stages
    carry = jax.device_put(carry, NamedSharding(mesh, P("data")))
    jitted = jax.jit(sharded)
    compiled = jitted.lower(params, carry).compile()
    (loss, out), grads = compiled(params, carry)
    (ref_loss, ref_out), ref_grads = reference["extras"]
    assert_close(out, ref_out)
    assert_close(loss, ref_loss, scale=loss_scale(ref_out, weights))
    assert_close((grads[0], grads[1]), (stored(ref_grads[0], 4, repeats), ref_grads[1]))

    hlo = compiled.as_text()
    assert "collective-permute" in hlo  # the shift between stages
    # The weight gradients stay split over the stages like the weights (nothing gathered them whole).
    assert grads[0]["w"].sharding.spec == P("pipeline")
    assert grads[0]["w"].addressable_shards[0].data.shape == (L // 4, D, D)
    # Each device keeps its own layers: no all-gather yields anything weight-shaped (trailing [D, D], e.g. the
    # full [L, D, D] stack or a stage's [S, L/S, D, D]), and nothing re-lays them out (the circular schedule did,
    # with an all-to-all, while it kept the layers in the model's order).
    weight_like = [s for s in _gathered_shapes(hlo) if s[-2:] == (D, D)]
    assert not weight_like, f"weights all-gathered: {weight_like}"
    assert all(np.prod(s) < L * D * D for s in _gathered_shapes(hlo))  # nor anything as big as them
    assert "all-to-all" not in hlo


def test_gathered_shapes_parser():
    hlo = ("%all-gather.1 = f32[2,4,1,16,16]{4,3,2,0,1} all-gather(%x), dimensions={1}\n"
           "%ag = (f32[8,16]{1,0}, bf16[3]{0}) all-gather-start(%a, %b)\n"
           "%y = f32[2,16,16]{2,1,0} add(%all-gather.1, %z)\n")
    assert _gathered_shapes(hlo) == [(2, 4, 1, 16, 16), (8, 16), (3,)]


def test_bubble_fraction():
    assert pipeline.bubble_fraction(1, 8) == 0.0
    assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert pipeline.bubble_fraction(4, 16) == pytest.approx(3 / 19)
    assert pipeline.bubble_fraction(4, 8, repeats=2) == pytest.approx(3 / 19)  # circular: R*M + S - 1 ticks
    assert pipeline.bubble_fraction(2, 4, 2) < pipeline.bubble_fraction(2, 4, 1)


def test_layer_order_is_stage_major():
    # 8 layers, 2 stages, 2 repeats: chunks of 2; stage 0 runs chunks 0 and 2 (layers 0,1 and 4,5), stage 1 chunks
    # 1 and 3. Contiguous halves of dim 0 are then exactly each stage's layers.
    assert pipeline.layer_order(8, 2, 2) == (0, 1, 4, 5, 2, 3, 6, 7)
    assert pipeline.layer_order(8, 4, 2) == (0, 4, 1, 5, 2, 6, 3, 7)
    assert pipeline.layer_order(8, 4, 1) == tuple(range(8))  # gpipe: the model's order
    assert pipeline.layer_order(6, 1, 4) == tuple(range(6))  # one stage is a plain scan: repeats change nothing
    with pytest.raises(ValueError, match="pipeline.repeats"):
        pipeline.layer_order(6, 2, 2)


def test_reorder_layers_moves_only_the_stacked_leaves():
    adam = collections.namedtuple("adam", "count mu")
    layers = np.arange(8 * 3).reshape(8, 3)
    tree = {"params": {"blocks": {"w": layers}, "embed": np.arange(8)},
            "opt_state": (adam(count=np.zeros(()), mu={"blocks": {"w": layers}, "embed": np.arange(8)}),)}
    order = pipeline.layer_order(8, 2, 2)
    moved = pipeline.reorder_layers(tree, None, order)
    np.testing.assert_array_equal(moved["params"]["blocks"]["w"], layers[list(order)])
    np.testing.assert_array_equal(moved["opt_state"][0].mu["blocks"]["w"], layers[list(order)])
    np.testing.assert_array_equal(moved["params"]["embed"], np.arange(8))  # not stacked: its dim 0 is no layer
    np.testing.assert_array_equal(moved["opt_state"][0].mu["embed"], np.arange(8))
    back = pipeline.reorder_layers(moved, order, None)
    np.testing.assert_array_equal(back["params"]["blocks"]["w"], layers)
    other = pipeline.layer_order(8, 4, 2)  # one pipeline order to another
    np.testing.assert_array_equal(pipeline.reorder_layers(moved, order, other)["params"]["blocks"]["w"],
                                  layers[list(other)])


@pytest.mark.parametrize("args,field", [
    (dict(stages=0), "pipeline.stages"),
    (dict(stages=3), "pipeline.stages"),                               # 8 layers do not split 3 ways
    (dict(stages=4, schedule="circular", repeats=4), "pipeline.repeats"),  # 8 % 16
    (dict(microbatches=3), "pipeline.microbatches"),                   # batch 8 % 3
    (dict(microbatches=0), "pipeline.microbatches"),
    (dict(stages=4, microbatches=2, schedule="circular", repeats=2), "pipeline.microbatches"),  # M < S
    (dict(schedule="1f2b"), "pipeline.schedule"),
    (dict(stages=4, microbatches=2, schedule="1f1b"), "pipeline.microbatches"),  # 1F1B needs M >= S
    (dict(repeats=2), "pipeline.repeats"),                             # gpipe does not repeat
    (dict(repeats=0, schedule="circular"), "pipeline.repeats"),
])
def test_check_rejects(args, field):
    kwargs = dict(n_layers=L, batch=B, stages=2, microbatches=2, schedule="gpipe", repeats=1) | args
    with pytest.raises(ValueError, match=re.escape(field) + ":") as err:
        pipeline.check(**kwargs)
    assert "\n" not in str(err.value)
    params, carry, _ = make_inputs()
    with pytest.raises(ValueError, match=re.escape(field)):  # run() checks too, before tracing anything
        pipeline.run(plain_layer, params, carry, **{k: v for k, v in kwargs.items() if k not in ("n_layers", "batch")})


def test_check_accepts():
    pipeline.check(n_layers=8, batch=8, stages=4, microbatches=8, schedule="gpipe", repeats=1)
    pipeline.check(n_layers=8, batch=8, stages=4, microbatches=2, schedule="gpipe", repeats=1)
    pipeline.check(n_layers=8, batch=8, stages=2, microbatches=4, schedule="circular", repeats=2)
    pipeline.check(n_layers=8, batch=8, stages=4, microbatches=2, schedule="circular", repeats=1)
