"""Sequence, pipeline and expert parallelism of the whole model on 8 fake CPU devices, each against the same
model on one device; and every axis at once on 16 devices (tests/parallel_worker.py, in a subprocess)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain import config as config_lib
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline as pipeline_parallel
from jaxtrain.tools.plan.collectives import collectives
from jaxtrain.tools.plan.planner import per_device_bytes
from jaxtrain import objectives
from jaxtrain import train
from jaxtrain.models import transformer
from jaxtrain import trainer as trainer_lib
from jaxtrain.observe import hlo as hlo_lib
from helpers import cpu_flags, read_jsonl, trainer_on
from parallel_worker import MESH_KEYS, leaf_errors, synthetic_batches, train_steps

REPO = Path(__file__).resolve().parents[2]


def configure(tiny_config, mesh=None, **overrides):
    """The tiny config (conftest) on `mesh` ({axis: size}; the rest 1, data -1), warmup 0 so step 1 moves."""
    mesh = {"data": -1, **{a: 1 for a in MESH_KEYS if a != "data"}, **(mesh or {})}
    return tiny_config(**{**{f"mesh.{a}": n for a, n in mesh.items()}, "optim.warmup_steps": 0, **overrides})


def single_device(cfg):
    """`cfg` on one device, unpipelined, without gradient accumulation (numerically the full-batch step): the
    references of the pipeline (and accumulation) tests are then one program, compiled once."""
    cfg = cfg.copy_and_resolve_references()
    cfg.mesh.update({a: 1 for a in MESH_KEYS})
    cfg.pipeline.update(stages=1, microbatches=1, schedule="gpipe", repeats=1)
    cfg.train.microbatches = 1
    return cfg


_REFERENCE_RUNS = {}


def one_device_steps(cfg, batches):
    """train_steps on one device, kept per (config, batches): several tests share a reference run."""
    key = (json.dumps({k: v for k, v in cfg.to_dict().items() if k != "workdir"}, sort_keys=True, default=str),
           tuple(hashlib.sha256(v.tobytes()).hexdigest() for b in batches for _, v in sorted(b.items())))
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = train_steps(cfg, batches, devices=jax.devices()[:1])
    return {k: v.copy() for k, v in _REFERENCE_RUNS[key].items()}


def assert_same_training(cfg, reference_cfg, batches):
    """Loss and gradient norm (and MoE metrics) of every step agree. Parameters are not compared: Adam's
    first steps turn a 1e-7 difference in a near-zero gradient into a full learning-rate step."""
    got = train_steps(cfg, batches)
    want = one_device_steps(reference_cfg, batches)
    assert want["loss"][-1] < want["loss"][0]  # the steps do train (otherwise agreement would be cheap)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    return got


def forward_fn(trainer):
    def forward(params, batch):
        with mesh_lib.activation_sharding(trainer.mesh, trainer.rules):
            return nnx.merge(trainer.graphdef, params)(batch["tokens"], batch["positions"], batch["segment_ids"])
    return jax.jit(forward)


# --- Sequence (context) parallelism ---------------------------------------------------------------------------


def test_sequence_parallel_splits_activations_and_keeps_attention_exact(tiny_config):
    cfg = configure(tiny_config, {"data": 2, "sequence": 4})
    facts = config_lib.validate(cfg, 8)
    trainer = trainer_lib.build_trainer(cfg, facts)
    reference = trainer_on(single_device(cfg), {}, facts.rules, devices=jax.devices()[:1])
    state = trainer.init()
    batch = synthetic_batches(1, 8, 32, 512)[0]
    logits = forward_fn(trainer)(state["params"], trainer_lib.global_batch(batch, trainer.batch_sharding))
    # Batch over data, the sequence over the 4 sequence devices: each holds 4 rows x 8 positions.
    assert logits.sharding.spec[:2] == ("data", "sequence")
    assert {s.data.shape for s in logits.addressable_shards} == {(4, 8, 512)}
    params = jax.device_put(jax.device_get(state["params"]), jax.devices()[0])
    want = forward_fn(reference)(params, trainer_lib.global_batch(batch, reference.batch_sharding))
    # Every document spans several sequence shards, so queries on one device attend to keys on others.
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)


# Sequence 8 alone: test_context_model's ring (allgather, the default, is this mesh's).
@pytest.mark.parametrize("mesh", [{"data": 2, "sequence": 2, "tensor": 2}], ids=["data2_sequence2_tensor2"])
def test_sequence_parallel_trains_like_one_device(tiny_config, mesh):
    cfg = configure(tiny_config, mesh)
    assert_same_training(cfg, single_device(cfg), synthetic_batches(1, 8, 32, 512) * 3)


@pytest.mark.parametrize("chunk_tokens", [0, 16], ids=["plain_logits", "fused_loss_2_chunks"])
def test_sequence_parallel_splits_the_matmuls_and_moves_only_keys_and_values(tiny_config, chunk_tokens):
    """The compiled step on data 2 x sequence 4: each device runs the matmuls of its own positions only (HLO dot
    FLOPs of all devices within 1.3x the model's; when the projections merged batch and sequence into one
    dimension, XLA gathered their inputs and every device computed all positions: 3.9x), and along `sequence` it
    gathers each layer's K and V and nothing else (the gradients come back as reduce-scatters)."""
    cfg = configure(tiny_config, {"data": 2, "sequence": 4}, **{"model.loss_chunk_tokens": chunk_tokens})
    facts = config_lib.validate(cfg, 8)
    trainer = trainer_lib.build_trainer(cfg, facts)
    batch = trainer_lib.global_batch(synthetic_batches(1, 8, 32, 512)[0], trainer.batch_sharding)
    text = trainer.train_step.lower(trainer.abstract_state, batch).compile().as_text()
    m = trainer.model_cfg
    model_flops = transformer.train_flops_per_token(m, 32) * 8 * 32
    assert hlo_lib.dot_flops(text) * 8 < 1.3 * model_flops, hlo_lib.dot_flops(text) * 8 / model_flops
    gathers = [op for op in collectives(text, facts.mesh_shape) if op["kind"] == "all-gather"]
    assert {op["axes"] for op in gathers} == {("sequence",)}
    rows = 8 // 2  # per data shard
    kv_bytes = m.n_layers * 2 * rows * 32 * m.n_kv_heads * m.head_dim * 4  # f32 K and V of every layer, whole
    assert kv_bytes <= sum(op["bytes"] for op in gathers) <= kv_bytes + 2 * rows * 32 * 4  # + int32 segment ids


def test_sequence_axis_must_divide_the_sequence(tiny_config):
    with pytest.raises(config_lib.ConfigError, match="train.seq_len: 36 is not divisible by mesh.sequence=8"):
        config_lib.validate(configure(tiny_config, {"sequence": 8}, **{"train.seq_len": 36}), 8)


# --- Pipeline parallelism -------------------------------------------------------------------------------------

MOE = {"model.n_experts": 4, "model.moe_top_k": 2, "model.moe_capacity_factor": 1.0}
PIPELINES = {  # id: (mesh, pipeline settings); the model gets 4 layers
    "gpipe4": ({"pipeline": 4, "data": 2}, dict(stages=4, microbatches=4, schedule="gpipe")),
    "gpipe2_tensor": ({"pipeline": 2, "data": 2, "tensor": 2}, dict(stages=2, microbatches=2, schedule="gpipe")),
    "circular2x2": ({"pipeline": 2, "fsdp": 4}, dict(stages=2, microbatches=2, schedule="circular", repeats=2)),
    # A dropless mixture of experts: experts split over `expert` inside each stage, each fsdp shard's tokens
    # sorted on their own (a shard_map inside the stages' vmap); the balancing loss is the whole batch's. Before
    # the 4 pipelined layers, a dense one (DeepSeek-V3's first_dense_layers) that runs outside the pipeline.
    "gpipe2_expert2": ({"pipeline": 2, "expert": 2, "fsdp": 2}, dict(stages=2, microbatches=2, schedule="gpipe")),
}
DENSE_FIRST = {"model.n_layers": 5, "model.first_dense_layers": 1, "model.dense_d_ff": 64}


def pipelined_config(tiny_config, name):
    mesh, settings = PIPELINES[name]
    moe = {**MOE, "model.moe_routing": "dropless", **DENSE_FIRST} if "expert" in mesh else {}
    return configure(tiny_config, mesh, **{"model.n_layers": 4, **moe},
                     **{f"pipeline.{k}": v for k, v in settings.items()})


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_loss_and_gradients_equal_the_unpipelined_model(tiny_config, name):
    cfg = pipelined_config(tiny_config, name)
    facts = config_lib.validate(cfg, 8)
    trainer = trainer_lib.build_trainer(cfg, facts)
    reference = trainer_on(single_device(cfg), {}, facts.rules, devices=jax.devices()[:1])
    state = trainer.init()
    # The state keeps the stacked layers in the pipeline's order (circular: stage-major); the reference the model's.
    order = transformer.layer_order(trainer.model_cfg, config_lib.layout(cfg))
    assert (order != tuple(range(4))) == (cfg.pipeline.schedule == "circular")
    params = pipeline_parallel.reorder_layers(jax.device_get(state["params"]), order, None)
    if order != tuple(range(4)):  # weights given in the model's order (model.init_from) land in the same order
        given = trainer.init_from_host(params)["params"]
        for got, want in zip(jax.tree.leaves(jax.device_get(given)), jax.tree.leaves(jax.device_get(state["params"]))):
            np.testing.assert_array_equal(got, want)
    # Stage s holds its chunks' layers: the stacked layer axis is split over the pipeline axis.
    wq = state["params"]["blocks"]["attn"]["wq"]
    assert wq.sharding.spec[0] == "pipeline" and wq.addressable_shards[0].data.shape[0] == 4 // cfg.mesh.pipeline
    batch = synthetic_batches(1, 8, 32, 512)[0]

    def loss_and_grads(t, p):
        def f(p, b):  # the cross-entropy, plus a mixture of experts' balancing loss (the whole batch's)
            with mesh_lib.activation_sharding(t.mesh, t.rules):
                total, count, aux = objectives.loss_terms(t.graphdef, p, b)
                return total / count + aux.get("load_balance_loss", 0.0), aux
        return jax.jit(jax.value_and_grad(f, has_aux=True))(p, trainer_lib.global_batch(batch, t.batch_sharding))

    (loss, aux), grads = loss_and_grads(trainer, state["params"])
    (want_loss, want_aux), want_grads = loss_and_grads(reference, jax.device_put(params, jax.devices()[0]))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    moe_keys = {"load_balance_loss", "dropped_fraction", "max_load", "min_load", "expert_load"}
    assert set(aux) == set(want_aux) == (moe_keys if cfg.model.n_experts else set())
    for key in want_aux:  # expert_load: [layers, experts], in the model's layer order either way
        np.testing.assert_allclose(np.asarray(aux[key]), np.asarray(want_aux[key]), rtol=1e-5, err_msg=key)
    errors = leaf_errors(pipeline_parallel.reorder_layers(jax.device_get(grads), order, None),
                         jax.device_get(want_grads))
    assert max(errors.values()) < 1e-5, errors


def test_pipeline_splits_the_vocabulary_table_and_reduces_gradients_over_data_once(tiny_config):
    """The (tied) embedding is not pipelined; the presets split it along the vocab over `pipeline` as well, so each
    stage holds a quarter of it and of its Adam moments and computes a quarter of the logits. When every stage
    held it whole and ran its data shard's whole head and loss, HLO dot FLOPs were 3.4x the model's here. And
    the gradients cross `data` once a step, not on each of the 7 ticks (each replica keeps its own copy of the
    stage weights through the tick loop)."""
    cfg = pipelined_config(tiny_config, "gpipe4")
    cfg.model.vocab_size = 4096  # the head dominates, as in configs/bench_cpu.py
    facts = config_lib.validate(cfg, 8)
    trainer = trainer_lib.build_trainer(cfg, facts)
    state = trainer.abstract_state
    for tree in (state["params"]["embed"], state["opt_state"]):
        tables = [x for x in jax.tree.leaves(tree) if x.shape == (4096, 32)]
        assert tables and all(x.sharding.shard_shape(x.shape) == (1024, 32) for x in tables)
    batch = trainer_lib.global_batch(synthetic_batches(1, 8, 32, 512)[0], trainer.batch_sharding)
    text = trainer.train_step.lower(state, batch).compile().as_text()
    model_flops = transformer.train_flops_per_token(trainer.model_cfg, 32) * 8 * 32
    # The layers' share runs 7 ticks for 4 microbatches (the bubble); the head's is done once.
    assert hlo_lib.dot_flops(text) * 8 < 1.5 * model_flops, hlo_lib.dot_flops(text) * 8 / model_flops
    over_data = [op for op in collectives(text, facts.mesh_shape) if "data" in op["axes"]]
    assert {(op["kind"], op["axes"]) for op in over_data} == {("all-reduce", ("data",))}
    # Every gradient shard once; the tied table twice (XLA reduces its lookup and head parts one after the other).
    once = per_device_bytes(state["params"]) + 1024 * 32 * 4
    assert sum(op["bytes"] for op in over_data) == pytest.approx(once, rel=0.01)


@pytest.mark.parametrize("name", ["gpipe2_tensor", "circular2x2"])  # MoE: the 16-device run trains one
def test_pipeline_trains_like_one_device(tiny_config, name):
    cfg = pipelined_config(tiny_config, name)
    cfg.train.steps = 3  # the bubble test's run: the circular train step is compiled once for both
    if name == "gpipe2_tensor":  # with gradient accumulation too: per-replica copies around the pipeline
        cfg.train.microbatches = 2
    assert_same_training(cfg, single_device(cfg), synthetic_batches(1, 8, 32, 512) * 3)


def test_pipeline_run_reports_the_bubble_and_resumes(tiny_config, tmp_path):
    cfg = pipelined_config(tiny_config, "circular2x2")
    cfg.train.update(steps=3)  # as test_pipeline_trains_like_one_device[circular2x2]: the same train step
    cfg.checkpoint.every_steps = 3
    lines = []
    result = train.run(cfg, print_fn=lines.append)
    assert result["finished"] and result["step"] == 3
    # 2 stages, 2 microbatches, 2 repeats: (S - 1) / (R*M + S - 1) = 1/5 of each step idle.
    assert any("pipeline 2 stages x 2 microbatches, circular schedule x 2 repeats | bubble 20.0%" in line
               for line in lines), lines
    # The checkpoint holds the layers stage-major, as the run kept them; tools get them in the model's order.
    order = pipeline_parallel.layer_order(4, 2, 2)
    _, _, _, params = trainer_lib.restore_params(cfg.workdir)
    want = pipeline_parallel.reorder_layers(jax.device_get(result["state"]["params"]), order, None)
    for got, expected in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(got, expected)
    # It restores onto a plain data-parallel mesh (orbax reshards, the layers move into the model's order).
    cfg.mesh.update(pipeline=1, fsdp=1, data=-1)
    cfg.pipeline.update(stages=1, schedule="gpipe", repeats=1)
    cfg.train.steps = 4
    again = train.run(cfg, print_fn=lines.append)
    assert again["resumed"] and again["step"] == 4
    losses = [r["loss"] for r in read_jsonl(Path(cfg.workdir) / "metrics.jsonl") if "loss" in r]
    assert len(losses) >= 2 and np.isfinite(losses).all()


@pytest.mark.parametrize("overrides, message", [
    ({"mesh.pipeline": 2}, "mesh.pipeline: 2 does not divide pipeline.stages=1"),
    ({"pipeline.stages": 3, "model.n_layers": 4}, "pipeline.stages"),
    ({"pipeline.stages": 2, "pipeline.microbatches": 3}, "pipeline.microbatches"),
    ({"pipeline.stages": 2, "pipeline.schedule": "1f2b"}, "pipeline.schedule"),
])
def test_bad_pipeline_settings_name_the_field(tiny_config, overrides, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(configure(tiny_config, **overrides), 8)


# --- Expert parallelism ---------------------------------------------------------------------------------------

# Capacity routing; dropless on data 2 x expert 4 and expert 8 is test_moe's.
@pytest.mark.parametrize("mesh", [{"expert": 2, "fsdp": 2, "tensor": 2}], ids=["expert2_fsdp2_tensor2"])
def test_expert_parallel_trains_like_one_device(tiny_config, mesh):
    cfg = configure(tiny_config, mesh, **MOE)
    got = assert_same_training(cfg, single_device(cfg), synthetic_batches(1, 8, 32, 512) * 3)
    assert 0 < got["moe/dropped_fraction"][0] < 0.5  # capacity 1.0 with 32 tokens: some assignments drop
    assert (got["moe/load_balance_loss"] >= 1.0 - 1e-6).all()


def test_expert_parallel_with_sequence_shards_routes_within_them(tiny_config):
    """expert 2 x sequence 4 with 8-token routing groups (one per sequence shard): trains like one device with the
    same groups, and each shard runs only its own groups' experts (HLO dot FLOPs 1.4x the model's; with
    whole-sequence groups every sequence shard ran every slot: 3.0x)."""
    cfg = configure(tiny_config, {"expert": 2, "sequence": 4}, **MOE, **{"model.moe_group_tokens": 8})
    got = assert_same_training(cfg, single_device(cfg), synthetic_batches(1, 8, 32, 512) * 3)
    assert 0 < got["moe/dropped_fraction"][0] < 0.5
    facts = config_lib.validate(cfg, 8)
    trainer = trainer_lib.build_trainer(cfg, facts)
    batch = trainer_lib.global_batch(synthetic_batches(1, 8, 32, 512)[0], trainer.batch_sharding)
    text = trainer.train_step.lower(trainer.abstract_state, batch).compile().as_text()
    model_flops = transformer.train_flops_per_token(trainer.model_cfg, 32) * 8 * 32
    assert hlo_lib.dot_flops(text) * 8 < 1.6 * model_flops, hlo_lib.dot_flops(text) * 8 / model_flops


def test_expert_weights_live_on_the_expert_axis(tiny_config):
    cfg = configure(tiny_config, {"expert": 4, "data": 2}, **MOE)
    facts = config_lib.validate(cfg, 8)
    state = trainer_lib.build_trainer(cfg, facts).init()
    w_gate = state["params"]["blocks"]["mlp"]["w_gate"]  # [layers, experts, embed, mlp]
    assert w_gate.shape == (2, 4, 32, 64)
    assert {s.data.shape for s in w_gate.addressable_shards} == {(2, 1, 32, 64)}
    mu = state["opt_state"][1][0].mu["blocks"]["mlp"]["w_gate"]  # Adam's moment shards like its parameter
    assert {s.data.shape for s in mu.addressable_shards} == {(2, 1, 32, 64)}


@pytest.mark.parametrize("overrides, message", [
    ({"mesh.expert": 2}, "mesh.expert: size 2 needs a mixture of experts"),
    ({**MOE, "mesh.expert": 8}, "mesh.expert: 8 does not divide model.n_experts=4"),
    ({**MOE, "model.moe_top_k": 5}, "model.moe_top_k: 5 exceeds model.n_experts=4"),
    ({**MOE, "model.moe_group_tokens": 12}, "model.moe_group_tokens: 12 does not divide train.seq_len=32"),
    ({**MOE, "model.moe_group_tokens": 16, "mesh.sequence": 4}, "model.moe_group_tokens: the 2 groups of a sequence"),
])
def test_bad_expert_settings_name_the_field(tiny_config, overrides, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(configure(tiny_config, **overrides), 8)


# --- Everything at once: 16 devices ---------------------------------------------------------------------------


@pytest.mark.slow
def test_all_axes_combined_on_16_devices(tmp_path):
    """data x fsdp x tensor x pipeline (a dense model) and data x expert x tensor x pipeline (a mixture of experts),
    each 3 steps against its single-device run, in a process that sees 16 devices."""
    env = {**os.environ, "XLA_FLAGS": cpu_flags(16), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    out = tmp_path / "combined.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "parallel_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"data2_fsdp2_tensor2_pipeline2", "data2_expert2_tensor2_pipeline2"}
    for name, r in results.items():
        assert r["devices"] == 16 and r["mesh"] == {a: 2 for a in r["mesh"]}, name
        want = {key: w for key, (_, w) in r["metrics"].items()}
        assert {"loss", "grad_norm"} <= set(want) and ("moe/dropped_fraction" in want) == ("expert" in name)
        for key, (got, want_values) in r["metrics"].items():
            np.testing.assert_allclose(got, want_values, rtol=1e-5, atol=1e-7, err_msg=f"{name} {key}")
        assert want["loss"][-1] < want["loss"][0], name
