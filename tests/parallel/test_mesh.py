"""Meshes and logical axis rules: the layout of every parameter and optimizer moment under each preset,
FSDP memory, the unannotated-parameter fallback, explicit rule tables, and numerical equivalence of a
few training steps across meshes."""

import collections
import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import config as config_lib
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.data import pipeline
from jaxtrain import trainer as trainer_lib
from helpers import trainer_on

# The tiny config (conftest): vocab 512, d_model 32, 2 layers, 8 query heads, 4 kv heads, head_dim 8, d_ff 64.
FULL = {
    "embed": (512, 32),
    "blocks/attn/wq": (2, 32, 8, 8),
    "blocks/attn/wk": (2, 32, 4, 8),
    "blocks/attn/wv": (2, 32, 4, 8),
    "blocks/attn/wo": (2, 8, 8, 32),
    "blocks/attn_norm/scale": (2, 32),
    "blocks/mlp/w_gate": (2, 32, 64),
    "blocks/mlp/w_up": (2, 32, 64),
    "blocks/mlp/w_down": (2, 64, 32),
    "blocks/mlp_norm/scale": (2, 32),
    "final_norm/scale": (32,),
}
NORMS = {"blocks/attn_norm/scale": (2, 32), "blocks/mlp_norm/scale": (2, 32), "final_norm/scale": (32,)}

# Expected per-device shard shape of every parameter, by hand. Logical names: embed (vocab, embed);
# wq/wk/wv (layers, embed, q|kv_heads, head_dim); wo (layers, q_heads, head_dim, embed);
# w_gate/w_up (layers, embed, mlp); w_down (layers, mlp, embed); norm scales (layers?, norm).
LAYOUTS = {
    # preset: (mesh data, fsdp, tensor), shard shapes
    "dp": ((8, 1, 1), dict(FULL)),  # batch only: every parameter replicated
    "fsdp": (
        (1, 8, 1),
        {  # embed dim (32) / 8 = 4
            "embed": (512, 4),
            "blocks/attn/wq": (2, 4, 8, 8),
            "blocks/attn/wk": (2, 4, 4, 8),
            "blocks/attn/wv": (2, 4, 4, 8),
            "blocks/attn/wo": (2, 8, 8, 4),
            "blocks/mlp/w_gate": (2, 4, 64),
            "blocks/mlp/w_up": (2, 4, 64),
            "blocks/mlp/w_down": (2, 64, 4),
            **NORMS,
        },
    ),
    "fsdp_tp": (
        (1, 4, 2),
        {  # embed / 4 = 8; vocab 512/2, q_heads 8/2, kv_heads 4/2, mlp 64/2
            "embed": (256, 8),
            "blocks/attn/wq": (2, 8, 4, 8),
            "blocks/attn/wk": (2, 8, 2, 8),
            "blocks/attn/wv": (2, 8, 2, 8),
            "blocks/attn/wo": (2, 4, 8, 8),
            "blocks/mlp/w_gate": (2, 8, 32),
            "blocks/mlp/w_up": (2, 8, 32),
            "blocks/mlp/w_down": (2, 32, 8),
            **NORMS,
        },
    ),
    "dp_fsdp_tp": (
        (2, 2, 2),
        {  # data only splits the batch; embed / 2 = 16; tensor as above
            "embed": (256, 16),
            "blocks/attn/wq": (2, 16, 4, 8),
            "blocks/attn/wk": (2, 16, 2, 8),
            "blocks/attn/wv": (2, 16, 2, 8),
            "blocks/attn/wo": (2, 4, 8, 16),
            "blocks/mlp/w_gate": (2, 16, 32),
            "blocks/mlp/w_up": (2, 16, 32),
            "blocks/mlp/w_down": (2, 32, 16),
            **NORMS,
        },
    ),
}
# Which mesh axis each dim uses under dp_fsdp_tp (shard shapes alone cannot tell fsdp from tensor there).
DP_FSDP_TP_SPECS = {
    "embed": ("tensor", "fsdp"),
    "blocks/attn/wq": (None, "fsdp", "tensor", None),
    "blocks/attn/wk": (None, "fsdp", "tensor", None),
    "blocks/attn/wv": (None, "fsdp", "tensor", None),
    "blocks/attn/wo": (None, "tensor", None, "fsdp"),
    "blocks/attn_norm/scale": (None, None),
    "blocks/mlp/w_gate": (None, "fsdp", "tensor"),
    "blocks/mlp/w_up": (None, "fsdp", "tensor"),
    "blocks/mlp/w_down": (None, "tensor", "fsdp"),
    "blocks/mlp_norm/scale": (None, None),
    "final_norm/scale": (None,),
}


def mesh_config(tiny_config, rules, shape, **overrides):
    data, fsdp, tensor = shape
    return tiny_config(
        **{"mesh.rules": rules, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}, **overrides
    )


def build(cfg, devices=None):
    facts = config_lib.validate(cfg, jax.device_count())
    return trainer_lib.build_trainer(cfg, facts, devices=devices)


def by_path(tree):
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): x
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def adam_states(opt_state):
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1, found
    return found[0]


def shard_shapes(arr):
    """Shape of the piece every device holds (all must agree)."""
    shapes = {tuple(s.data.shape) for s in arr.addressable_shards}
    assert len(shapes) == 1, shapes
    assert len(arr.addressable_shards) == jax.device_count()  # every leaf lives on the whole mesh
    return shapes.pop()


@pytest.mark.parametrize("preset", list(LAYOUTS))
def test_param_and_moment_shard_shapes(tiny_config, preset):
    shape, expected = LAYOUTS[preset]
    trainer = build(mesh_config(tiny_config, preset, shape))
    assert dict(trainer.mesh.shape) == {"pipeline": 1, "expert": 1, "sequence": 1,
                                        **dict(zip(("data", "fsdp", "tensor"), shape))}
    state = trainer.init()
    adam = adam_states(state["opt_state"])

    for name, tree in [("params", state["params"]), ("mu", adam.mu), ("nu", adam.nu)]:
        leaves = by_path(tree)
        assert {k: tuple(v.shape) for k, v in leaves.items()} == FULL, name
        got = {k: shard_shapes(v) for k, v in leaves.items()}
        assert got == expected, f"{preset} {name}"
        if preset == "dp_fsdp_tp":
            specs = {k: tuple(v.sharding.spec) + (None,) * (v.ndim - len(v.sharding.spec)) for k, v in leaves.items()}
            assert specs == DP_FSDP_TP_SPECS, name
    # Adam's step count is a scalar replicated over the whole mesh (not committed to one device).
    assert adam.count.shape == () and adam.count.sharding.is_fully_replicated
    assert adam.count.sharding.device_set == set(jax.devices())
    # The abstract state (the restore target) carries the same shardings as the real one.
    for real, abstract in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.abstract_state)):
        assert abstract.sharding.is_equivalent_to(real.sharding, real.ndim)


def test_fsdp_per_device_state_bytes(tiny_config):
    """ZeRO-3: under fsdp over 8 devices each device holds about 1/8 of params + optimizer state (only the
    small norm scales and scalar counts are replicated)."""
    trainer = build(mesh_config(tiny_config, "fsdp", (1, 8, 1)))
    state = trainer.init()
    leaves = jax.tree.leaves({"params": state["params"], "opt_state": state["opt_state"]})
    total = sum(x.nbytes for x in leaves)
    per_device = collections.Counter()
    for x in leaves:
        for shard in x.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    assert len(per_device) == 8
    assert max(per_device.values()) <= 1.05 * total / 8, (max(per_device.values()), total / 8)


# --- spec_for, rules -------------------------------------------------------------------------------------


def make_mesh(data, fsdp, tensor):
    return mesh_lib.make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor})


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((6, 16, 24), (None, None, "fsdp")),  # 16 and 24 divide by 8: the largest wins
        ((36, 16), (None, "fsdp")),  # the largest (36) does not divide: next largest
        ((40, 16, 3), ("fsdp", None, None)),
        ((2, 8), (None, "fsdp")),
        ((6, 12), (None, None)),  # nothing divides: replicated
        ((), ()),
    ],
)
def test_unannotated_param_falls_back_to_fsdp_on_largest_divisible_dim(shape, expected):
    spec = mesh_lib.spec_for(shape, None, make_mesh(1, 8, 1), mesh_lib.resolve_rules("fsdp"))
    assert tuple(spec) + (None,) * (len(shape) - len(spec)) == expected


def test_unannotated_fallback_needs_an_active_fsdp_axis():
    # dp preset maps nothing to fsdp; fsdp_tp with fsdp size 1 has nothing to shard over.
    assert all(a is None for a in mesh_lib.spec_for((64, 32), None, make_mesh(8, 1, 1), mesh_lib.resolve_rules("dp")))
    assert all(
        a is None for a in mesh_lib.spec_for((64, 32), None, make_mesh(1, 1, 8), mesh_lib.resolve_rules("fsdp_tp"))
    )


def test_rules_table_string():
    rules = mesh_lib.resolve_rules("batch=data+fsdp,embed=fsdp")
    assert rules["batch"] == ("data", "fsdp")
    assert rules["embed"] == ("fsdp",)
    for logical in ("q_heads", "kv_heads", "mlp", "vocab", "act_heads", "act_mlp", "act_vocab"):
        assert rules.get(logical, ()) == ()
    mesh = make_mesh(2, 4, 1)
    # wq (layers, embed, q_heads, head_dim): embed 32 / fsdp 4; heads unlisted -> replicated.
    assert tuple(mesh_lib.spec_for((2, 32, 8, 8), ("layers", "embed", "q_heads", "head_dim"), mesh, rules)) == (
        None,
        "fsdp",
        None,
        None,
    )
    assert mesh_lib.batch_sharding(mesh, rules).spec == P(("data", "fsdp"), None)
    assert mesh_lib.data_parallel_size({"data": 2, "fsdp": 4, "tensor": 1}, rules) == 8
    # An unknown mesh axis in a table is an error naming the field.
    with pytest.raises(ValueError, match="mesh.rules"):
        mesh_lib.resolve_rules("batch=data+model")


def test_rules_table_string_in_a_trainer(tiny_config):
    cfg = tiny_config(**{"mesh.rules": "batch=data+fsdp,embed=fsdp", "mesh.data": 2, "mesh.fsdp": 4, "mesh.tensor": 1})
    trainer = build(cfg)
    params = by_path(trainer.init()["params"])
    assert shard_shapes(params["embed"]) == (512, 8)
    assert shard_shapes(params["blocks/mlp/w_down"]) == (2, 64, 8)
    assert shard_shapes(params["blocks/attn/wq"]) == (2, 8, 8, 8)
    assert trainer.batch_sharding.spec == P(("data", "fsdp"), None)


def test_mapping_that_does_not_divide_is_replicated():
    mesh, rules = make_mesh(1, 1, 8), mesh_lib.resolve_rules("fsdp_tp")
    names = ("layers", "embed", "kv_heads", "head_dim")
    assert tuple(mesh_lib.spec_for((2, 32, 4, 8), names, mesh, rules)) == (None, None, None, None)  # 4 kv heads
    assert tuple(mesh_lib.spec_for((2, 32, 16, 8), names, mesh, rules)) == (None, None, "tensor", None)
    # A mesh axis already used by an earlier dim is not used twice.
    rules2 = mesh_lib.resolve_rules("embed=tensor,mlp=tensor")
    assert tuple(mesh_lib.spec_for((32, 64), ("embed", "mlp"), mesh, rules2)) == ("tensor", None)
    # A mapping over several axes keeps the longest leading run that divides: the vocab over tensor x pipeline.
    mesh = mesh_lib.make_mesh({"pipeline": 4, "tensor": 2})
    rules = mesh_lib.resolve_rules("dp_fsdp_tp")
    assert tuple(mesh_lib.spec_for((32000, 8), ("vocab", "embed"), mesh, rules)) == (("tensor", "pipeline"), None)
    assert tuple(mesh_lib.spec_for((32002, 8), ("vocab", "embed"), mesh, rules)) == ("tensor", None)
    assert tuple(mesh_lib.spec_for((50257, 8), ("vocab", "embed"), mesh, rules)) == (None, None)


# --- Equivalence across meshes ---------------------------------------------------------------------------

MESHES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2)]


def three_steps(trainer, batches):
    state = trainer.init()
    out = []
    for local in batches:
        state, metrics = trainer.train_step(state, trainer_lib.global_batch(local, trainer.batch_sharding))
        out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return np.array(out)


def test_loss_and_grad_norm_agree_across_meshes(tiny_config, tiny_data_dir):
    # warmup 0 so that step 1 already moves the weights and steps 2-3 test the updated params.
    cfg_for = lambda shape: mesh_config(tiny_config, "dp_fsdp_tp", shape, **{"optim.warmup_steps": 0})
    it = pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=8, seed=0)
    batches = [next(it) for _ in range(3)]

    single = trainer_on(
        cfg_for((8, 1, 1)),
        {"data": 1, "fsdp": 1, "tensor": 1},
        mesh_lib.resolve_rules("dp_fsdp_tp"),
        devices=jax.devices()[:1],
    )
    reference = three_steps(single, batches)
    assert np.isfinite(reference).all()
    assert reference[2, 0] < reference[0, 0]  # the steps do train (otherwise agreement would be cheap)
    for shape in MESHES:
        got = three_steps(build(cfg_for(shape)), batches)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=0, err_msg=f"mesh {shape}")


# --- Hybrid (DCN x ICI) meshes ---------------------------------------------------------------------------


def granule_of(mesh, granule_size=4):
    """Which consecutive block of 4 devices (the simulated CPU granule) each (data, fsdp[, tensor]) position holds."""
    shape = [mesh.shape["data"], mesh.shape["fsdp"]] + ([mesh.shape["tensor"]] if mesh.shape["tensor"] > 1 else [])
    return np.vectorize(lambda d: d.id // granule_size)(mesh.devices).reshape(shape)


def test_hybrid_mesh_puts_dcn_axes_between_granules():
    # 2 granules of 4 devices. dcn_data=2: each data row is one granule, fsdp stays inside it.
    mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4, "tensor": 1}, dcn={"data": 2, "fsdp": 1, "tensor": 1})
    assert granule_of(mesh).tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
    # dcn_fsdp=2: fsdp's outer factor crosses granules, its inner 2 ways and all of data stay inside one.
    mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4, "tensor": 1}, dcn={"data": 1, "fsdp": 2, "tensor": 1})
    assert granule_of(mesh).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_granules_follow_slices_then_processes():
    from types import SimpleNamespace as Dev

    # Two slices of two processes each: slices are the granules.
    devs = [Dev(id=i, slice_index=i // 4, process_index=i // 2, platform="tpu") for i in range(8)]
    assert [[d.id for d in g] for g in mesh_lib.granules(devs, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # GPUs report no slice: processes (one per node) are the granules, and their count must match.
    gpus = [Dev(id=i, process_index=i // 4, platform="gpu") for i in range(8)]
    assert [[d.id for d in g] for g in mesh_lib.granules(gpus, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"^mesh.dcn_data: the dcn sizes multiply to 4, but the devices form 2 "
                                         r"granules \(processes\)"):
        mesh_lib.granules(gpus, 4)
    assert mesh_lib.granules(gpus, 1) == [gpus]  # no dcn axis: one granule whatever the processes
    one_node = [Dev(id=i, process_index=0, platform="gpu") for i in range(8)]
    with pytest.raises(ValueError, match=r"^mesh.dcn_data: .* one slice in one process"):
        mesh_lib.granules(one_node, 2)


@pytest.mark.parametrize("override, field", [({"mesh.dcn_fsdp": 3}, "mesh.dcn_fsdp: 3 does not divide mesh.fsdp=4"),
                                             ({"mesh.dcn_tensor": 0}, "mesh.dcn_tensor: must be a positive integer")])
def test_bad_dcn_sizes_name_the_field(tiny_config, override, field):
    cfg = mesh_config(tiny_config, "dp_fsdp_tp", (2, 4, 1), **override)
    with pytest.raises(config_lib.ConfigError, match=f"^{field}"):
        config_lib.validate(cfg, 8)


def test_hybrid_mesh_trains_like_the_plain_one(tiny_config, tiny_data_dir):
    # The plain (2, 2, 2) run is test_loss_and_grad_norm_agree_across_meshes' (the same programs: compiled once).
    cfg = mesh_config(tiny_config, "dp_fsdp_tp", (2, 2, 2), **{"optim.warmup_steps": 0, "mesh.dcn_fsdp": 2})
    facts = config_lib.validate(cfg, 8)
    assert facts.dcn == {**dict.fromkeys(mesh_lib.AXES, 1), "fsdp": 2}
    it = pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=8, seed=0)
    batches = [next(it) for _ in range(3)]
    hybrid = trainer_lib.build_trainer(cfg, facts)
    plain = trainer_lib.build_trainer(cfg, dataclasses.replace(facts, dcn={}))
    assert granule_of(hybrid.mesh).tolist() != granule_of(plain.mesh).tolist()  # a different device layout
    np.testing.assert_allclose(three_steps(hybrid, batches), three_steps(plain, batches), rtol=1e-6, atol=0)
