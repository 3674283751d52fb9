"""Expert-parallel dispatch by all-to-all (jaxtrain.parallel.experts): the dropless MoE layer with
`moe_dispatch="all_to_all"` on 8 CPU devices equals the one-device layer, outputs and gradients, and sends rows
by all-to-all instead of gathering every token to every expert shard, with Mixtral's softmax routing and
DeepSeek-V3's sigmoid group routing. The GPU/TPU form (ragged_all_to_all,
which XLA:CPU cannot run) is checked the same way with the collective emulated by its documented semantics."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.test_moe import apply, build

from jaxtrain.models import moe
from jaxtrain.parallel import experts, mesh as mesh_lib


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


@pytest.mark.parametrize("form,routing", [("padded", {}), ("ragged", {}), ("padded", DEEPSEEK)],
                         ids=["padded", "ragged", "padded_sigmoid_groups"])
@pytest.mark.parametrize("axes,preset", [({"fsdp": 2, "expert": 4}, "fsdp"), ({"expert": 8}, "fsdp"),
                                         ({"data": 2, "expert": 4}, "dp")], ids=["expert4_fsdp2", "expert8",
                                                                                  "data2_expert4"])
def test_all_to_all_layer_equals_one_device(axes, preset, form, routing, monkeypatch):
    if form == "ragged":
        monkeypatch.setattr(experts, "_ragged", lambda: True)
        monkeypatch.setattr(experts, "_ragged_all_to_all", emulated_ragged_all_to_all)
    cfg, graphdef, params = build(n_experts=8, moe_routing="dropless", moe_dispatch="all_to_all", **routing)
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
    sharded_params = jax.device_put(params, mesh_lib.tree_shardings(params, names, mesh, rules))
    sharded_x = jax.device_put(x, mesh_lib.batch_sharding(mesh, rules))
    with mesh_lib.activation_sharding(mesh, rules):
        compiled = jax.jit(step).lower(sharded_params, sharded_x).compile()
    (_, (y, aux)), grads = compiled(sharded_params, sharded_x)

    # Rows moved by all-to-all only: the counts, the rows there and back, and those two again in the backward.
    # No other collective moves a token-sized array (every weight dim here is at most 12; "gather" dispatch
    # all-gathers the expert choices, s32[64], and all-reduces the partial outputs, f32[64,8]).
    hlo = compiled.as_text()
    assert hlo.count(" all-to-all(") == 5 or form == "ragged"  # emulated there, by more all-to-alls
    others = [line for line in hlo.splitlines()
              if re.search(r" (all-gather|all-reduce|reduce-scatter)(-start)?\(", line)]
    sizes = [int(n) for line in others for dims in re.findall(r"\w\d+\[([\d,]*)\]", line.split("(")[0]) for n in
             dims.split(",") if n]
    assert others and max(sizes) <= 12, others
    assert not any(s in hlo for s in ("f32[8,8,1,24]", "f32[8,8,24]", "f32[8,8,12]", "f32[8,12,8]"))
    assert tuple(grads[0]["w_gate"].sharding.spec)[:1] == ("expert",)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    for key in want_aux:
        np.testing.assert_allclose(float(aux[key]), float(want_aux[key]), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(w).max())
