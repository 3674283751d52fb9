"""Precision is chosen per platform: f32 on CPU, bf16 compute with f32 params on GPU/TPU, unless set. bf16 on CPU
runs its weight matmuls in the forms XLA:CPU computes in bf16 (forward and backward), with unchanged results."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import config as config_lib
from jaxtrain.data import pipeline
from jaxtrain.models import attention, cpu_bf16, cross_entropy, layers
from jaxtrain import trainer as trainer_lib
from jaxtrain.observe import hlo as hlo_lib
from parallel_worker import synthetic_batches, train_steps


def dot_operand_dtypes(hlo_text: str) -> list[tuple[str, ...]]:
    """The operands' element types of every dot in a compiled module, e.g. [("bf16", "bf16"), ...]."""
    module = hlo_lib.parse_hlo(hlo_text)
    dtype = lambda name: re.match(r"(\w+)\[", module["shapes"][name]).group(1)  # noqa: E731
    return [tuple(dtype(o) for o in re.findall(r"%([\w.\-]+)", instr["rest"].split(")", 1)[0]))
            for instr in module["by_name"].values() if instr["op"] == "dot"]


@pytest.mark.parametrize("backend, compute", [("cpu", "float32"), ("gpu", "bfloat16"), ("tpu", "bfloat16")])
def test_auto_dtypes_per_backend(tiny_config, backend, compute):
    m = config_lib.model_config(tiny_config(), backend)
    assert (m.dtype, m.param_dtype) == (compute, "float32")


def test_explicit_dtypes_win_over_auto(tiny_config):
    m = config_lib.model_config(tiny_config(**{"model.dtype": "bfloat16", "model.param_dtype": "float32"}), "cpu")
    assert (m.dtype, m.param_dtype) == ("bfloat16", "float32")
    with pytest.raises(config_lib.ConfigError, match="model.dtype"):
        config_lib.validate(tiny_config(**{"model.dtype": "fp8"}), 8)


def test_bf16_compute_keeps_f32_master_weights_and_tracks_f32(tiny_config):
    """One step in bf16 compute: params and Adam moments stay f32, and the loss is close to the f32 one."""
    local = next(pipeline.train_iterator(tiny_config().data.dir, seq_len=32, global_batch=8, seed=0))

    def step(dtype):
        cfg = tiny_config(**{"model.dtype": dtype, "mesh.data": 1})
        facts = config_lib.validate(cfg, 1)
        trainer = trainer_lib.build_trainer(cfg, facts, devices=jax.devices()[:1])
        logits = lambda p: nnx.merge(trainer.graphdef, p)(  # noqa: E731
            jnp.asarray(local["tokens"]), jnp.asarray(local["positions"]), jnp.asarray(local["segment_ids"]))
        state = trainer.init()
        out_dtype = jax.eval_shape(logits, state["params"]).dtype  # traced, not compiled
        state, metrics = trainer.train_step(state, trainer_lib.global_batch(local, trainer.batch_sharding))
        return state, float(metrics["loss"]), out_dtype

    state16, loss16, logits16 = step("bfloat16")
    _, loss32, logits32 = step("float32")
    assert logits16 == jnp.bfloat16 and logits32 == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(state16["params"])} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state16["opt_state"]) if x.ndim} == {jnp.dtype("float32")}
    assert np.isfinite(loss16)
    np.testing.assert_allclose(loss16, loss32, rtol=2e-2)  # bf16 has ~3 significant digits
    assert loss16 != loss32  # the bf16 path really computed in bf16


def test_cpu_bf16_projection_matches_autodiff_and_runs_bf16_dots():
    """project() in bf16 on CPU: value and both gradients equal autodiff of the same f32-accumulated matmul, and
    every dot of the compiled forward + backward reads bf16 operands. XLA:CPU converts both operands of any other
    form (a bf16 result, an operand read transposed) to f32 and runs it at f32 speed."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 1, (4, 24, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.1, (64, 48)), jnp.bfloat16)
    r = jnp.asarray(rng.normal(0, 1, (4, 24, 48)), jnp.float32)

    def loss(project):
        return lambda x, w: jnp.sum(project(x, w).astype(jnp.float32) * r)

    plain = lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)  # noqa: E731
    got_fn = jax.jit(jax.value_and_grad(loss(layers.project), argnums=(0, 1))).lower(x, w).compile()
    got, (got_dx, got_dw) = got_fn(x, w)
    want, (want_dx, want_dw) = jax.jit(jax.value_and_grad(loss(plain), argnums=(0, 1)))(x, w)
    assert got_dx.dtype == got_dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w_ in ((got_dx, want_dx), (got_dw, want_dw)):  # within one bf16 rounding of the result
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w_, np.float32), rtol=1e-2,
                                   atol=1e-2 * float(jnp.abs(w_.astype(jnp.float32)).max()))
    dtypes = dot_operand_dtypes(got_fn.as_text())
    assert len(dtypes) == 3 and set(dtypes) == {("bf16", "bf16")}, dtypes
    # The plain form's backward (autodiff) is what XLA:CPU ran in f32 before.
    assert ("f32", "f32") in dot_operand_dtypes(jax.jit(jax.grad(loss(plain), argnums=(0, 1))).lower(x, w)
                                                .compile().as_text())


def test_fused_projection_split_joins_bf16_gradients_in_bf16(monkeypatch):
    """project_fused's joined matmul (QKV, gate/up) in bf16 with a SwiGLU-like f32 use of its parts: the gradients
    equal those of a plain jnp.split bit for bit, and the compiled backward joins the parts' gradients as 16-bit
    data. With the plain split, XLA joined them in f32 (the check can fail)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 1, (2, 16, 32)), jnp.bfloat16)
    ws = [jnp.asarray(rng.normal(0, 0.2, (32, n)), jnp.bfloat16) for n in (24, 24)]

    def loss(x, ws, project=lambda x, ws: layers.project_joined(x, ws, 1, "mlp", "act_mlp")):
        gate, up = project(x, ws)
        return jnp.sum((jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(jnp.bfloat16)
                       .astype(jnp.float32) ** 2)

    def concatenations(hlo: str) -> set[str]:
        return {i["shape"].split("[")[0] for i in hlo_lib.parse_hlo(hlo)["by_name"].values()
                if i["op"] == "concatenate" and i["shape"].split("[")[1].startswith("2,16,1,48")}

    grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ws).compile()  # one compile to run and to read
    got, joins = grad(x, ws), concatenations(grad.as_text())
    monkeypatch.setattr(layers, "split_last", lambda y, cuts: jnp.split(y, cuts, axis=-1))
    plain = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ws).compile()
    want, plain_joins = plain(x, ws), concatenations(plain.as_text())
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == jnp.bfloat16 and np.array_equal(np.asarray(g, np.float32), np.asarray(w_, np.float32))
    assert joins and joins <= {"bf16", "u16"} and plain_joins == {"f32"}, (joins, plain_joins)
    # Where the mesh splits neither the weights nor the sequence (here: no mesh) nothing is joined.
    alone = jax.jit(jax.grad(functools.partial(loss, project=lambda x, ws: layers.project_fused(x, ws, "mlp", "act")),
                             argnums=(0, 1))).lower(x, ws).compile()
    assert not concatenations(alone.as_text())
    for g, w_ in zip(jax.tree.leaves(alone(x, ws)), jax.tree.leaves(want)):
        w_ = np.asarray(w_, np.float32)  # the same sums, rounded to bf16 in another order
        np.testing.assert_allclose(np.asarray(g, np.float32), w_, rtol=1e-2, atol=1e-2 * np.abs(w_).max())


def test_cpu_cast_to_bf16_equals_astype_bit_for_bit():
    """cpu_bf16.cast rounds f32 to bf16 with integer ops (XLA:CPU's convert after an exp ran ~1.5x slower): the same
    bits as astype for every kind of value, the same gradient, and the compiled cast holds no f32 -> bf16 convert."""
    rng = np.random.default_rng(0)
    randoms = (rng.normal(0, 1, 4096) * 10.0 ** rng.integers(-45, 39, 4096)).astype(np.float32).view(np.uint32)
    halfway = (rng.integers(0, 2**16, 4096, dtype=np.uint32) << 16) | 0x8000  # ties: to even, up or down
    special = np.array([0x0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x807FFFFF,
                        0x7F800001, 0x7FC00000, 0xFFC00001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBF8000], np.uint32)
    a = jnp.asarray(np.concatenate([randoms, halfway, special]).view(np.float32))
    fast = jax.jit(lambda a: cpu_bf16.cast(a, jnp.bfloat16))
    got, want = np.asarray(fast(a)).view(np.uint16), np.asarray(a.astype(jnp.bfloat16)).view(np.uint16)
    assert np.isnan(np.asarray(a)).sum() >= 6 and np.array_equal(got, want), np.flatnonzero(got != want)[:10]
    assert not re.search(r"bf16\[[\d,]*\]\S* convert\(", fast.lower(a).compile().as_text())

    r = jnp.asarray(rng.normal(0, 1, (64,)), jnp.float32)
    grad = lambda to_bf16: jax.grad(lambda x: jnp.sum(to_bf16(x * 3.0).astype(jnp.float32) * r))  # noqa: E731
    x = jnp.asarray(rng.normal(0, 1, (64,)), jnp.float32)
    assert np.array_equal(grad(lambda v: cpu_bf16.cast(v, jnp.bfloat16))(x), grad(lambda v: v.astype(jnp.bfloat16))(x))


def test_cpu_bf16_fused_loss_runs_bf16_dots():
    """The fused head + cross-entropy in bf16: its three matmuls per chunk (logits, dx, dW) read bf16 operands."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 1, (4, 24, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.5, (16, 96)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 96, (4, 24)), jnp.int32)
    weights = jnp.ones((4, 24), jnp.float32)
    fused = lambda x, w: cross_entropy.linear_cross_entropy(x, w, targets, weights, 32, jnp.bfloat16)  # noqa: E731
    dtypes = dot_operand_dtypes(jax.jit(jax.grad(fused, argnums=(0, 1))).lower(x, w).compile().as_text())
    assert len(dtypes) == 3 and set(dtypes) == {("bf16", "bf16")}, dtypes


def test_cpu_bf16_blocked_attention_tracks_f32_and_runs_bf16_dots():
    """Attention in query blocks (model.attention_block > 0) in bf16 on CPU, with grouped queries, documents and
    padding: output and the gradients of q, k and v track the f32 computation of the same inputs, and every dot of
    the compiled forward + backward reads bf16 operands. Autodiff of the same math does not (its backward reads the
    probabilities and the queries transposed, which XLA:CPU runs in f32)."""
    rng = np.random.default_rng(0)
    b, t, h, kv, d = 2, 32, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv, d)), jnp.bfloat16) for _ in range(2))
    seg = np.ones((b, t), np.int32)
    seg[0, 13:] = 2
    seg[1, 27:] = 0  # padding
    mask = attention.attention_mask(jnp.asarray(seg))
    real = (seg != 0)[:, :, None, None]
    probe = jnp.asarray(rng.standard_normal(q.shape) * real, jnp.float32)

    def loss(block):
        return lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, mask, block).astype(jnp.float32) * probe)

    got_fn = jax.jit(jax.value_and_grad(loss(8), argnums=(0, 1, 2))).lower(q, k, v).compile()
    got, got_grads = got_fn(q, k, v)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    # jitted: one compile, where eager autodiff dispatches (and compiles) each op
    want, want_grads = jax.jit(jax.value_and_grad(loss(0), argnums=(0, 1, 2)))(*(x.astype(jnp.float32)
                                                                                   for x in (q, k, v)))
    np.testing.assert_allclose(f32(got), f32(want), rtol=2e-2)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(f32(g), f32(w), atol=2e-2 * np.abs(f32(w)).max())
    dtypes = dot_operand_dtypes(got_fn.as_text())
    assert len(dtypes) == 4 * 2 + 4 * 4 and set(dtypes) == {("bf16", "bf16")}, dtypes  # 2 per block fwd, 4 bwd
    autodiff = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention.attend(q, k, v, mask, q.shape[-1] ** -0.5).astype(jnp.float32)),
                                argnums=(0, 1, 2)))
    k2, v2 = (jnp.repeat(x, h // kv, axis=2) for x in (k, v))
    assert ("f32", "f32") in dot_operand_dtypes(autodiff.lower(q, k2, v2).compile().as_text())


def test_cpu_bf16_train_step_matmuls_are_bf16_and_shard_alike(tiny_config):
    """The bf16 train step on CPU with attention in query blocks: every dot reads bf16 operands, and fsdp x tensor
    over 8 devices trains like one device (same bf16 math, summed in another order)."""
    cfg = lambda mesh: tiny_config(**{"model.dtype": "bfloat16", "model.vocab_size": 512,  # noqa: E731
                                      "model.attention_block": 8, "optim.warmup_steps": 0,
                                      **{f"mesh.{a}": n for a, n in mesh.items()}})
    one = cfg({"data": 1})
    facts = config_lib.validate(one, 1)
    trainer = trainer_lib.build_trainer(one, facts, devices=jax.devices()[:1])
    batches = synthetic_batches(1, 8, 32, 512) * 3
    batch = trainer_lib.global_batch(batches[0], trainer.batch_sharding)
    step = trainer.train_step.lower(trainer.abstract_state, batch).compile()
    dtypes = dot_operand_dtypes(step.as_text())
    assert dtypes and set(dtypes) == {("bf16", "bf16")}, dtypes
    state, want = trainer.init(), {"loss": []}  # the one-device run on the executable just read
    for b in batches:
        state, metrics = step(state, trainer_lib.global_batch(b, trainer.batch_sharding))
        want["loss"].append(float(metrics["loss"]))
    got = train_steps(cfg({"data": 1, "fsdp": 4, "tensor": 2}), batches, devices=jax.devices())
    assert want["loss"][-1] < want["loss"][0]
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-2)
