"""The Llama-style decoder: causality, packed-document isolation, GQA, a numpy reference, FLOP count."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import attention, layers, transformer
from jaxtrain.models.config import ModelConfig

# H != KV so that grouped-query attention is exercised.
SMALL = {"vocab_size": 64, "d_model": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "d_ff": 24}


def build(**overrides):
    """(cfg, the model's shapes): its initializers do not run (eagerly, each would compile on its own)."""
    cfg = ModelConfig(**{**SMALL, **overrides})
    return cfg, nnx.eval_shape(lambda: transformer.build(cfg, seed=0))


def initialized(model):
    """The model with its real initial weights (eager: jitted, the initializers compile slower)."""
    return transformer.build(model.cfg, seed=0)


def randomized(model, seed=1, std=0.3):
    """The same model with every parameter (norm scales included) drawn at random, large enough that
    every term of the forward pass changes the logits visibly."""
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        is_scale = str(getattr(path[-1], "key", path[-1])) == "scale"
        return ((1.0 if is_scale else 0.0) + rng.normal(0.0, std, x.shape)).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(draw, params)
    return nnx.merge(graphdef, params), params


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, positions, segment_ids):
    return nnx.merge(graphdef, state)(tokens, positions, segment_ids)


def logits(model, tokens, positions, segment_ids):
    """The forward compiled (one program per model and shape, where eagerly every op compiles on its own)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                               np.asarray(segment_ids, np.int32)))


# --- Causality and packing ---------------------------------------------------------------------------


def test_causal_future_tokens_do_not_change_past_logits():
    _, model = build()
    model, _ = randomized(model)
    rng = np.random.default_rng(0)
    B, T, t = 2, 12, 5
    tokens = rng.integers(2, SMALL["vocab_size"], (B, T))
    positions = np.broadcast_to(np.arange(T), (B, T))
    seg = np.ones((B, T))
    changed = tokens.copy()
    changed[:, t + 1 :] = (tokens[:, t + 1 :] + 1 + rng.integers(0, 10, (B, T - t - 1))) % SMALL["vocab_size"]

    a, b = logits(model, tokens, positions, seg), logits(model, changed, positions, seg)
    np.testing.assert_allclose(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    # The change itself is visible from position t+1 on (otherwise the check above proves nothing).
    assert np.abs(a[:, t + 1 :] - b[:, t + 1 :]).max() > 1e-3


def test_packed_documents_are_isolated():
    """Row 0 packs doc1 (5 tokens) then doc2 (7 tokens) with positions restarting; row 1 holds doc2 alone
    at positions 0.. followed by padding. doc2's logits must be the same in both rows."""
    _, model = build()
    model, _ = randomized(model)
    rng = np.random.default_rng(1)
    doc1, doc2 = rng.integers(2, 64, 5), rng.integers(2, 64, 7)
    T = 12
    packed = np.concatenate([doc1, doc2])
    packed_seg = np.array([1] * 5 + [2] * 7)
    packed_pos = np.array(list(range(5)) + list(range(7)))
    alone = np.concatenate([doc2, np.zeros(T - 7, int)])
    alone_seg = np.array([1] * 7 + [0] * (T - 7))
    alone_pos = np.array(list(range(7)) + [0] * (T - 7))

    out = logits(model, np.stack([packed, alone]), np.stack([packed_pos, alone_pos]), np.stack([packed_seg, alone_seg]))
    np.testing.assert_allclose(out[0, 5:], out[1, :7], rtol=1e-5, atol=1e-5)

    # Changing doc1 leaves doc2 untouched (but does change doc1's own logits).
    other_doc1 = (doc1 + 7) % 64
    out2 = logits(model, np.concatenate([other_doc1, doc2])[None], packed_pos[None], packed_seg[None])
    np.testing.assert_allclose(out2[0, 5:], out[0, 5:], rtol=1e-5, atol=1e-5)
    assert np.abs(out2[0, :5] - out[0, :5]).max() > 1e-3

    # Control: the same row with one segment id (no isolation) does see doc1, so the mask is what isolates.
    leaky = logits(model, packed[None], packed_pos[None], np.ones((1, T)))
    assert np.abs(leaky[0, 5:] - out[0, 5:]).max() > 1e-3


# --- Parameters: GQA shapes, tied vs untied ------------------------------------------------------------


def param_shapes(model):
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): tuple(x.shape)
        for path, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    }


@pytest.mark.parametrize("tie", [True, False])
def test_gqa_param_shapes_tied_and_untied(tie):
    _, model = build(n_heads=8, n_kv_heads=2, tie_embeddings=tie)
    L, V, D, H, KV, HD, F = 2, 64, 16, 8, 2, 8, 24
    expected = {
        "embed": (V, D),
        "blocks/attn/wq": (L, D, H, HD),
        "blocks/attn/wk": (L, D, KV, HD),
        "blocks/attn/wv": (L, D, KV, HD),
        "blocks/attn/wo": (L, H, HD, D),
        "blocks/attn_norm/scale": (L, D),
        "blocks/mlp/w_gate": (L, D, F),
        "blocks/mlp/w_up": (L, D, F),
        "blocks/mlp/w_down": (L, F, D),
        "blocks/mlp_norm/scale": (L, D),
        "final_norm/scale": (D,),
    }
    if not tie:
        expected["unembed"] = (D, V)
    assert param_shapes(model) == expected
    out = logits(initialized(model), np.ones((3, 5)), np.broadcast_to(np.arange(5), (3, 5)), np.ones((3, 5)))
    assert out.shape == (3, 5, V) and np.isfinite(out).all()


def test_tied_model_uses_embedding_as_output_head():
    """Tied: the embedding row of a token absent from the input is still that token's output-head
    column, so scaling it scales exactly that logit. Untied: the same change does nothing, and the
    `unembed` matrix is the head (zeroing it zeroes the logits)."""
    tok, pos, seg = np.array([[2, 3, 4, 5]]), np.arange(4)[None], np.ones((1, 4))
    absent = 10
    for tie in (True, False):
        _, model = build(tie_embeddings=tie)
        model, params = randomized(model, seed=4)
        graphdef = nnx.graphdef(model)
        base = logits(model, tok, pos, seg)
        scaled = jax.tree.map(np.array, params)
        scaled["embed"][absent] *= 3.0
        out = logits(nnx.merge(graphdef, scaled), tok, pos, seg)
        others = np.arange(SMALL["vocab_size"]) != absent
        np.testing.assert_array_equal(out[..., others], base[..., others])
        if tie:
            np.testing.assert_allclose(out[..., absent], 3.0 * base[..., absent], rtol=1e-5)
            assert np.abs(base[..., absent]).min() > 1e-3
        else:
            np.testing.assert_array_equal(out[..., absent], base[..., absent])
            zeroed = jax.tree.map(np.array, params)
            zeroed["unembed"][:] = 0.0
            assert np.all(logits(nnx.merge(graphdef, zeroed), tok, pos, seg) == 0)


# --- Forward pass against an independent numpy reference -----------------------------------------------


def reference_forward(p, cfg, tokens, positions, seg):
    """Float64 numpy Llama: RMSNorm, RoPE (rotate-half), GQA (query head n reads kv head n // (H/KV)),
    SwiGLU, pre-norm residuals; attention causal, within a segment, never to padding (segment 0)."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), p)
    H, KV, HD = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    group = H // KV

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale

    def rope(x):  # x [B, T, N, HD]
        half = HD // 2
        freq = cfg.rope_theta ** (-np.arange(half) / half)
        ang = positions[:, :, None, None] * freq
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)

    T = tokens.shape[1]
    allowed = np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    x = p["embed"][tokens]
    for l in range(cfg.n_layers):
        blk = jax.tree.map(lambda a, l=l: a[l], p["blocks"])
        h = rms(x, blk["attn_norm"]["scale"])
        q = rope(np.einsum("btd,dnh->btnh", h, blk["attn"]["wq"]))
        k = rope(np.einsum("btd,dnh->btnh", h, blk["attn"]["wk"]))
        v = np.einsum("btd,dnh->btnh", h, blk["attn"]["wv"])
        out = np.zeros_like(q)
        for n in range(H):
            s = np.einsum("bqh,bkh->bqk", q[:, :, n], k[:, :, n // group]) / np.sqrt(HD)
            s = np.where(allowed, s, -np.inf)
            w = np.where(allowed, np.exp(s - s.max(-1, keepdims=True, initial=-1e30)), 0.0)
            w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)  # a padded query attends to nothing
            out[:, :, n] = np.einsum("bqk,bkh->bqh", w, v[:, :, n // group])
        x = x + np.einsum("btnh,nhd->btd", out, blk["attn"]["wo"])
        h = rms(x, blk["mlp_norm"]["scale"])
        gate, up = h @ blk["mlp"]["w_gate"], h @ blk["mlp"]["w_up"]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ blk["mlp"]["w_down"]
    x = rms(x, p["final_norm"]["scale"])
    return x @ (p["embed"].T if cfg.tie_embeddings else p["unembed"])


@pytest.mark.parametrize("tie,execution", [(True, {}), (False, {}), (False, {"attention_block": 3}),
                                            (True, {"scan_unroll": 2}),
                                            (False, {"scan_unroll": 2, "attention_block": 3})],
                         ids=["tied", "untied", "untied_attention_blocks", "tied_unrolled", "untied_unrolled_blocks"])
def test_forward_matches_numpy_reference(tie, execution):
    """Also with the execution knobs: causal attention in 3 query blocks of 3 (the documents and the padding
    cross block edges) and the layer loop unrolled."""
    cfg, model = build(n_heads=4, n_kv_heads=2, tie_embeddings=tie, **execution)
    model, params = randomized(model, seed=3)
    rng = np.random.default_rng(2)
    tokens = rng.integers(2, 64, (2, 9))
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 0, 0]])
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 0, 0]])
    got = logits(model, tokens, positions, seg)
    want = reference_forward(params, cfg, tokens, positions, seg)
    real = seg != 0  # padded query positions attend to nothing: their output is unspecified
    np.testing.assert_allclose(got[real], want[real], rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_rotary_lookup_matches_the_formula_and_reads_nan_outside_the_row():
    """The training forward looks RoPE's angles up by position; decoding computes them. Both agree to f32
    rounding for every position of the row; a position outside the row reads NaN, not a clamped or wrapped row."""
    head_dim, theta, T = 8, 10000.0, 12
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], np.int32)
    freqs = layers._frequencies(head_dim, theta), 1.0
    for got, want in zip(layers.rotary_lookup(positions, freqs), layers.rotary(positions, freqs)):
        assert got.shape == want.shape == (2, T, 1, head_dim // 2)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    outside = np.array([[0, 5, 6, 11, -1, -6]], np.int32)  # a row of 6
    cos, sin = layers.rotary_lookup(outside, freqs)
    assert not np.isnan(cos[0, :2]).any() and np.isnan(cos[0, 2:]).all() and np.isnan(sin[0, 2:]).all()


def test_compiled_forward_computes_no_sine(monkeypatch):
    """XLA recomputes a sine inside every fusion that reads it, so the layers read RoPE's angles from a table:
    the compiled forward and backward hold no sine. With the formula instead they do (the check can fail)."""
    _, model = build()
    graphdef, state = nnx.split(model)
    positions = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))

    def loss(s, positions):  # positions an argument, as in training: a constant's sines would be folded away
        return nnx.merge(graphdef, s)(np.zeros((2, 6), np.int32), positions, np.ones((2, 6), np.int32)).sum()

    def compiled_text():
        return jax.jit(jax.grad(loss)).lower(state, positions).compile().as_text()

    assert " sine(" not in compiled_text()
    monkeypatch.setattr(transformer, "rotary_lookup", transformer.rotary)
    assert " sine(" in compiled_text()


def _loss_and_out(block, q, k, v, mask, probe):
    out = attention.causal_attention(q, k, v, mask, block)
    return jax.numpy.sum(out * probe), out


# Compiled once per block size and head count (the reference, block 0, is shared by the three block sizes).
_attention_grads = jax.jit(jax.value_and_grad(_loss_and_out, argnums=(1, 2, 3), has_aux=True), static_argnums=0)


@pytest.mark.parametrize("block", [3, 4, 9], ids=["3_blocks", "not_dividing", "one_block"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_written_out_attention_matches_library_call(block, kv_heads):
    """`model.attention_block` > 0 (einsums + softmax, in query blocks) against one jax.nn.dot_product_attention
    call: outputs and the gradients of q, k and v, with documents and padding crossing the block edges."""
    rng = np.random.default_rng(0)
    q = jax.numpy.asarray(rng.standard_normal((2, 9, 4, 8)), jax.numpy.float32)
    k, v = (jax.numpy.asarray(rng.standard_normal((2, 9, kv_heads, 8)), jax.numpy.float32) for _ in range(2))
    seg = jax.numpy.asarray([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 0, 0]])
    mask = attention.attention_mask(seg)
    real = np.asarray(seg != 0)[:, :, None, None]  # a padded query attends to nothing: its output is unspecified
    probe = jax.numpy.asarray(rng.standard_normal(q.shape), jax.numpy.float32) * real

    (_, want), want_grads = _attention_grads(0, q, k, v, mask, probe)
    (_, got), got_grads = _attention_grads(block, q, k, v, mask, probe)
    np.testing.assert_allclose(np.asarray(got) * real, np.asarray(want) * real, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting,backend,reason", [
    ({"attention_impl": "flash"}, "gpu", "unknown value 'flash'"),
    ({"attention_impl": "cudnn", "attention_block": 64}, "gpu", "needs model.attention_block=0"),
    ({"attention_impl": "cudnn"}, "cpu", "cudnn runs on GPUs only"),
    ({"attention_impl": "cudnn", "dtype": "float32"}, "gpu", "needs bfloat16 or float16 compute"),
    ({"attention_impl": "cudnn", "head_dim": 256}, "gpu", "needs model.head_dim <= 128"),  # Gemma's
    ({"attention_impl": "cudnn"}, "gpu", None),  # auto: bf16 compute on a GPU
], ids=["unknown", "with_blocks", "on_cpu", "f32_on_gpu", "head_dim_256", "ok_on_gpu"])
def test_attention_impl_is_checked_before_anything_compiles(setting, backend, reason):
    from jaxtrain import config as config_lib

    cfg = config_lib.base_config()
    cfg.model.update(**setting)

    def check():
        config_lib.validate(cfg, 1, backend=backend)

    if reason is None:
        check()
    else:
        with pytest.raises(config_lib.ConfigError, match=f"^model.attention_impl: .*{reason}"):
            check()


def test_a_run_with_cudnn_attention_on_cpu_stops_before_its_workdir_exists(tiny_config):
    from pathlib import Path

    from jaxtrain import config as config_lib, train

    config = tiny_config(**{"model.attention_impl": "cudnn"})
    with pytest.raises(config_lib.ConfigError, match="^model.attention_impl: cudnn runs on GPUs only"):
        train.run(config, print_fn=lambda *a, **k: None)
    assert not Path(config.workdir).exists()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's kernel runs on GPUs only (a lent GPU machine)")
def test_cudnn_attention_matches_xla_on_gpu():
    """model.attention_impl=cudnn against XLA's kernel on packed documents and padding, in bf16: outputs and the
    gradients of q, k and v. Runs only where a GPU is (CI has none): the check for a session lent one."""
    bf16 = jax.numpy.bfloat16
    rng = np.random.default_rng(0)
    b, t, h, kv, d = 2, 256, 8, 4, 64
    q = jax.numpy.asarray(rng.standard_normal((b, t, h, d)), bf16)
    k, v = (jax.numpy.asarray(rng.standard_normal((b, t, kv, d)), bf16) for _ in range(2))
    seg = np.ones((b, t), np.int32)
    seg[0, 100:] = 2
    seg[1, 200:] = 0  # padding
    mask = attention.attention_mask(jax.numpy.asarray(seg))
    real = np.asarray(seg != 0)[:, :, None, None]
    probe = jax.numpy.asarray(rng.standard_normal(q.shape) * real, bf16)

    def loss_and_out(impl, q, k, v):
        out = attention.causal_attention(q, k, v, mask, 0, impl)
        return jax.numpy.sum((out * probe).astype(jax.numpy.float32)), out

    grad = lambda impl: jax.jit(jax.value_and_grad(loss_and_out, argnums=(1, 2, 3), has_aux=True),  # noqa: E731
                                static_argnums=0)(impl, q, k, v)
    (_, want), want_grads = grad("xla")
    (_, got), got_grads = grad("cudnn")
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(got) * real, f32(want) * real, rtol=2e-2, atol=2e-2)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(f32(g), f32(w), rtol=2e-2, atol=2e-2)


# --- FLOP count ------------------------------------------------------------------------------------------


def test_train_flops_per_token_hand_computed():
    cfg = ModelConfig(vocab_size=100, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=40)
    # Per layer: wq 16*4*8=512, wk 16*2*8=256, wv 256, wo 512 -> 1536; MLP 3*16*40=1920 -> 3456.
    # 3 layers -> 10368, plus the output head 16*100=1600 -> 11968 matmul params.
    # 6 * 11968 = 71808; attention 6 * L * S * H * d_head = 6*3*64*4*8 = 36864; total 108672.
    assert transformer.matmul_params(cfg) == 11968
    assert transformer.train_flops_per_token(cfg, 64) == 108672
    # Sliding windows of 16 on layers 0 and 1 (global_every 3: layer 2 is global): a query sees on average
    # 16 - 16^2 / 128 = 14 keys there instead of 32, so those layers' attention counts 28/64 of a global one's.
    windowed = dataclasses.replace(cfg, sliding_window=16, global_every=3)
    assert transformer.train_flops_per_token(windowed, 64) == 71808 + 12288 * (1 + 2 * 28 / 64)
    assert transformer.train_flops_per_token(dataclasses.replace(cfg, sliding_window=64), 64) == 108672


@pytest.mark.parametrize("tie,experts", [(True, 0), (False, 0), (False, 4)])
def test_matmul_params_match_the_built_model(tie, experts):
    """Every real parameter except the input-embedding gather and the norm scales is a matmul weight
    (tied: the embedding table is the output head, so it counts once); with `stored`, every expert counts
    (what the memory floor holds), without it only the top-k a token uses (what its FLOPs count)."""
    cfg, model = build(tie_embeddings=tie, n_experts=experts, moe_top_k=2)
    shapes = param_shapes(model)
    total = sum(int(np.prod(s)) for s in shapes.values())
    norms = sum(int(np.prod(s)) for k, s in shapes.items() if k.endswith("scale"))
    gather_only = 0 if tie else int(np.prod(shapes["embed"]))
    assert transformer.matmul_params(cfg, stored=True) == total - norms - gather_only
    idle_experts = cfg.n_layers * (experts - 2) * 3 * cfg.d_model * cfg.d_ff if experts else 0
    assert transformer.matmul_params(cfg) == total - norms - gather_only - idle_experts
