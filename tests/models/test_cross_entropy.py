"""The fused, chunked output projection + cross-entropy (jaxtrain/models/cross_entropy.py) against the plain
logits -> optax cross-entropy it replaces: loss and both gradients, chunk counts, bf16, the whole train step on one
device and sharded (vocab over `tensor`, sequence over `sequence`, with the other execution knobs: attention in
query blocks, unrolled layers), and that the full logits never exist."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import config as config_lib
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.tools.plan.collectives import collectives
from jaxtrain.models import cross_entropy
from jaxtrain import trainer as trainer_lib
from jaxtrain.observe import hlo as hlo_lib
from parallel_worker import synthetic_batches

B, T, D, V = 4, 24, 16, 96


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (B, T, D)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 0.5, (D, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(rng.random((B, T)) > 0.2, jnp.float32)  # some positions do not count
    return x, w, targets, weights


def reference(x, w, targets, weights):
    logits = jnp.einsum("btd,dv->btv", x, w, precision="highest")
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)


@pytest.mark.parametrize("chunk_tokens,chunks", [(0, 1), (4 * 24, 1), (4 * 8, 3), (4 * 5, 6), (4, 24), (1, 24)])
def test_loss_and_gradients_equal_the_unfused_head(chunk_tokens, chunks):
    x, w, targets, weights = inputs()
    assert cross_entropy.n_chunks(B, T, chunk_tokens) == chunks
    fused = lambda x, w: cross_entropy.linear_cross_entropy(x, w, targets, weights, chunk_tokens, jnp.float32)
    loss, (dx, dw) = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(x, w)
    want, (want_dx, want_dw) = jax.value_and_grad(lambda x, w: reference(x, w, targets, weights), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-6)
    # Positions with weight 0 get no gradient at all.
    assert np.all(np.asarray(dx)[np.asarray(weights) == 0] == 0)
    # Without jax.grad (eval) the loss alone, the same number.
    np.testing.assert_allclose(jax.jit(fused)(x, w), want, rtol=1e-6)


def test_gradient_scales_with_the_cotangent():
    x, w, targets, weights = inputs(1)
    fused = lambda x, w: 0.25 * cross_entropy.linear_cross_entropy(x, w, targets, weights, 8, jnp.float32)
    dx, dw = jax.grad(fused, argnums=(0, 1))(x, w)
    want_dx, want_dw = jax.grad(lambda x, w: 0.25 * reference(x, w, targets, weights), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-6)


def test_chunks_have_equal_length_and_follow_the_local_batch():
    assert cross_entropy.n_chunks(4, 512, 512) == 4  # 128 positions x 4 rows
    assert cross_entropy.n_chunks(4, 100, 120) == 4  # 30 positions wanted -> 25, the largest divisor of 100 <= 30
    assert cross_entropy.n_chunks(4, 97, 8) == 97  # a prime length: 1 position per chunk
    assert cross_entropy.n_chunks(16, 128, 0) == 1
    # Batch split 4 ways over data: 4 local rows, so 512 tokens are 128 positions.
    mesh = mesh_lib.make_mesh({"data": 4, "tensor": 2})
    with mesh_lib.activation_sharding(mesh, mesh_lib.resolve_rules("dp_fsdp_tp")):
        assert cross_entropy.n_chunks(16, 512, 512) == 4


def test_bf16_compute_keeps_f32_gradients_for_f32_params():
    x, w, targets, weights = inputs(2)
    fused = lambda x, w: cross_entropy.linear_cross_entropy(x, w, targets, weights, 8, jnp.bfloat16)
    loss, (dx, dw) = jax.value_and_grad(fused, argnums=(0, 1))(x.astype(jnp.bfloat16), w)
    assert loss.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    want, (want_dx, want_dw) = jax.value_and_grad(lambda x, w: reference(x, w, targets, weights), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(loss, want, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=0.1, atol=0.05 * np.abs(want_dw).max())
    np.testing.assert_allclose(np.asarray(dx, np.float32), want_dx, rtol=0.1, atol=0.05 * np.abs(want_dx).max())


# --- The whole train step --------------------------------------------------------------------------------------


def step_config(tiny_config, mesh=None, **overrides):
    mesh = {"data": -1, "pipeline": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1, **(mesh or {})}
    return tiny_config(**{**{f"mesh.{a}": n for a, n in mesh.items()}, "optim.warmup_steps": 0, **overrides})


def run_steps(cfg, batches, devices):
    """(the compiled train step's HLO, {loss, grad_norm: [per step]}) of one step per batch from the seed's init, on
    the executable whose HLO it returns."""
    facts = config_lib.validate(cfg, len(devices))
    trainer = trainer_lib.build_trainer(cfg, facts, devices=devices)
    global_batch = lambda b: trainer_lib.global_batch(b, trainer.batch_sharding)  # noqa: E731
    step = trainer.train_step.lower(trainer.abstract_state, global_batch(batches[0])).compile()
    state, history = trainer.init(), {"loss": [], "grad_norm": []}
    for batch in batches:
        state, metrics = step(state, global_batch(batch))
        for key in history:
            history[key].append(float(metrics[key]))
    return step.as_text(), {k: np.array(v) for k, v in history.items()}


BATCHES = synthetic_batches(1, 8, 32, 512) * 3  # one batch thrice: the loss must fall


def fast_steps(tiny_config, mesh, extra):
    cfg = step_config(tiny_config, mesh, **{"model.vocab_size": 512, "model.loss_chunk_tokens": 16,
                                            "model.attention_block": 8, "model.scan_unroll": 2, **extra})
    return run_steps(cfg, BATCHES, jax.devices() if mesh else jax.devices()[:1])


# Module-scoped: the plain step is every fast path's reference, and both one-device steps' HLO is read below.
@pytest.fixture(scope="module")
def plain_one_device(tiny_config):
    cfg = step_config(tiny_config, None, **{"model.vocab_size": 512, "model.loss_chunk_tokens": 0})
    return run_steps(cfg, BATCHES, jax.devices()[:1])


@pytest.fixture(scope="module")
def fast_one_device(tiny_config):
    return fast_steps(tiny_config, None, {})


@pytest.mark.parametrize("mesh,extra", [
    (None, {}), ({"data": 2, "tensor": 4}, {}), ({"data": 2, "sequence": 2, "tensor": 2}, {}),
    ({"data": 2, "pipeline": 2, "tensor": 2},
     {"pipeline.stages": 2, "pipeline.microbatches": 2, "model.remat": "full"}),
], ids=["one_device", "data2_tensor4", "data2_sequence2_tensor2", "data2_pipeline2_tensor2_remat"])
def test_fast_paths_train_like_the_plain_step(tiny_config, plain_one_device, request, mesh, extra):
    """3 steps with the loss in chunks (16 tokens per device: 16, 8 and 4 chunks on the first three meshes),
    attention in 4 query blocks (its own backward, also under remat and in pipeline stages) and the layer loop
    unrolled (vocab split over tensor, the sequence over sequence, where attention falls back to one block) against
    the plain step on one device: loss and gradient norm of every step."""
    got = (request.getfixturevalue("fast_one_device") if mesh is None else fast_steps(tiny_config, mesh, extra))[1]
    want = plain_one_device[1]
    assert want["loss"][-1] < want["loss"][0]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def compiled_text(tiny_config, chunk_tokens, mesh=None, **overrides):
    """The compiled train step's HLO, and the mesh shape."""
    cfg = step_config(tiny_config, mesh, **{"model.vocab_size": 512, "model.loss_chunk_tokens": chunk_tokens,
                                            **overrides})
    devices = jax.devices() if mesh else jax.devices()[:1]
    facts = config_lib.validate(cfg, len(devices))
    trainer = trainer_lib.build_trainer(cfg, facts, devices=devices)
    batch = trainer_lib.global_batch(synthetic_batches(1, 8, 32, 512)[0], trainer.batch_sharding)
    return trainer.train_step.lower(trainer.abstract_state, batch).compile().as_text(), facts.mesh_shape


def test_chunks_do_not_multiply_the_gradient_traffic(tiny_config):
    """Data parallel over 8 devices, 1 row each: 8 chunks of 4 positions. The head's gradient is summed per device
    across chunks and reduced once, so the all-reduced bytes equal the unfused step's (not 8x the head's)."""
    def reduced_bytes(chunk_tokens):
        text, mesh_shape = compiled_text(tiny_config, chunk_tokens, {"data": 8})
        return sum(op["bytes"] for op in collectives(text, mesh_shape) if op["kind"] == "all-reduce")

    head_bytes = 32 * 512 * 4
    plain, chunked = reduced_bytes(0), reduced_bytes(4)
    assert plain >= head_bytes
    assert abs(chunked - plain) < 0.1 * head_bytes, (plain, chunked)


def test_head_gradient_crosses_sequence_as_its_fsdp_shard(tiny_config):
    """data x fsdp x sequence: the head's gradient [d_model 32, vocab 512] is summed over the batch shards into its
    fsdp shard [16, 512] first, and only that shard is all-reduced over `sequence` (it once crossed it whole)."""
    text, mesh_shape = compiled_text(tiny_config, 4, {"data": 2, "fsdp": 2, "sequence": 2},
                                     **{"model.tie_embeddings": False})
    module = hlo_lib.parse_hlo(text)
    shapes = [module["by_name"][op["name"]]["shape"] for op in collectives(module, mesh_shape)
              if op["kind"] == "all-reduce" and op["axes"] == ("sequence",)]
    assert any("f32[16,512]" in shape for shape in shapes), shapes
    assert not any("f32[32,512]" in shape for shape in shapes), shapes


def test_full_logits_never_exist_in_the_compiled_step(plain_one_device, fast_one_device):
    """The one-device steps above: plain, and in 16 chunks of 2 positions x 8 rows."""
    full = "f32[8,32,512]"  # [B, T, vocab] logits
    assert full in plain_one_device[0]
    chunked = fast_one_device[0]
    assert full not in chunked and "f32[256,512]" not in chunked
    assert "f32[8,2,512]" in chunked or "f32[16,512]" in chunked


def test_negative_chunk_is_a_config_error(tiny_config):
    with pytest.raises(config_lib.ConfigError, match="model.loss_chunk_tokens"):
        config_lib.validate(step_config(tiny_config, **{"model.loss_chunk_tokens": -1}), 8)
