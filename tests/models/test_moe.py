"""Mixture of experts: routing, capacity and dispatch against a plain loop reference, gradients against a dense
reference, expert sharding on 8 devices against one device, and config guards; dropless routing (ragged_dot)
against the dense reference, alone, under vmap and on 8 devices."""

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxtrain import hooks as hooks_lib
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.models import moe
from jaxtrain.models.transformer import ModelConfig
from helpers import trainer_on

SMALL = {"vocab_size": 64, "d_model": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "head_dim": 4, "d_ff": 12,
         "n_experts": 4, "moe_top_k": 2}


def build(seed=0, std=0.5, **overrides):
    """A MoE layer with every weight drawn with `std`, so that routing is decisive and outputs are O(1).
    -> (cfg, graphdef, params as a pure dict of f32 numpy arrays)."""
    cfg = ModelConfig(**{**SMALL, **overrides})
    layer = nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(params=seed)))  # shapes only: eager init is slow here
    graphdef, state = nnx.split(layer)
    rng = np.random.default_rng(seed + 100)
    params = jax.tree.map(lambda p: rng.normal(0.0, std, p.shape).astype(np.float32), nnx.to_pure_dict(state))
    return cfg, graphdef, params


def apply(graphdef, params, x):
    """-> (y, the layer's load-balancing loss and dropped fraction over the whole batch)."""
    y, stats = nnx.merge(graphdef, params)(x)
    assert all(v.shape[0] == x.shape[0] for v in jax.tree.leaves(stats))  # per row
    return y, moe.summarize(stats)


def summarized_route(logits, top_k, capacity):
    dispatch, combine, stats = moe.route(logits, top_k, capacity)
    return dispatch, combine, moe.summarize(stats)


# One compile each instead of many eager ops (slow to dispatch on a busy 2-core machine).
run = jax.jit(apply, static_argnums=0)
route = jax.jit(summarized_route, static_argnums=(1, 2))


# --- Plain references --------------------------------------------------------------------------------


def swiglu(x, params, e):
    gate, up = x @ params["w_gate"][e], x @ params["w_up"][e]
    return (gate / (1 + np.exp(-gate)) * up) @ params["w_down"][e]


def loop_reference(x, params, top_k, capacity_factor):
    """Float64 loops: per group, choice rank by choice rank, token by token, with explicit capacity counters.
    -> (y, load_balance_loss, dropped_fraction)."""
    x = np.asarray(x, np.float64)
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    B, T, _ = x.shape
    E = params["w_router"].shape[1]
    cap = max(1, min(T, math.ceil(capacity_factor * T * top_k / E)))
    y = np.zeros_like(x)
    chose = np.zeros(E)
    prob_sum = np.zeros(E)
    dropped = 0
    for b in range(B):
        logits = x[b] @ params["w_router"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        prob_sum += probs.sum(0)
        top = [np.argsort(-probs[t], kind="stable")[:top_k] for t in range(T)]
        used = np.zeros(E, int)
        for j in range(top_k):
            for t in range(T):
                e = top[t][j]
                chose[e] += 1
                if used[e] == cap:
                    dropped += 1
                    continue
                used[e] += 1
                gate = probs[t, e] / probs[t, top[t]].sum()
                y[b, t] += gate * swiglu(x[b, t], params, e)
    n = B * T * top_k
    return y, E * np.sum(chose / n * prob_sum / (B * T)), dropped / n


def dense_reference(params, x, top_k, renormalize=True, act=jax.nn.silu):
    """jax.numpy, no capacity: every expert runs on every token, weighted by the top-k gates (renormalised, or the
    raw probabilities); zero for the experts a token did not choose."""
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, params["w_router"]), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    gates = top_p / top_p.sum(-1, keepdims=True) if renormalize else top_p
    weights = jnp.einsum("btk,btke->bte", gates, jax.nn.one_hot(top_i, probs.shape[-1]))
    gate = jnp.einsum("btd,edf->btef", x, params["w_gate"])
    up = jnp.einsum("btd,edf->btef", x, params["w_up"])
    out = jnp.einsum("btef,efd->bted", act(gate) * up, params["w_down"])
    E = probs.shape[-1]
    f = jax.nn.one_hot(top_i, E).sum(axis=(0, 1, 2)) / top_i.size  # fraction of the assignments per expert
    lb = E * jnp.sum(f * probs.mean(axis=(0, 1)))
    return jnp.einsum("bte,bted->btd", weights, out), lb


# --- Routing and dispatch ----------------------------------------------------------------------------


@pytest.mark.parametrize("capacity_factor, dropping", [(4.0, False), (0.5, True)])
def test_matches_loop_reference(capacity_factor, dropping):
    cfg, graphdef, params = build(moe_capacity_factor=capacity_factor)
    x = np.random.default_rng(1).normal(size=(3, 8, cfg.d_model)).astype(np.float32)

    y, aux = run(graphdef, params, x)
    ref_y, ref_lb, ref_dropped = loop_reference(x, params, cfg.moe_top_k, capacity_factor)

    assert y.shape == x.shape and y.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 and v.shape == () for v in aux.values())
    np.testing.assert_allclose(np.asarray(y), ref_y, rtol=0, atol=1e-5)
    np.testing.assert_allclose(float(aux["load_balance_loss"]), ref_lb, rtol=1e-6)
    # dropped_fraction counts whole assignments: the f32 quotient equals the reference's exactly.
    assert float(aux["dropped_fraction"]) == np.float32(ref_dropped)
    assert (ref_dropped > 0) == dropping
    # The reference result depends on the routing at all (not a trivially small output).
    assert np.abs(ref_y).max() > 0.1


def test_routing_groups_route_like_sequences_of_their_own():
    """moe_group_tokens=4 on 8-token sequences: capacity is per group and groups do not compete for slots, so it
    equals whole-sequence routing of the same tokens cut into 4-token rows (capacity 0.5: tokens are dropped)."""
    cfg, graphdef, params = build(moe_capacity_factor=0.5)
    _, grouped_graphdef, _ = build(moe_capacity_factor=0.5, moe_group_tokens=4)
    x = np.random.default_rng(3).normal(size=(3, 8, cfg.d_model)).astype(np.float32)
    y, aux = run(grouped_graphdef, params, x)
    want_y, want_aux = run(graphdef, params, x.reshape(6, 4, cfg.d_model))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y).reshape(x.shape), rtol=0, atol=1e-6)
    for k in ("load_balance_loss", "dropped_fraction"):
        assert float(aux[k]) == pytest.approx(float(want_aux[k]), rel=1e-6), k
    assert float(aux["dropped_fraction"]) > 0
    # Not the whole-sequence routing: there, late tokens take slots the early ones left free in the other half.
    assert np.abs(np.asarray(run(graphdef, params, x)[0]) - np.asarray(y)).max() > 1e-3
    # A length the group size does not divide (decoding: one token) routes as one group.
    assert run(grouped_graphdef, params, x[:, :1])[0].shape == (3, 1, cfg.d_model)


def test_first_choices_fill_capacity_before_second_choices():
    # 4 tokens, 2 experts, top-2, capacity 2. Tokens 0 and 1 prefer expert 0, tokens 2 and 3 prefer expert 1.
    # First choices fill both experts, so every second choice is dropped; a token-major order would instead
    # give tokens 0 and 1 both experts and tokens 2 and 3 nothing.
    logits = jnp.array([[[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 3.0]]])
    dispatch, combine, aux = route(logits, top_k=2, capacity=moe.capacity(0.5, 4, 2, 2))
    assert dispatch.shape == (1, 4, 2, 2)
    expected = np.zeros((1, 4, 2, 2))
    expected[0, 0, 0, 0] = expected[0, 1, 0, 1] = expected[0, 2, 1, 0] = expected[0, 3, 1, 1] = 1
    np.testing.assert_array_equal(np.asarray(dispatch), expected)
    # Gates are the top-2 probs renormalised (here: all probs), and dropped gates are not handed on.
    probs = np.asarray(jax.nn.softmax(logits, -1))
    np.testing.assert_allclose(np.asarray(combine).sum(-1), expected.sum(-1) * probs, rtol=1e-6)
    assert float(aux["dropped_fraction"]) == 0.5


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_group_routing_equals_deepseek_v3s_router(renormalize):
    """moe_score=sigmoid with groups (DeepSeek-V3): the chosen experts and gates equal transformers'
    DeepseekV3TopkRouter's (16 experts in 4 groups, the best 2 groups, top 4, scale 2.5), gates renormalised or
    not; probs (for the balance statistics) are the scores normalised to sum to 1."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, norm_topk_prob=renormalize)
    router = DeepseekV3TopkRouter(hf)
    rng = np.random.default_rng(3)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(rng.normal(size=(16, 16)), dtype=torch.float32))
    x = rng.normal(size=(64, 16)).astype(np.float32)
    logits, want_gates, want_idx = (t.detach().numpy() for t in router(torch.tensor(x)))
    probs, idx, gates = moe.choose(jnp.asarray(logits), 4, renormalize, score="sigmoid", groups=4, topk_groups=2,
                                   scale=2.5)
    order = np.argsort(np.asarray(idx), axis=-1)  # transformers' top-k is unsorted: compare as sets of pairs
    want_order = np.argsort(want_idx, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  np.take_along_axis(want_idx, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(gates), order, -1),
                               np.take_along_axis(want_gates, want_order, -1), rtol=1e-6)
    groups_used = {tuple(sorted(set(row // 4))) for row in np.asarray(idx)}
    assert all(len(g) <= 2 for g in groups_used) and len(groups_used) > 1
    sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
    np.testing.assert_allclose(np.asarray(probs), sig / sig.sum(-1, keepdims=True), rtol=1e-5)


def test_capacity_formula():
    assert moe.capacity(1.25, 8, 2, 4) == 5  # ceil(5.0)
    assert moe.capacity(1.1, 10, 1, 1) == 10  # 1.1 * 10 is 11.000000000000002 in floats; clamped to T anyway
    assert moe.capacity(1.1, 20, 1, 2) == 11  # not 12
    assert moe.capacity(0.01, 8, 1, 8) == 1  # at least one slot
    assert moe.capacity(100.0, 8, 2, 4) == 8  # at most one slot per token


def test_load_balance_loss_and_max_load_are_one_when_balanced_and_e_when_collapsed():  # min_load 1 and 0
    E = 4
    # Every token routes to its own expert with the same confidence: balanced, so the loss is exactly 1.
    balanced = jnp.eye(E)[None] * 3.0
    assert float(route(balanced, 1, 4)[2]["load_balance_loss"]) == pytest.approx(1.0, rel=1e-6)
    assert float(route(balanced, 1, 4)[2]["max_load"]) == pytest.approx(1.0, rel=1e-6)
    assert float(route(balanced, 1, 4)[2]["min_load"]) == pytest.approx(1.0, rel=1e-6)
    # Every token sends everything to expert 0: f_0 = 1, P_0 ~ 1, loss ~ E; that expert has E even shares.
    collapsed = jnp.zeros((2, 5, E)).at[..., 0].set(30.0)
    aux = route(collapsed, 1, moe.capacity(1.0, 5, 1, E))[2]
    assert float(aux["load_balance_loss"]) == pytest.approx(E, rel=1e-5)
    assert float(aux["max_load"]) == pytest.approx(E, rel=1e-6)
    assert float(aux["min_load"]) == 0
    assert float(aux["dropped_fraction"]) == pytest.approx(1 - 2 / 5)  # capacity 2 of the 5 tokens per group


# --- Gradients and precision -------------------------------------------------------------------------


def test_gradients_match_dense_reference():
    cfg, graphdef, params = build(moe_capacity_factor=4.0)  # ample: nothing dropped, so dense == MoE
    x = np.random.default_rng(2).normal(size=(2, 6, cfg.d_model)).astype(np.float32)
    probe = np.random.default_rng(3).normal(size=x.shape).astype(np.float32)

    def loss(params, x):
        y, aux = apply(graphdef, params, x)
        return jnp.sum(y * probe) + 3.0 * aux["load_balance_loss"]

    def ref_loss(params, x):
        y, lb = dense_reference(params, x, cfg.moe_top_k)
        return jnp.sum(y * probe) + 3.0 * lb

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(w).max())
    # The router learns through the gates and the balancing loss: its gradient is not zero.
    assert np.abs(np.asarray(got[0]["w_router"])).max() > 1e-3


def test_bfloat16_compute():
    cfg, graphdef, params = build(moe_capacity_factor=4.0)
    x = np.random.default_rng(4).normal(size=(2, 8, cfg.d_model)).astype(np.float32)
    _, graphdef16, _ = build(moe_capacity_factor=4.0, dtype="bfloat16")
    y32, aux32 = run(graphdef, params, x)
    y16, aux16 = run(graphdef16, params, jnp.asarray(x, jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16 and all(v.dtype == jnp.float32 for v in aux16.values())
    scale = float(jnp.abs(y32).max())
    assert float(jnp.abs(y16.astype(jnp.float32) - y32).max()) < 3e-2 * scale
    # The router runs in f32 on the bf16-rounded input: the balancing loss barely moves.
    assert float(aux16["load_balance_loss"]) == pytest.approx(float(aux32["load_balance_loss"]), rel=2e-2)


# --- Expert sharding ---------------------------------------------------------------------------------


def test_expert_sharding_matches_single_device():
    cfg, graphdef, params = build(n_experts=8, moe_capacity_factor=1.0)  # capacity 2 of 8: drops included
    x = np.random.default_rng(5).normal(size=(8, 8, cfg.d_model)).astype(np.float32)
    probe = np.random.default_rng(6).normal(size=x.shape).astype(np.float32)

    def loss(params, x):
        y, aux = apply(graphdef, params, x)
        return jnp.sum(y * probe) + aux["load_balance_loss"], (y, aux)

    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, (want_y, want_aux)), want_grads = jax.jit(step)(params, x)
    assert float(want_aux["dropped_fraction"]) > 0

    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    rules = {"batch": ("data", "expert"), "experts": ("expert",), "act_experts": ("expert",)}
    layer = nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(params=0)))
    names = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer)))
    param_shardings = mesh_lib.tree_shardings(params, names, mesh, rules)
    assert param_shardings["w_gate"].spec == P("expert", None, None)
    assert param_shardings["w_down"].spec == P("expert", None, None)
    assert param_shardings["w_router"].spec == P(None, None)
    sharded_params = jax.device_put(params, param_shardings)
    sharded_x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))

    with mesh_lib.activation_sharding(mesh, rules):  # read while tracing
        compiled = jax.jit(step).lower(sharded_params, sharded_x).compile()
    (_, (y, aux)), grads = compiled(sharded_params, sharded_x)

    hlo = compiled.as_text()
    assert any(op in hlo for op in ("all-to-all", "all-gather", "reduce-scatter", "collective-permute"))
    # Tokens travel to the experts, not the experts to the tokens: no device ever holds all 8 experts' weights
    # (without the activation constraints XLA all-gathers them).
    assert "f32[8,8,12]" not in hlo and "f32[8,12,8]" not in hlo
    assert tuple(grads[0]["w_gate"].sharding.spec)[:1] == ("expert",)  # the gradients stay with their experts
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=0, atol=1e-5)
    for key in want_aux:
        np.testing.assert_allclose(float(aux[key]), float(want_aux[key]), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(w).max())


# --- Dropless routing --------------------------------------------------------------------------------

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


@pytest.mark.parametrize("routing", ["dropless", "capacity"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_matches_dense_reference(routing, renormalize, act):
    """Dropless (and capacity with room for every token) is the dense reference: every expert on every token,
    weighted by the top-k gates, renormalised or raw (Qwen3-MoE's norm_topk_prob=False), either activation."""
    cfg, graphdef, params = build(moe_routing=routing, moe_capacity_factor=4.0, moe_renormalize=renormalize,
                                  mlp_activation=act)
    x = np.random.default_rng(7).normal(size=(3, 8, cfg.d_model)).astype(np.float32)
    y, aux = run(graphdef, params, x)
    want, want_lb = jax.jit(dense_reference, static_argnums=(2, 3, 4))(params, x, cfg.moe_top_k, renormalize,
                                                                       ACTIVATIONS[act])
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(aux["load_balance_loss"]), float(want_lb), rtol=1e-6)
    assert float(aux["dropped_fraction"]) == 0
    assert np.abs(np.asarray(want)).max() > 0.1


@pytest.mark.parametrize("renormalize", [True, False])
def test_dropless_gradients_match_dense_reference(renormalize):
    cfg, graphdef, params = build(moe_routing="dropless", moe_renormalize=renormalize)
    x = np.random.default_rng(8).normal(size=(2, 6, cfg.d_model)).astype(np.float32)
    probe = np.random.default_rng(9).normal(size=x.shape).astype(np.float32)

    def loss(params, x):
        y, aux = apply(graphdef, params, x)
        return jnp.sum(y * probe) + 3.0 * aux["load_balance_loss"]

    def ref_loss(params, x):
        y, lb = dense_reference(params, x, cfg.moe_top_k, renormalize)
        return jnp.sum(y * probe) + 3.0 * lb

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(w).max())
    assert np.abs(np.asarray(got[0]["w_router"])).max() > 1e-3


@pytest.mark.parametrize("sizes", [[5, 0, 70, 1], [0, 0, 0, 0], [40, 40, 40, 30], [0, 0, 10, 140]],
                         ids=["uneven", "none", "full", "last_tile_moved_back"])
def test_cpu_grouped_matmuls_equal_xla_ragged_dot_and_multiply_only_routed_rows(sizes):
    """jaxtrain.models.cpu_grouped (dropless on XLA:CPU): the forward and the weight gradient equal
    jax.lax.ragged_dot's and ragged_dot_general's on uneven groups (one empty, one over a tile), rows past the
    groups' sum (padding) included, and a last group whose final tile is moved back to stay in the buffer
    (overlapping its previous tile: counted once); and the compiled forward's dot is one tile's."""
    from jaxtrain.models import cpu_grouped

    rng = np.random.default_rng(0)
    x, g = (jnp.asarray(rng.normal(size=(150, n)), jnp.float32) for n in (16, 24))
    w = jnp.asarray(rng.normal(size=(4, 16, 24)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(np.asarray(jax.jit(cpu_grouped.ragged_dot)(x, w, sizes)),
                               np.asarray(jax.lax.ragged_dot(x, w, sizes)), rtol=1e-5, atol=1e-5)
    want = jax.lax.ragged_dot_general(x, g, sizes, moe._RAGGED_CONTRACTING)
    np.testing.assert_allclose(np.asarray(jax.jit(cpu_grouped.ragged_weight_grad)(x, g, sizes)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)
    # The fused expert MLP (gate-and-up in 2 tensor blocks, SiLU, down), forward and every gradient, against the
    # same MLP through XLA's ragged_dot.
    gate_up = jnp.asarray(rng.normal(size=(4, 16, 2, 12)), jnp.float32)
    down = jnp.asarray(rng.normal(size=(4, 12, 16)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(150, 16)), jnp.float32)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * probe), argnums=(0, 1, 2)))

    got = loss(lambda r, a, b: cpu_grouped.expert_mlp(r, sizes, a, b, jax.nn.silu))(x, gate_up, down)
    with mesh_lib.activation_sharding(mesh_lib.make_mesh({"expert": 2}), {"experts": ("expert",)}):  # XLA's
        assert not moe.tiled_here("xla")
        want = loss(lambda r, a, b: moe.expert_mlp(r, sizes, a, b, jax.nn.silu))(x, gate_up, down)
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=1e-5, atol=1e-4 * max(1, np.abs(w_).max()))

    hlo = jax.jit(cpu_grouped.ragged_dot).lower(x, w, sizes).compile().as_text()
    assert re.search(rf"f32\[{cpu_grouped.TILE},24\]" + r"\S* dot\(", hlo) or "f32[64,24]" in hlo
    assert "f32[150,96]" not in hlo and "f32[4,150,24]" not in hlo


def test_dropless_stats_count_every_choice_and_drop_nothing():
    """Per row: "routed" = how many of the row's top-k choices name each expert, "prob" the summed
    probabilities, "dropped" 0. Expert 0 is never chosen here (an empty group for ragged_dot); one expert takes
    more than capacity routing could give it."""
    cfg, graphdef, params = build(n_experts=6, moe_routing="dropless")
    rng = np.random.default_rng(10)
    x = rng.normal(size=(3, 8, cfg.d_model)).astype(np.float32)
    x[..., 0] = 4.0 + np.abs(x[..., 0])
    params["w_router"][0] = 0.0
    params["w_router"][0, 0] = -10.0  # expert 0's logit is about -40 on every token
    params["w_router"][0, 1] = 2.0  # expert 1 is everyone's first choice
    y, stats = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
    assert set(stats) == {"routed", "prob", "dropped", "tokens"}
    assert stats["routed"].shape == stats["prob"].shape == (3, 6) and stats["dropped"].shape == (3,)

    probs = np.asarray(jax.nn.softmax(x.astype(np.float64) @ params["w_router"], axis=-1))
    top = np.argsort(-probs, axis=-1, kind="stable")[..., :cfg.moe_top_k]
    want_routed = np.stack([np.bincount(top[b].ravel(), minlength=6) for b in range(3)])
    np.testing.assert_array_equal(np.asarray(stats["routed"]), want_routed)
    assert want_routed[:, 0].sum() == 0 and want_routed[:, 1].min() == 8  # more than capacity(1.25, 8, 2, 6) = 4
    np.testing.assert_array_equal(np.asarray(stats["dropped"]), 0)
    np.testing.assert_array_equal(np.asarray(stats["tokens"]), 8)
    np.testing.assert_allclose(np.asarray(stats["prob"]), probs.sum(1), rtol=1e-5)
    assert float(moe.summarize(stats)["dropped_fraction"]) == 0
    want, _ = dense_reference(params, x, cfg.moe_top_k)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_dropless_under_nested_vmap_equals_each_copy():
    """A pipeline runs the layer under two vmaps (stages, and weight copies per data replica), with a group size
    per copy: outputs and gradients of each copy are what it gives alone (jax 0.10's ragged_dot alone fails to
    lower on CPU under two vmaps)."""
    cfg, graphdef, params = build(moe_routing="dropless", mlp_activation="gelu_tanh")
    rng = np.random.default_rng(11)
    copies = [jax.tree.map(lambda p: rng.normal(0.0, 0.5, p.shape).astype(np.float32), params) for _ in range(4)]
    stacked = jax.tree.map(lambda *c: np.stack(c).reshape(2, 2, *c[0].shape), *copies)
    x = rng.normal(size=(2, 2, 2, 5, cfg.d_model)).astype(np.float32)
    probe = rng.normal(size=x.shape[2:]).astype(np.float32)

    def loss(p, x):
        y, stats = nnx.merge(graphdef, p)(x)
        return jnp.sum(y * probe) + moe.summarize(stats)["load_balance_loss"], y

    nested = jax.vmap(jax.vmap(jax.value_and_grad(loss, has_aux=True)))
    (_, ys), grads = jax.jit(nested)(stacked, x)
    single = jax.jit(jax.value_and_grad(loss, has_aux=True))
    for i, p in enumerate(copies):
        (_, y), g = single(p, x[i // 2, i % 2])
        np.testing.assert_allclose(np.asarray(ys[i // 2, i % 2]), np.asarray(y), rtol=1e-5, atol=1e-5)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(g)):
            np.testing.assert_allclose(np.asarray(got[i // 2, i % 2]), np.asarray(want), rtol=1e-5,
                                       atol=1e-5 * np.abs(want).max())


def test_dropless_bfloat16_compute():
    cfg, graphdef, params = build(moe_routing="dropless")
    _, graphdef16, _ = build(moe_routing="dropless", dtype="bfloat16")
    x = np.random.default_rng(14).normal(size=(2, 8, cfg.d_model)).astype(np.float32)
    y32, _ = run(graphdef, params, x)
    y16, aux16 = run(graphdef16, params, jnp.asarray(x, jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16 and all(v.dtype == jnp.float32 for v in aux16.values())
    assert float(jnp.abs(y16.astype(jnp.float32) - y32).max()) < 3e-2 * float(jnp.abs(y32).max())


def test_dropless_bfloat16_gradients_on_a_partly_manual_mesh_equal_one_device():
    """bf16 compute on fsdp 4 x tensor 2: the per-shard shard_map is manual over fsdp only, and XLA:CPU, widening
    the bf16 sum of the weights' gradients it lowers to, aborted the process (jax 0.10.2)."""
    cfg, graphdef, params = build(n_experts=8, moe_routing="dropless", dtype="bfloat16")
    x = jnp.asarray(np.random.default_rng(15).normal(size=(8, 8, cfg.d_model)), jnp.bfloat16)
    probe = np.random.default_rng(16).normal(size=x.shape).astype(np.float32)
    step = jax.grad(lambda p, x: jnp.sum(apply(graphdef, p, x)[0].astype(jnp.float32) * probe))
    want = jax.jit(step)(params, x)

    mesh, rules = mesh_lib.make_mesh({"fsdp": 4, "tensor": 2}), mesh_lib.resolve_rules("dp_fsdp_tp")
    with mesh_lib.activation_sharding(mesh, rules):
        got = jax.jit(step)(params, jax.device_put(x, mesh_lib.batch_sharding(mesh, rules)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-2 * float(np.abs(w).max()))


def layer_on_mesh_equals_one_device(cfg, graphdef, params, axes: dict, preset: str):
    """The layer's outputs, routing scalars and gradients (loss: a probe of y plus the balance loss) on a mesh of
    `axes` equal one device's, its weights' gradients split over `expert` and no device holding all 8 experts'
    weights (w_gate and w_up joined [E, d, 1, 2f], w_down [E, f, d]). -> (compiled program, its input [B, T, d])."""
    x = np.random.default_rng(12).normal(size=(8, 8, cfg.d_model)).astype(np.float32)
    probe = np.random.default_rng(13).normal(size=x.shape).astype(np.float32)

    def loss(params, x):
        y, aux = apply(graphdef, params, x)
        return jnp.sum(y * probe) + aux["load_balance_loss"], (y, aux)

    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, (want_y, want_aux)), want_grads = jax.jit(step)(params, x)

    mesh, rules = mesh_lib.make_mesh(axes), mesh_lib.resolve_rules(preset)
    layer = nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(params=0)))
    names = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer)))
    param_shardings = mesh_lib.tree_shardings(params, names, mesh, rules)
    # Under fsdp the experts are split over it too (each device gathers whole experts, in the grouped matmuls'
    # layout); with 8 experts on these meshes no other dim is split.
    split = ("expert", "fsdp") if axes.get("fsdp", 1) > 1 else "expert"
    assert param_shardings["w_gate"].spec == P(split, None, None)
    sharded_params = jax.device_put(params, param_shardings)
    sharded_x = jax.device_put(x, mesh_lib.batch_sharding(mesh, rules))
    with mesh_lib.activation_sharding(mesh, rules):
        compiled = jax.jit(step).lower(sharded_params, sharded_x).compile()
    (_, (y, aux)), grads = compiled(sharded_params, sharded_x)

    assert not any(s in compiled.as_text() for s in ("f32[8,8,1,24]", "f32[8,8,24]", "f32[8,8,12]", "f32[8,12,8]"))
    assert tuple(grads[0]["w_gate"].sharding.spec)[:1] == (split,)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    for key in want_aux:
        np.testing.assert_allclose(float(aux[key]), float(want_aux[key]), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(w).max())
    return compiled, x


@pytest.mark.parametrize("axes,preset", [({"fsdp": 2, "expert": 4}, "fsdp"),
                                         ({"data": 2, "fsdp": 2, "expert": 2}, "dp_fsdp_tp")])
def test_dropless_layer_on_fsdp_and_expert_axes_matches_single_device(axes, preset):
    """Outputs, routing scalars and gradients as on one device, the experts' weights and gradients split over
    `expert`, and each data/fsdp shard sorting only its own tokens' choices (gathered along `expert` only)."""
    cfg, graphdef, params = build(n_experts=8, moe_routing="dropless")
    compiled, x = layer_on_mesh_equals_one_device(cfg, graphdef, params, axes, preset)
    sorted_sizes = {math.prod(int(n) for n in dims.split(",") if n)
                    for line in compiled.as_text().splitlines() if " sort(" in line
                    for dims in re.findall(r"\w+\[([\d,]*)\]", line.split(" sort(")[0].split("= ", 1)[-1])}
    assert sorted_sizes == {x.shape[0] * x.shape[1] * cfg.moe_top_k * axes["expert"] // 8}, sorted_sizes


# A tiny DeepSeek-V3: latent attention, a dense first layer, 8 experts in 4 groups (2 chosen) with the correction
# bias and scaled gates, a shared expert, and a multi-token prediction module.
DEEPSEEK_V3 = {"model.kv_lora_rank": 16, "model.q_lora_rank": 24, "model.qk_nope_head_dim": 12,
               "model.v_head_dim": 10, "model.head_dim": 8, "model.rope_interleave": True,
               "model.first_dense_layers": 1, "model.dense_d_ff": 48, "model.n_shared_experts": 1,
               "model.n_experts": 8, "model.moe_score": "sigmoid", "model.moe_score_bias": True,
               "model.moe_groups": 4, "model.moe_topk_groups": 2, "model.moe_routed_scale": 2.5,
               "model.moe_renormalize": True, "model.mtp_layers": 1}


@pytest.mark.slow  # about 25 s each on 2 cores
@pytest.mark.parametrize("mesh,dispatch,model", [({"fsdp": 2, "expert": 4}, "gather", {}),
                                                 ({"data": 2, "expert": 4}, "all_to_all", {}),
                                                 ({"expert": 8}, "all_to_all", DEEPSEEK_V3)],
                         ids=["fsdp2_expert4_gather", "data2_expert4_all_to_all", "expert8_all_to_all_deepseek_v3"])
def test_dropless_model_on_an_expert_axis_matches_single_device(tiny_config, mesh, dispatch, model):
    """The whole model (the tiny config, 4 experts of top 2, dropless; or a tiny DeepSeek-V3) on 8 devices with an
    expert axis, its tokens reaching the experts by either dispatch: the loss, the routing scalars and every
    gradient as on one device."""
    from parallel_worker import leaf_errors, synthetic_batches

    from jaxtrain import config as config_lib, objectives, trainer as trainer_lib

    cfg = tiny_config(**{f"mesh.{a}": n for a, n in {"data": 1, **mesh}.items()},
                      **{"mesh.rules": "fsdp" if "fsdp" in mesh else "dp", "model.n_experts": 4, "model.moe_top_k": 2,
                         "model.moe_routing": "dropless", "model.moe_renormalize": False,
                         "model.moe_dispatch": dispatch, **model})
    facts = config_lib.validate(cfg, 8)
    one = cfg.copy_and_resolve_references()
    one.mesh.update({a: 1 for a in mesh})
    trainer = trainer_lib.build_trainer(cfg, facts)
    reference = trainer_on(one, {}, facts.rules, devices=jax.devices()[:1])
    params = trainer.init()["params"]
    batch = synthetic_batches(1, 8, 32, 512)[0]

    def loss_and_grads(t, p):
        def f(p, b):
            with mesh_lib.activation_sharding(t.mesh, t.rules):
                total, count, aux = objectives.loss_terms(t.graphdef, p, b)
                return total / count + aux["load_balance_loss"] + aux.get(objectives.MTP_LOSS, 0) / count, aux
        b = trainer_lib.global_batch(batch, t.batch_sharding)
        compiled = jax.jit(jax.value_and_grad(f, has_aux=True)).lower(p, b).compile()
        return compiled(p, b), compiled.as_text()

    ((loss, aux), grads), hlo = loss_and_grads(trainer, params)
    ((want_loss, want_aux), want_grads), _ = loss_and_grads(reference, jax.device_put(jax.device_get(params),
                                                                                      jax.devices()[0]))
    assert (" all-to-all(" in hlo) == (dispatch == "all_to_all")
    assert grads["blocks"]["mlp"]["w_gate"].sharding.spec[1] == "expert"  # [layers, experts, d, f]
    if model:  # DeepSeek-V3's prediction module: its experts split alike, its loss equal
        assert grads["mtp"]["block"]["mlp"]["w_gate"].sharding.spec[1] == "expert"
        np.testing.assert_allclose(float(aux[objectives.MTP_LOSS]), float(want_aux[objectives.MTP_LOSS]), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert float(aux["dropped_fraction"]) == 0
    np.testing.assert_allclose(float(aux["load_balance_loss"]), float(want_aux["load_balance_loss"]), rtol=1e-5)
    errors = leaf_errors(jax.device_get(grads), jax.device_get(want_grads))
    assert max(errors.values()) < 1e-5, errors


def test_tokamax_kernel_equals_xla_ragged_dot_alone_on_a_mesh_and_under_nested_vmap():
    """model.moe_kernel=tokamax runs tokamax.ragged_dot (its XLA fallback on CPU) for every grouped matmul and
    its input gradient, and XLA's ragged_dot_general for the weight gradient (tokamax's was wrong on an H200):
    outputs and gradients equal jax.lax.ragged_dot's on one device, on data 2 x fsdp 4 (each shard's rows through
    the kernel inside the shard_map) and under a pipeline's two vmaps."""
    import tokamax

    from jaxtrain.compat import tokamax as tokamax_flags

    tokamax_flags.install()  # as an entry point does: tokamax would take pytest's arguments for its absl flags

    calls = []
    original = tokamax.ragged_dot, tokamax.ragged_dot_general
    x = np.random.default_rng(12).normal(size=(2, 2, 8, 8, SMALL["d_model"])).astype(np.float32)
    probe = np.random.default_rng(13).normal(size=x.shape[2:]).astype(np.float32)
    results = {}
    for kernel in ("xla", "tokamax"):
        moe.grouped_matmul.cache_clear()
        cfg, graphdef, params = build(n_experts=8, moe_routing="dropless", moe_kernel=kernel)
        stacked = jax.tree.map(lambda p: np.stack([p * (1 + 0.1 * i) for i in range(4)]).reshape(2, 2, *p.shape),
                               params)

        def loss(params, x):
            y, aux = apply(graphdef, params, x)
            return jnp.sum(y * probe) + aux["load_balance_loss"], (y, aux)

        step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4})
        with mesh_lib.activation_sharding(mesh, mesh_lib.resolve_rules("fsdp")):
            sharded = jax.jit(step)(params, x[0, 0])
        results[kernel] = (jax.jit(step)(params, x[0, 0]), sharded, jax.jit(jax.vmap(jax.vmap(step)))(stacked, x))
    def general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, *a, **k):
        calls.append("weight gradient" if ragged_dot_dimension_numbers == moe._RAGGED_CONTRACTING else "general")
        return original[1](lhs, rhs, group_sizes, ragged_dot_dimension_numbers, *a, **k)

    with pytest.MonkeyPatch.context() as patch:  # the tokamax path does call tokamax, forward and backward
        patch.setattr(tokamax, "ragged_dot", lambda *a, **k: calls.append("dot") or original[0](*a, **k))
        patch.setattr(tokamax, "ragged_dot_general", general)
        moe.grouped_matmul.cache_clear()
        jax.jit(lambda p, x: step(p, x)).lower(params, x[0, 0])  # a new function: traced afresh
        moe.grouped_matmul.cache_clear()
    assert "dot" in calls and "weight gradient" not in calls, calls  # forward and input gradient only
    for got, want in zip(jax.tree.leaves(results["tokamax"]), jax.tree.leaves(results["xla"])):  # "xla": tiled
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# --- Config guards -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, field", [({"moe_top_k": 5}, "moe_top_k"), ({"moe_top_k": 0}, "moe_top_k"),
                                              ({"moe_capacity_factor": 0.0}, "moe_capacity_factor")])
def test_bad_config_raises(overrides, field):
    with pytest.raises(ValueError, match=field):
        moe.MoE(ModelConfig(**{**SMALL, **overrides}), nnx.Rngs(params=0))


@pytest.mark.parametrize("setting, reason", [
    ({"moe_kernel": "megablocks"}, "unknown grouped-matmul kernel 'megablocks'"),
    ({"moe_kernel": "tokamax"}, "tokamax is dropless routing's grouped matmul; this model has capacity routing"),
    ({"moe_kernel": "tokamax", "n_experts": 0}, "this model has no experts"),
    ({"moe_kernel": "tokamax", "moe_routing": "dropless", "missing": True},
     r"tokamax is not installed \(pip install 'jaxtrain\[kernels\]'\)"),
    ({"moe_kernel": "tokamax", "moe_routing": "dropless", "mesh": {"expert": 2}}, "with mesh.expert=2 XLA would"),
    ({"moe_kernel": "tokamax", "moe_routing": "dropless", "mesh": {"tensor": 2}}, "with mesh.tensor=2 XLA would"),
    ({"moe_kernel": "tokamax", "moe_routing": "dropless", "mesh": {"fsdp": 2, "sequence": 2}}, None),
    ({"moe_kernel": "tokamax", "moe_routing": "dropless", "moe_dispatch": "all_to_all", "mesh": {"expert": 4}}, None),
    ({"moe_kernel": "tokamax", "moe_routing": "dropless", "moe_dispatch": "all_to_all", "mesh": {"tensor": 2}},
     "with mesh.tensor=2 XLA would"),
    ({"moe_kernel": "tokamax", "moe_routing": "dropless"}, None),
    ({"moe_weight_grad": "triton"}, "unknown grouped weight gradient 'triton'"),
    ({"moe_weight_grad": "pallas"}, "pallas is dropless routing's weight gradient; this model has capacity routing"),
    ({"moe_weight_grad": "pallas", "moe_routing": "dropless", "mesh": {"expert": 2}}, "with mesh.expert=2 XLA would"),
    ({"moe_weight_grad": "pallas", "moe_routing": "dropless"}, "pallas runs on GPUs only; this run compiles for cpu"),
    ({"moe_input_grad": "xla"}, "unknown grouped input gradient 'xla'"),
    ({"moe_input_grad": "pallas"}, "pallas is dropless routing's input gradient; this model has capacity routing"),
    ({"moe_input_grad": "pallas", "moe_routing": "dropless", "mesh": {"tensor": 2}}, "with mesh.tensor=2 XLA would"),
    ({"moe_input_grad": "pallas", "moe_routing": "dropless"}, "pallas runs on GPUs only; this run compiles for cpu"),
    ({"moe_dispatch": "ragged"}, "moe_dispatch: unknown expert dispatch 'ragged'"),
    ({"moe_dispatch": "all_to_all"}, "moe_dispatch: all_to_all dispatches dropless routing; this model has capacity"),
    ({"moe_dispatch": "all_to_all", "moe_routing": "dropless", "mesh": {"expert": 4}}, None),
])
def test_moe_kernel_and_dispatch_are_checked_at_config_time(setting, reason, monkeypatch):
    import importlib.util

    from jaxtrain import config as config_lib

    if setting.pop("missing", False):
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tokamax" else
                            find_spec(name, *a))
    cfg = config_lib.base_config()
    mesh = setting.pop("mesh", {})
    cfg.mesh.update(data=-1, **mesh)
    cfg.model.update(**{"n_experts": 4, **setting})
    if reason is None:
        config_lib.validate(cfg, 8)
    else:
        field = next(f for f in ("moe_kernel", "moe_weight_grad", "moe_input_grad", "moe_dispatch") if f in setting)
        with pytest.raises(config_lib.ConfigError, match=f"^model.{field}: .*{reason.removeprefix(field + ': ')}"):
            config_lib.validate(cfg, 8)


@pytest.mark.parametrize("setting, field, reason", [
    ({"moe_score": "relu"}, "moe_score", "unknown router score 'relu'"),
    ({"moe_score": "sigmoid", "moe_groups": 3}, "moe_groups", "3 does not divide model.n_experts=8"),
    ({"moe_groups": 2}, "moe_groups", "scores experts by sigmoid"),
    ({"moe_score": "sigmoid", "moe_groups": 2, "moe_topk_groups": 3}, "moe_topk_groups", "between 1 and"),
    ({"moe_score": "sigmoid", "moe_groups": 4, "moe_topk_groups": 1, "moe_top_k": 3}, "moe_top_k",
     "3 exceeds the 1 x 2 experts"),
    ({"moe_routed_scale": 0.0}, "moe_routed_scale", ""),
    ({"moe_score": "sigmoid", "moe_groups": 4, "moe_topk_groups": 2, "moe_routed_scale": 2.5}, None, None),
    # DeepSeek-V3's fields (MLA, moe_score_bias, the dense first layers, shared experts).
    ({"moe_score_bias": True}, "moe_score_bias", "added to sigmoid scores"),
    ({"first_dense_layers": 4, "dense_d_ff": 64}, "first_dense_layers", "leaves none of the model.n_layers=4"),
    ({"first_dense_layers": 1}, "dense_d_ff", "must be a positive integer, got 0"),
    ({"first_dense_layers": 1, "dense_d_ff": 64, "sliding_window": 8}, "first_dense_layers",
     "do not combine with sliding windows"),
    ({"n_experts": 0, "n_shared_experts": 1}, "n_shared_experts", "model.n_experts is 0"),
    ({"kv_lora_rank": 16}, "qk_nope_head_dim", "must be a positive integer, got 0"),
    ({"kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8, "sliding_window": 4}, "sliding_window",
     "latent attention (model.kv_lora_rank) has no sliding window"),
    ({"kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8, "lora_rank": 4, "lora_targets": "q,v"},
     "lora_targets", "v: latent attention's keys and values come from one latent; adapt them together as 'kv'"),
    ({"lora_rank": 4, "lora_targets": "q,kv"}, "lora_targets", "'kv' adapts latent attention's key-value"),
    ({"kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8, "lora_rank": 4, "lora_targets": "experts",
      "first_dense_layers": 1, "dense_d_ff": 64, "n_shared_experts": 1, "moe_score": "sigmoid",
      "moe_score_bias": True}, None, None),
])
def test_router_settings_are_checked_at_config_time(setting, field, reason):
    from jaxtrain import config as config_lib

    cfg = config_lib.base_config()
    cfg.model.update(**{"n_experts": 8, **setting})
    if field is None:
        config_lib.validate(cfg, 1)
    else:
        with pytest.raises(config_lib.ConfigError, match=f"^model.{field}: .*{re.escape(reason)}"):
            config_lib.validate(cfg, 1)


def test_tokamax_on_gpus_needs_widths_its_kernel_tiles():
    """Its Mosaic GPU kernel fails to lower rows narrower than 64 bf16 (the base config's d_model 256 and d_ff 768
    are multiples); the CPU runs XLA's ragged_dot behind it, which takes any width."""
    from jaxtrain import config as config_lib
    from jaxtrain.models import config as model_config

    cfg = config_lib.base_config()
    cfg.model.update(n_experts=4, moe_routing="dropless", moe_kernel="tokamax")
    model_config.check_backend(cfg.model, "gpu")
    for field, value in (("d_model", 96), ("d_ff", 32)):
        bad = config_lib.base_config()
        bad.model.update(n_experts=4, moe_routing="dropless", moe_kernel="tokamax", **{field: value})
        model_config.check_backend(bad.model, "cpu")
        with pytest.raises(config_lib.ConfigError, match=f"^model.{field}: {value} is not a multiple of 64"):
            model_config.check_backend(bad.model, "gpu")


@pytest.mark.parametrize("jax_version, tokamax_version, refused", [
    ((0, 11, 2), "0.0.12", True), ((0, 11, 2), "0.0.13", False), ((0, 11, 2), "0.0.18.dev20261026", False),
    ((0, 10, 2), "0.0.12", False)])
def test_tokamax_on_gpus_refuses_a_release_older_than_jax_s_mosaic_gpu_api(monkeypatch, jax_version,
                                                                          tokamax_version, refused):
    """jax 0.11 renamed the Mosaic GPU argument tokamax 0.0.12's kernels pass (they fail to trace there): that
    pair is refused for a GPU target, naming both versions, and runs elsewhere (XLA's ragged_dot behind it)."""
    import importlib.metadata

    from jaxtrain import config as config_lib
    from jaxtrain.models import config as model_config

    cfg = config_lib.base_config()
    cfg.model.update(n_experts=4, moe_routing="dropless", moe_kernel="tokamax")
    monkeypatch.setattr(jax, "__version_info__", jax_version)
    monkeypatch.setattr(jax, "__version__", ".".join(map(str, jax_version)))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: tokamax_version if name == "tokamax" else None)
    model_config.check_backend(cfg.model, "cpu")
    if not refused:
        model_config.check_backend(cfg.model, "gpu")
        return
    with pytest.raises(config_lib.ConfigError, match=r"^model.moe_kernel: tokamax 0.0.12 predates jax 0.11.2's "
                       r"Mosaic GPU API; install tokamax>=0.0.13 \(or use 'xla'\)$"):
        model_config.check_backend(cfg.model, "gpu")


def test_aux_loss_free_balancing_moves_each_router_bias_by_the_rate_and_evens_the_load(tiny_config, tmp_path):
    """model.moe_bias_rate (DeepSeek-V3's balancing without an auxiliary loss): a step moves each layer's correction
    bias by +rate for the experts that took fewer assignments than the layer's mean and -rate for those that took
    more (numpy, from a forward pass's loads on the step's params). With the learning rate near 0 and every
    router's bias skewed to expert 0, steps of it alone even the load out."""
    from parallel_worker import synthetic_batches

    from jaxtrain import config as config_lib, trainer as trainer_lib

    rate = 0.1
    cfg = tiny_config(**{"model.n_experts": 8, "model.moe_top_k": 2, "model.moe_routing": "dropless",
                         "model.moe_score": "sigmoid", "model.moe_score_bias": True, "model.moe_bias_rate": rate,
                         "model.moe_aux_weight": 0.0, "optim.lr": 1e-9})
    trainer = trainer_on(cfg, {}, config_lib.validate(cfg, 8).rules, devices=jax.devices()[:1])
    state = trainer.init()
    skew = np.zeros((2, 8), np.float32)
    skew[:, 0] = 1.0  # sigmoid scores are in (0, 1): expert 0 wins every choice
    mlp = state["params"]["blocks"]["mlp"]
    mlp["score_bias"] = jax.device_put(skew, jax.devices()[0])
    mlp["w_router"] = mlp["w_router"] * 30  # scores spread over (0, 1), not all near 0.5: a bias step moves a few
    batches = [trainer_lib.global_batch(b, trainer.batch_sharding) for b in synthetic_batches(12, 8, 32, 512)]

    model = nnx.merge(trainer.graphdef, state["params"])
    load = np.asarray(model.hidden(batches[0]["tokens"], batches[0]["positions"], batches[0]["segment_ids"])[1][
        "expert_load"])  # [layers, experts]
    assert (load[:, 0] == 8 * 32).all()  # every token chose expert 0
    want = skew + rate * np.sign(load.mean(axis=-1, keepdims=True) - load)
    state, first = trainer.train_step(state, batches[0])
    np.testing.assert_array_equal(np.asarray(state["params"]["blocks"]["mlp"]["score_bias"]), want)
    # The per-expert load (hooks.ExpertLoadHook, the run's expert_load.jsonl): each layer's shares of its
    # assignments as multiples of an even share, summed over the logged steps, a skipped step's left out.
    path = tmp_path / "expert_load.jsonl"
    load_hook = hooks_lib.ExpertLoadHook(path, every=2, start_step=0)
    load_hook(1, state, first, None)
    load_hook(2, state, {**first, "finite": jnp.bool_(False), "expert_load": first["expert_load"] * 7}, None)
    shares = load.astype(np.float64) * 8 / load.sum(-1, keepdims=True)
    assert json.loads(path.read_text()) == {"step": 2, "load": np.round(shares, 4).tolist()}
    for batch in batches[1:]:
        state, last = trainer.train_step(state, batch)
    assert float(first["moe/max_load"]) == pytest.approx(4.0)  # expert 0's half of the assignments x 8
    assert float(last["moe/max_load"]) < 1.6, float(last["moe/max_load"])  # 1.48 (2.90 after the first step)
    assert "moe/expert_load" not in last and last["expert_load"].shape == (2, 8)  # not a scalar: apart


def test_the_sequence_wise_balance_loss_is_each_row_s_averaged():
    """model.moe_aux_loss=sequence: E * sum_e f_e * P_e of each batch row (its routed fractions and mean router
    probabilities), averaged over the rows (numpy); "batch" takes the f and P of all rows together."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 10, 8)), jnp.float32)  # 3 rows of 10 tokens, 8 experts
    _, _, stats = moe.dropless_route(logits, 2, score="sigmoid")
    routed, prob = np.asarray(stats["routed"]), np.asarray(stats["prob"])
    per_row = 8 * np.sum(routed / routed.sum(-1, keepdims=True) * prob / 10, axis=-1)
    got = moe.summarize(stats, per_sequence=True)["load_balance_loss"]
    np.testing.assert_allclose(float(got), per_row.mean(), rtol=1e-6)
    whole = 8 * np.sum(routed.sum(0) / routed.sum() * prob.sum(0) / 30)
    np.testing.assert_allclose(float(moe.summarize(stats)["load_balance_loss"]), whole, rtol=1e-6)
    assert abs(per_row.mean() - whole) > 1e-3  # the two differ here
