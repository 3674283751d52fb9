"""Expert-parallel dispatch by all-to-all (jaxtrain.parallel.experts): the dropless MoE layer with
`moe_dispatch="all_to_all"` on 8 CPU devices equals the one-device layer, outputs and gradients, and sends rows
by all-to-all instead of gathering every token to every expert shard, with Mixtral's softmax routing and
DeepSeek-V3's sigmoid group routing. The GPU/TPU form (ragged_all_to_all, which XLA:CPU cannot run) is checked
the same way with the collective emulated by its documented semantics."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.test_moe import build, layer_on_mesh_equals_one_device

from jaxtrain.parallel import experts


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """jax.lax.ragged_all_to_all as its docstring defines it, from a padded all_to_all: rows
    [input_offsets[j], + send_sizes[j]) of `operand` land in device j's `output` at this device's
    output_offsets[j]."""
    shards, rows = send_sizes.shape[0], operand.shape[0]
    r = jnp.arange(rows)
    take = jnp.minimum(input_offsets[:, None] + r[None, :], rows - 1)
    buffer = jnp.where((r[None, :] < send_sizes[:, None])[..., None], operand[take], 0)
    got = jax.lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)  # [source, rows, d]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)[:, None] + r[None, :]
    at = jnp.where(r[None, :] < recv_sizes[:, None], at, output.shape[0])  # out of range: dropped
    return output.at[at.reshape(-1)].set(got.reshape(shards * rows, -1), mode="drop")


DEEPSEEK = {"moe_score": "sigmoid", "moe_groups": 4, "moe_topk_groups": 2, "moe_routed_scale": 2.5}


@pytest.mark.parametrize("form,routing", [("padded", {}), ("ragged", {}), ("padded", DEEPSEEK),
                                          ("padded", {"moe_kernel": "tokamax"})],
                         ids=["padded", "ragged", "padded_sigmoid_groups", "padded_tokamax"])
@pytest.mark.parametrize("axes,preset", [({"fsdp": 2, "expert": 4}, "fsdp"), ({"expert": 8}, "fsdp"),
                                         ({"data": 2, "expert": 4}, "dp")], ids=["expert4_fsdp2", "expert8",
                                                                                  "data2_expert4"])
def test_all_to_all_layer_equals_one_device(axes, preset, form, routing, monkeypatch):
    if form == "ragged":
        monkeypatch.setattr(experts, "_ragged", lambda: True)
        monkeypatch.setattr(experts, "_ragged_all_to_all", emulated_ragged_all_to_all)
    if routing.get("moe_kernel") == "tokamax":  # on CPU its XLA fallback, behind its own wrapper
        from jaxtrain.compat import tokamax as tokamax_flags

        tokamax_flags.install()  # as an entry point does: tokamax would take pytest's arguments for its flags
    cfg, graphdef, params = build(n_experts=8, moe_routing="dropless", moe_dispatch="all_to_all", **routing)
    compiled, _ = layer_on_mesh_equals_one_device(cfg, graphdef, params, axes, preset)

    # Rows moved by all-to-all only: the counts, the rows there and back, and those two again in the backward.
    # No other collective moves a token-sized array (every weight dim here is at most 24: tokamax's case gathers
    # gate and up joined, 2 x d_ff; "gather" dispatch all-gathers the expert choices, s32[64], and all-reduces
    # the partial outputs, f32[64,8]).
    hlo = compiled.as_text()
    assert hlo.count(" all-to-all(") == 5 or form == "ragged"  # emulated there, by more all-to-alls
    others = [line for line in hlo.splitlines()
              if re.search(r" (all-gather|all-reduce|reduce-scatter)(-start)?\(", line)]
    sizes = [int(n) for line in others for dims in re.findall(r"\w\d+\[([\d,]*)\]", line.split("(")[0]) for n in
             dims.split(",") if n]
    assert others and max(sizes) <= 24, others


@pytest.mark.parametrize("form", ["padded", "ragged"])
def test_a_bounded_receive_buffer_drops_the_rows_past_it_and_counts_them(form, monkeypatch):
    """model.moe_dispatch_capacity=1: each source sends a device at most a balanced share of its rows (a quarter of
    its 2 x 8 assignments on expert 4 x fsdp 2). With the router's logits all 0 every token picks experts 0 and 1,
    both on the first expert shard: each device's first 4 tokens keep expert 0 (its rows sorted by expert come
    first), everything else is dropped, 3/4 of the assignments, and counted. With expert 1's weights at 0 the kept
    outputs are the one-device layer's."""
    from models.test_moe import apply

    from jaxtrain.parallel import mesh as mesh_lib

    if form == "ragged":
        monkeypatch.setattr(experts, "_ragged", lambda: True)
        monkeypatch.setattr(experts, "_ragged_all_to_all", emulated_ragged_all_to_all)
    cfg, graphdef, params = build(n_experts=8, moe_routing="dropless", moe_dispatch="all_to_all",
                                  moe_dispatch_capacity=1.0)
    params["w_router"][:] = 0
    for name in ("w_gate", "w_up", "w_down"):
        params[name][1] = 0
    x = np.random.default_rng(12).normal(size=(8, 8, cfg.d_model)).astype(np.float32)
    want_y, _ = jax.jit(apply, static_argnums=0)(graphdef, params, x)  # 0.5 * expert 0 (expert 1 gives 0)

    mesh, rules = mesh_lib.make_mesh({"fsdp": 2, "expert": 4}), mesh_lib.resolve_rules("fsdp")
    with mesh_lib.activation_sharding(mesh, rules):
        y, aux = jax.jit(apply, static_argnums=0)(graphdef, params, jax.device_put(
            x, mesh_lib.batch_sharding(mesh, rules)))
    kept = (np.arange(8) < 4)[None, :, None]  # each device holds one row of 8 tokens
    np.testing.assert_allclose(np.asarray(y), np.where(kept, np.asarray(want_y), 0), rtol=1e-6, atol=1e-6)
    assert float(aux["dropped_fraction"]) == 0.75
