"""The optimizer zoo (optim.name), per-group settings (optim.groups) and bf16 moments (optim.moments_dtype).

The default AdamW's layout and numerics are tested in test_step.py; here each other optimizer trains, runs the
same on 8 devices as on one, shards its state like the parameters, and Muon equals a numpy reference.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import config as config_lib
from jaxtrain import memory
from jaxtrain import optim
from jaxtrain import trainer as trainer_lib
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import mesh as mesh_lib
from helpers import step_history, train_on_stream, trainer_on

# Each optimizer's learning rate for the tiny model (Lion's sign updates want a smaller one, SGD a larger one).
LRS = {"adamw": 1e-2, "muon": 1e-2, "adafactor": 1e-2, "lion": 3e-3, "sgd": 0.3}


def optimizer_for(params, names, **settings):
    o = config_lib.base_config().optim
    o.update(warmup_steps=0, schedule="constant", clip_norm=0.0, **settings)
    return optim.make_optimizer(o, total_steps=10, param_names=names)


# --- Muon -------------------------------------------------------------------------------------------------


def newton_schulz(x, steps=5, coeffs=(3.4445, -4.775, 2.0315), eps=1e-8):
    """Muon's quintic Newton-Schulz orthogonalisation (Jordan 2024), in float64."""
    transposed = x.shape[0] > x.shape[1]
    x = x.T if transposed else x
    x = x / (np.linalg.norm(x) + eps)
    a, b, c = coeffs
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def muon_problem():
    """(params, grads, logical names): a layer stack of two [8, 12] matrices (Muon's) and an embedding (AdamW's)."""
    rng = np.random.default_rng(0)
    params = {"blocks": {"mlp": {"w_up": rng.normal(size=(2, 8, 12)).astype(np.float32)}},
              "embed": rng.normal(size=(5, 8)).astype(np.float32)}
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
    return params, grads, {"blocks": {"mlp": {"w_up": P("layers", "embed", "mlp")}}, "embed": P("vocab", "embed")}


def muon_direction(g, beta):
    """The matrices' first Muon direction in float64: Nesterov momentum with bias correction (mu_1 = (1 - beta) g,
    then beta * mu_1 / (1 - beta^2) + (1 - beta) g / (1 - beta)), Newton-Schulz, the 0.2 * sqrt(fan) RMS match."""
    g = g.astype(np.float64)
    return np.stack([newton_schulz(m) for m in beta * (1 - beta) * g / (1 - beta**2) + g]) * 0.2 * np.sqrt(12)


def test_muon_first_update_equals_a_numpy_reference():
    """One Muon step on a layer stack of two [8, 12] matrices (each orthogonalised alone) and AdamW on the
    embedding: Nesterov momentum with bias correction, Newton-Schulz, the 0.2 * sqrt(max(fan_in, fan_out)) RMS
    match, decoupled weight decay, times -lr."""
    params, grads, names = muon_problem()
    lr, wd, beta = 0.02, 0.1, 0.95
    tx = optimizer_for(params, names, name="muon", lr=lr, weight_decay=wd, momentum=beta)
    updates, _ = tx.update(grads, tx.init(params), params)

    want = -lr * (muon_direction(grads["blocks"]["mlp"]["w_up"], beta) + wd * params["blocks"]["mlp"]["w_up"])
    np.testing.assert_allclose(updates["blocks"]["mlp"]["w_up"], want, rtol=2e-5, atol=1e-7)
    # The embedding trains with AdamW: its first update is lr * g / (|g| + eps) plus decay.
    e, ge = params["embed"], grads["embed"]
    np.testing.assert_allclose(updates["embed"], -lr * (ge / (np.abs(ge) + 1e-8) + wd * e), rtol=1e-5)


@pytest.mark.parametrize("setting, compute, low", [("bfloat16", "float32", True), ("auto", "bfloat16", True),
                                                   ("auto", "float32", False)])
def test_muon_newton_schulz_in_bfloat16_tracks_float32_in_the_same_state(setting, compute, low):
    """optim.muon_ns_dtype: in bf16 (set, or `auto` under 16-bit compute) the iterations' matmuls take bf16 and the
    update stays f32, a bf16 approximation of the float64 reference (Jordan's reference runs them in bf16); the
    optimizer state is the f32 setting's, so a run may switch it across a resume."""
    params, grads, names = muon_problem()
    o = config_lib.base_config().optim
    o.update(name="muon", warmup_steps=0, schedule="constant", clip_norm=0.0, weight_decay=0.0, muon_ns_dtype=setting)
    tx = optim.make_optimizer(o, total_steps=10, param_names=names, compute_dtype=compute)
    updates, _ = tx.update(grads, tx.init(params), params)

    want = -o.lr * muon_direction(grads["blocks"]["mlp"]["w_up"], o.momentum)
    got = np.asarray(updates["blocks"]["mlp"]["w_up"])
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert got.dtype == np.float32
    assert (1e-3 < error < 0.1) if low else error < 1e-5, error  # bf16's rounding, or none
    text = str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))
    assert bool(re.search(r"bf16\[[\d,]*\] = dot_general", text)) == low
    ref = optimizer_for(params, names, name="muon", muon_ns_dtype="float32")
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(t.init, params))  # noqa: E731
    assert shapes(tx) == shapes(ref)


def test_muon_orthogonalises_the_layer_matrices_and_leaves_the_rest_to_adamw(tiny_config):
    cfg = tiny_config(**{"model.tie_embeddings": False, "model.qkv_bias": True, "model.qk_norm": True})
    from flax import nnx

    from jaxtrain.models import transformer

    model = nnx.eval_shape(lambda: transformer.build(config_lib.model_config(cfg, "cpu"), 0))
    names = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model)))
    dims = optim.muon_dims(names)
    # wq [layers, d, heads, hd] maps d to (heads, hd); wo [layers, heads, hd, d] maps (heads, hd) to d.
    assert {k: tuple(v) for k, v in dims.items()} == {
        "blocks/attn/wq": ((1,), (2, 3)), "blocks/attn/wk": ((1,), (2, 3)), "blocks/attn/wv": ((1,), (2, 3)),
        "blocks/attn/wo": ((1, 2), (3,)), "blocks/mlp/w_gate": ((1,), (2,)), "blocks/mlp/w_up": ((1,), (2,)),
        "blocks/mlp/w_down": ((1,), (2,))}  # embed, unembed, norms, q/k norms and biases: AdamW
    # Moonlight's (DeepSeek-V3's) dense first layers are layer matrices too; the experts' lead with "experts".
    cfg = tiny_config(**{"model.n_experts": 4, "model.first_dense_layers": 1, "model.dense_d_ff": 64})
    model = nnx.eval_shape(lambda: transformer.build(config_lib.model_config(cfg, "cpu"), 0))
    dims = optim.muon_dims(nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model))))
    assert tuple(dims["dense_blocks/mlp/w_down"]) == ((1,), (2,)) and "dense_blocks/attn/wq" in dims
    assert tuple(dims["blocks/mlp/w_down"]) == ((2,), (3,)) and not any("router" in k for k in dims)


# --- Every optimizer: trains, runs the same on 8 devices, shards like the parameters --------------------------


@pytest.mark.parametrize("name", ["muon", "adafactor", "lion", "sgd"])
def test_optimizer_trains_and_runs_on_fsdp_x_tensor_like_one_device(tiny_config, tiny_data_dir, name):
    """30 steps on one device lower the held-out loss by half a nat or more. For the two whose state is not
    elementwise (Muon's orthogonalised momentum, Adafactor's factored moments) the first 3 on fsdp 2 x tensor 2 x
    data 2 give the same losses and gradient norms, and the optimizer state is split like its parameters (Lion's
    and SGD's state is one elementwise moment, laid out like AdamW's, which every 8-device test runs)."""
    cfg = tiny_config(**{"optim.name": name, "optim.lr": LRS[name], "optim.warmup_steps": 3,
                         "mesh.fsdp": 2, "mesh.tensor": 2, "train.steps": 30})
    one = trainer_on(cfg, {"data": 1, "fsdp": 1, "tensor": 1}, mesh_lib.resolve_rules("dp_fsdp_tp"),
                                    devices=jax.devices()[:1])
    before, after, history = train_on_stream(one, tiny_data_dir, 30)
    assert after < before - 0.5, name
    if name in ("lion", "sgd"):
        return
    eight = trainer_lib.build_trainer(cfg, config_lib.validate(cfg, 8))
    np.testing.assert_allclose(step_history(eight, tiny_data_dir, 3), history[:3], rtol=1e-5, atol=1e-7)

    # Moments of a parameter's rank are split like it (wq's embed over fsdp, its heads over tensor).
    def leaves(group):
        return [(optim.param_path(p), x.shape, s) for (p, x), s in zip(
            jax.tree_util.tree_leaves_with_path(eight.abstract_state[group]), jax.tree.leaves(eight.shardings[group]))]

    params = {p: (shape, s) for p, shape, s in leaves("params")}
    assert params["blocks/attn/wq"][1].shard_shape((2, 32, 8, 8)) == (2, 16, 4, 8)
    split = 0
    for path, shape, sharding in leaves("opt_state"):
        owner = next((p for p in params if path.endswith("/" + p)), None)
        if owner is None:  # counters, Muon's coefficients
            assert sharding.shard_shape(shape) == shape, path
        elif shape == params[owner][0]:
            assert sharding.shard_shape(shape) == params[owner][1].shard_shape(shape), path
            split += sharding.shard_shape(shape) != shape
        else:  # Adafactor's factored row and column statistics: replicated
            assert sharding.shard_shape(shape) == shape, path
    assert split >= 7  # every layer matrix's moment at least


def test_adafactor_factored_statistics_split_over_fsdp_like_unannotated_parameters(tiny_config):
    """Weights with two dimensions of 128 or more get Adafactor's row and column statistics, of another rank than
    the weight, so the weight's names do not fit them: they take the unannotated-parameter fallback, FSDP on their
    largest divisible dimension."""
    cfg = tiny_config(**{"optim.name": "adafactor", "model.d_model": 128, "model.d_ff": 256, "mesh.fsdp": 4})
    facts = config_lib.validate(cfg, 8)
    mesh = mesh_lib.make_mesh(facts.mesh_shape)
    _, abstract, shardings, _, _ = trainer_lib.abstract_train_state(
        config_lib.model_config(cfg, "cpu"), cfg.optim, 10, mesh, facts.rules, 0)
    leaves = {jax.tree_util.keystr(p): (x.shape, s) for (p, x), s in zip(
        jax.tree_util.tree_leaves_with_path(abstract["opt_state"]), jax.tree.leaves(shardings["opt_state"]))}
    row = next(v for k, v in leaves.items() if k.endswith(".v_row['blocks']['mlp']['w_up']"))
    col = next(v for k, v in leaves.items() if k.endswith(".v_col['blocks']['mlp']['w_up']"))
    assert [(shape, s.shard_shape(shape)) for shape, s in (row, col)] == [((2, 128), (2, 32)), ((2, 256), (2, 64))]


# --- Groups and bf16 moments ----------------------------------------------------------------------------------


def test_groups_set_weight_decay_and_learning_rate_by_path():
    """With zero gradients Adam's update is 0, so a step is pure decay, -lr * wd * p: per group. With gradients,
    a group's lr factor scales its whole update."""
    rng = np.random.default_rng(0)
    params = {"embed": rng.normal(size=(4, 3)).astype(np.float32),
              "blocks": {"attn": {"wq": rng.normal(size=(3, 3)).astype(np.float32),
                                  "wk": rng.normal(size=(3, 3)).astype(np.float32)},
                         "attn_norm": {"scale": rng.normal(size=(3,)).astype(np.float32)}}}
    lr, wd = 0.5, 0.1
    groups = "embed: lr=0.25, wd=0.4; attn/wq: wd=0"
    tx = optimizer_for(params, None, lr=lr, weight_decay=wd, groups=groups)
    zeros = jax.tree.map(np.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["embed"], -lr * 0.25 * 0.4 * params["embed"], rtol=1e-6)
    np.testing.assert_array_equal(updates["blocks"]["attn"]["wq"], 0)  # wd=0 for this group
    np.testing.assert_allclose(updates["blocks"]["attn"]["wk"], -lr * wd * params["blocks"]["attn"]["wk"], rtol=1e-6)
    np.testing.assert_array_equal(updates["blocks"]["attn_norm"]["scale"], 0)  # norms keep no decay

    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
    plain = optimizer_for(params, None, lr=lr, weight_decay=0.0)
    grouped = optimizer_for(params, None, lr=lr, weight_decay=0.0, groups="embed: lr=0.25")
    want, _ = plain.update(grads, plain.init(params), params)
    got, _ = grouped.update(grads, grouped.init(params), params)
    np.testing.assert_allclose(got["embed"], 0.25 * want["embed"], rtol=1e-6)
    np.testing.assert_array_equal(got["blocks"]["attn"]["wq"], want["blocks"]["attn"]["wq"])


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_moments_halve_the_state_and_track_float32(name):
    rng = np.random.default_rng(0)
    params = {"blocks": {"mlp": {"w_up": rng.normal(size=(2, 16, 24)).astype(np.float32)}},
              "embed": rng.normal(size=(10, 16)).astype(np.float32)}
    names = {"blocks": {"mlp": {"w_up": P("layers", "embed", "mlp")}}, "embed": P("vocab", "embed")}
    f32 = optimizer_for(params, names, name=name)
    bf16 = optimizer_for(params, names, name=name, moments_dtype="bfloat16")
    s32, s16 = f32.init(params), bf16.init(params)
    assert jax.tree.structure(s16) == jax.tree.structure(s32)  # the same checkpoint layout, other dtypes
    moments = [(a, b) for a, b in zip(jax.tree.leaves(s32), jax.tree.leaves(s16)) if a.shape in
               {x.shape for x in jax.tree.leaves(params)}]
    assert moments and all(a.dtype == jnp.float32 and b.dtype == jnp.bfloat16 for a, b in moments)
    for _ in range(3):
        grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
        u32, s32 = f32.update(grads, s32, params)
        u16, s16 = bf16.update(grads, s16, params)
        for a, b in zip(jax.tree.leaves(u32), jax.tree.leaves(u16)):
            assert b.dtype == jnp.float32
            np.testing.assert_allclose(b, a, rtol=0.05, atol=2e-3 * np.abs(a).max())


@pytest.mark.parametrize("settings, message", [
    ({"optim.name": "adam"}, "^optim.name: unknown optimizer 'adam'"),
    ({"optim.moments_dtype": "float16"}, "^optim.moments_dtype: unknown dtype"),
    ({"optim.groups": "embed lr=0.1"}, "^optim.groups: 'embed lr=0.1' is not 'PATTERN: key=value"),
    ({"optim.groups": "embed: lr=fast"}, "^optim.groups: lr='fast'"),
    ({"optim.groups": "embed: beta=1"}, "^optim.groups: 'beta=1' in 'embed: beta=1': set one of lr"),
    ({"optim.groups": "emebd: lr=0.1"}, "^optim.groups: 'emebd' matches no parameter"),
    ({"optim.groups": "[: wd=0"}, r"^optim.groups: '\[' is not a regular expression"),
], ids=["name", "moments_dtype", "syntax", "number", "key", "typo", "regex"])
def test_bad_optimizer_settings_name_the_field(tiny_config, settings, message):
    """Each is refused before anything compiles: by validate, or (a pattern that matches no parameter of the
    model) as the trainer builds the abstract model, which a run does before its workdir."""
    cfg = tiny_config(**settings)
    with pytest.raises(ConfigError, match=message):
        trainer_lib.build_trainer(cfg, config_lib.validate(cfg, 1), devices=jax.devices()[:1])


def test_a_workdir_resumes_only_with_its_optimizer_and_moment_dtype(tiny_config):
    saved = tiny_config().to_dict()
    for field, value in (("name", "lion"), ("moments_dtype", "bfloat16")):
        with pytest.raises(ConfigError, match=f"^optim.{field}: is '{value}' but the checkpoints"):
            config_lib.check_resumable(saved, tiny_config(**{f"optim.{field}": value}), "w")
    config_lib.check_resumable(saved, tiny_config(**{"optim.groups": "embed: lr=0.1", "model.quant": "fp8"}), "w")


# --- Host offload (optim.offload, model.remat=offload_dots) ----------------------------------------------------


def test_offload_keeps_the_optimizer_state_in_host_memory_and_changes_no_number(tiny_config, tiny_data_dir, tmp_path):
    """fsdp 2 x tensor 2 x data 2: with optim.offload the optimizer state's shards sit in pinned host memory before
    and after each step, its layout unchanged, and 3 steps give the same bits as without. A checkpoint saved
    offloaded restores into a run without offload (and back) with its checksums verified."""
    cfg = tiny_config(**{"mesh.fsdp": 2, "mesh.tensor": 2})
    facts = config_lib.validate(cfg, 8)
    plain = trainer_lib.build_trainer(cfg, facts)
    cfg.optim.offload = True
    off = trainer_lib.build_trainer(cfg, facts)
    kinds = lambda tree: {getattr(x, "sharding", x).memory_kind for x in jax.tree.leaves(tree)}  # noqa: E731
    assert kinds(off.shardings["opt_state"]) == {"pinned_host"} and kinds(off.shardings["params"]) == {"device"}
    assert jax.tree.map(lambda s: s.spec, off.shardings["opt_state"]) == jax.tree.map(
        lambda s: s.spec, plain.shardings["opt_state"])
    np.testing.assert_array_equal(step_history(off, tiny_data_dir, 3), step_history(plain, tiny_data_dir, 3))

    from jaxtrain import checkpoint as ckpt_lib
    from jaxtrain.data import pipeline

    batch = trainer_lib.global_batch(next(pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=8, seed=0)),
                                     off.batch_sharding)
    trainers = {"offloaded": off, "plain": plain}
    states = {k: t.train_step(t.init(), batch)[0] for k, t in trainers.items()}
    assert kinds(states["offloaded"]["opt_state"]) == {"pinned_host"}
    want = jax.device_get(states["plain"])
    for saver, loader in (("offloaded", plain), ("plain", off)):
        checkpointer = ckpt_lib.Checkpointer(tmp_path / saver, keep=2)
        checkpointer.save(1, states[saver], {})
        checkpointer.wait()
        restored, _ = checkpointer.restore(1, loader.abstract_state)
        assert kinds(restored["opt_state"]) == kinds(loader.shardings["opt_state"])
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), want)
        checkpointer.close()


def test_remat_offload_dots_gives_the_same_gradients_as_keeping_them(tiny_config, tiny_data_dir):
    """model.remat=offload_dots saves the same matmul outputs as dots_with_no_batch_dims_saveable, in host
    memory: the same losses and gradient norms, bit for bit."""
    runs = {}
    for remat in ("dots_with_no_batch_dims_saveable", "offload_dots"):
        cfg = tiny_config(**{"model.remat": remat})
        one = trainer_on(cfg, {"data": 1, "fsdp": 1, "tensor": 1},
                                        mesh_lib.resolve_rules("dp_fsdp_tp"), devices=jax.devices()[:1])
        runs[remat] = step_history(one, tiny_data_dir, 3)
    np.testing.assert_array_equal(runs["offload_dots"], runs["dots_with_no_batch_dims_saveable"])


# --- Gradient reduction in bf16 (optim.grad_reduce_dtype) -------------------------------------------------------


def test_bf16_gradient_reduction_tracks_f32_within_1e_3_over_10_steps(tiny_config, tiny_data_dir):
    """data 2 x fsdp 4 with 2 microbatches: the weight gradients are reduce-scattered over fsdp in bf16 (each
    matmul's and the fused head's) and summed over the data replicas in bf16 (per-replica accumulation). 10 steps
    stay within 1e-3 of the f32 reduction's losses, and differ from them: the bf16 rounding did happen. So do
    they with error feedback, which changes them again."""
    runs = {}
    for name, settings in {"float32": {}, "bfloat16": {"optim.grad_reduce_dtype": "bfloat16"},
                           "feedback": FEEDBACK}.items():
        cfg = tiny_config(**settings, **{"mesh.data": 2, "mesh.fsdp": 4, "train.microbatches": 2,
                                         "train.batch_size": 16, "train.steps": 10})
        facts = config_lib.validate(cfg, 8)
        runs[name] = step_history(trainer_lib.build_trainer(cfg, facts), tiny_data_dir, 10, batch=16)[:, 0]
    for name in ("bfloat16", "feedback"):
        np.testing.assert_allclose(runs[name], runs["float32"], rtol=1e-3)
        assert not np.array_equal(runs[name], runs["float32"])
    assert not np.array_equal(runs["feedback"], runs["bfloat16"])


FEEDBACK = {"optim.grad_reduce_dtype": "bfloat16", "optim.grad_reduce_error_feedback": True}


def test_error_feedback_residual_is_split_per_replica_checkpointed_and_reset_on_another_mesh(
        tiny_config, tiny_data_dir, tmp_path):
    """data 2 x fsdp 4 without accumulation: the residual is [replicas, *param] split over data and like its
    param, nonzero after a step where the sum rounded, saved and resumed bit for bit. A run without error feedback restores the same
    checkpoint without reading it; one on 4 replicas, or one turning error feedback on, starts it from zeros and
    says so."""
    from jaxtrain import checkpoint as ckpt_lib, step as step_lib
    from jaxtrain.data import pipeline

    def build(data, fsdp, **settings):
        cfg = tiny_config(**settings, **{"mesh.data": data, "mesh.fsdp": fsdp, "train.batch_size": 16})
        facts = config_lib.validate(cfg, 8)
        return trainer_lib.build_trainer(cfg, facts)

    ef, plain, wider = build(2, 4, **FEEDBACK), build(2, 4), build(4, 2, **FEEDBACK)
    stream = pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=16, seed=0)
    batches = [trainer_lib.global_batch(next(stream), ef.batch_sharding) for _ in range(4)]
    state = ef.init()
    residual = state[step_lib.RESIDUAL]["blocks"]["mlp"]["w_up"]  # [replicas, layers, d, d_ff]: fsdp splits d
    assert residual.shape == (2, 2, 32, 64) and residual.sharding.shard_shape(residual.shape) == (1, 2, 8, 64)
    assert jax.tree.structure(state[step_lib.RESIDUAL]) == jax.tree.structure(state["params"])
    for batch in batches[:2]:
        state, _ = ef.train_step(state, batch)
    # Without accumulation a weight matmul's gradient is bf16 out of its matmul (layers.weight_grad_in): the sum's
    # rounding loses nothing of it. The f32 gradients (norm scales, the lookup table's scatter) do lose bits.
    kept = {optim.param_path(p): float(np.abs(x).max())
            for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(state[step_lib.RESIDUAL]))}
    assert {p for p, m in kept.items() if m > 0} == {"blocks/attn_norm/scale", "blocks/mlp_norm/scale", "embed",
                                                     "final_norm/scale"}, kept

    logs = []
    checkpointer = ckpt_lib.Checkpointer(tmp_path / "ef", keep=2, log=logs.append, resettable=(step_lib.RESIDUAL,))
    checkpointer.save(2, state, {})
    checkpointer.wait()
    restored, _ = checkpointer.restore(2, ef.abstract_state)
    params = jax.device_get(state["params"])
    without, _ = checkpointer.restore(2, plain.abstract_state)
    assert step_lib.RESIDUAL not in without and logs == []
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(without["params"]), params)
    moved, _ = checkpointer.restore(2, wider.abstract_state)
    assert len(logs) == 1 and "grad_residual was saved in another shape or not at all" in logs[0]
    assert {x.shape[0] for x in jax.tree.leaves(moved[step_lib.RESIDUAL])} == {4}
    assert not any(np.any(x) for x in jax.tree.leaves(jax.device_get(moved[step_lib.RESIDUAL])))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(moved["params"]), params)
    checkpointer.close()

    turned_on = ckpt_lib.Checkpointer(tmp_path / "plain", keep=2, log=logs.append, resettable=(step_lib.RESIDUAL,))
    turned_on.save(2, without, {})
    turned_on.wait()
    assert not any(np.any(x) for x in jax.tree.leaves(jax.device_get(
        turned_on.restore(2, ef.abstract_state)[0][step_lib.RESIDUAL]))) and len(logs) == 2
    turned_on.close()

    for batch in batches[2:]:
        state, _ = ef.train_step(state, batch)
        restored, _ = ef.train_step(restored, batch)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))


def test_error_feedback_sends_what_the_last_rounding_lost():
    """step.sum_with_feedback against numpy: each replica sends bf16(g + e) and keeps (g + e) - bf16(g + e); the
    sum over the replicas is taken in bf16. Over 100 steps of one replica's constant gradient, what was sent
    adds up to the exact sum less the last residual (a bf16 rounding of one step), where plain rounding is
    off by 100 of them."""
    from jaxtrain import step as step_lib

    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), np.float32)  # noqa: E731
    rng = np.random.default_rng(0)
    g, e = rng.normal(size=(4, 3, 5)).astype(np.float32), (rng.normal(size=(4, 3, 5)) * 1e-3).astype(np.float32)
    sums, new = step_lib.sum_with_feedback({"w": g}, {"w": e}, jnp.bfloat16)
    sent = bf16(g + e)
    want = sent[0]
    for r in range(1, 4):
        want = bf16(want + sent[r])
    np.testing.assert_array_equal(sums["w"], want)
    np.testing.assert_array_equal(new["w"], (g + e) - sent)

    g = (1 + rng.uniform(size=(1, 64)) * 1e-2).astype(np.float32)  # most of these lose bits in bf16
    residual, total = np.zeros_like(g), np.zeros(g.shape[1:], np.float64)
    step = jax.jit(lambda g, e: step_lib.sum_with_feedback(g, e, jnp.bfloat16))
    for _ in range(100):
        sent, residual = step(g, residual)
        total += np.asarray(sent, np.float64)
    exact = 100 * g[0].astype(np.float64)
    np.testing.assert_allclose(total + residual[0], exact, rtol=1e-6)
    assert np.abs(total - exact).max() <= 2 ** -7  # one bf16 ulp at 1
    assert np.abs(100 * bf16(g[0]) - exact).max() > 10 * 2 ** -7


def test_error_feedback_settings_name_the_field(tiny_config):
    """optim.grad_reduce_error_feedback needs bf16 reductions, and replicas to keep residuals for."""
    field = "optim.grad_reduce_error_feedback"
    on = {field: True, "optim.grad_reduce_dtype": "bfloat16", "mesh.data": 2}
    for settings, devices, message in (
            ({field: True}, 2, "set optim.grad_reduce_dtype=bfloat16"),
            ({**on, "mesh.data": 1}, 1, "needs data-parallel replicas"),
            ({**on, "mesh.data": 1, "mesh.fsdp": 2}, 2, "needs data-parallel replicas"),
            ({**on, "model.n_experts": 4}, 2, "model.n_experts"),
            ({**on, "pipeline.stages": 2, "mesh.pipeline": 2, "mesh.data": 2}, 4, "pipeline.stages")):
        with pytest.raises(ConfigError, match=f"^{re.escape(field)}: .*{re.escape(message)}"):
            config_lib.validate(tiny_config(**settings), devices)
    config_lib.validate(tiny_config(**on), 2)


def test_weight_grad_in_gives_the_matmul_gradient_from_a_matmul_with_that_dtype():
    """layers.weight_grad_in: dx as the plain matmul's; dw = x^T g rounded once to the dtype, over every lead dim."""
    from jaxtrain.models import layers

    rng = np.random.default_rng(0)
    x, w, g = (rng.normal(size=s).astype(np.float32) for s in ((2, 3, 4, 5), (4, 5, 6), (2, 3, 6)))
    f = lambda x, w: jnp.einsum("btkc,kcn->btn", x, w)  # noqa: E731
    _, vjp = jax.vjp(lambda x, w: layers.weight_grad_in(f, jnp.bfloat16, x, w), x, w)
    dx, dw = vjp(g)
    np.testing.assert_allclose(dx, np.einsum("btn,kcn->btkc", g, w), rtol=1e-5, atol=1e-6)
    want = np.einsum("btkc,btn->kcn", x.astype(np.float64), g)
    assert dw.dtype == np.float32 and not np.array_equal(dw, want.astype(np.float32))
    np.testing.assert_array_equal(dw, np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16), np.float32))


def test_the_memory_floor_counts_adam_moments_only_where_the_device_holds_them(tiny_config):
    """memory.step_bytes_floor (what check_fits refuses a run by): AdamW's two f32 moments are 8 bytes per matmul
    parameter, bf16 moments 4, another optimizer's or an offloaded state's none; under LoRA the frozen weights
    alone count (4 bytes), and DPO's reference copy 4 more; of a mixture of experts, every expert."""
    from jaxtrain.models import transformer

    cfg = tiny_config()
    n = transformer.matmul_params(config_lib.model_config(cfg, "cpu"))
    floors = {}
    for key, settings in {"adamw": {}, "bf16": {"optim.moments_dtype": "bfloat16"}, "offload": {"optim.offload": True},
                          "lion": {"optim.name": "lion"}, "lora": {"model.lora_rank": 4},
                          "dpo": {"train.objective": "dpo"}, "moe": {"model.n_experts": 4}}.items():
        floors[key] = memory.step_bytes_floor(tiny_config(**settings), 8)
    # A mixture's state holds every expert, not only the top-k a token uses.
    moe = config_lib.model_config(tiny_config(**{"model.n_experts": 4}), "cpu")
    assert floors["moe"] - floors["adamw"] == pytest.approx(16 * (transformer.matmul_params(moe, stored=True) - n) / 8)
    assert transformer.matmul_params(moe, stored=True) > transformer.matmul_params(moe)
    assert floors["adamw"] - floors["lora"] == pytest.approx(12 * n / 8)
    assert floors["dpo"] - floors["adamw"] == pytest.approx(4 * n / 8)
    assert floors["adamw"] - floors["bf16"] == pytest.approx(4 * n / 8)
    assert floors["adamw"] - floors["offload"] == floors["adamw"] - floors["lion"] == pytest.approx(8 * n / 8)
