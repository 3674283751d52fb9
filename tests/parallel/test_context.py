"""Context parallelism (jaxtrain.parallel.context) on 8 fake CPU devices (conftest): ring, Ulysses and USP attention
equal the unsharded attention (models/attention.py's mask and math), outputs and gradients wrt q, k, v within 1e-5
in f32, with packed documents crossing the shard borders, a sliding window, and the zigzag layout; and the zigzag
layout balances the causal work that the contiguous one does not, modelled and read from the compiled ring."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.errors import ConfigError
from jaxtrain.models import gpu_flash, tpu_flash
from jaxtrain.models.attention import attend, attention_mask
from jaxtrain.parallel import context
from jaxtrain.parallel import mesh as mesh_lib

B, T, HEADS, KV_HEADS, D = 2, 64, 4, 2, 8
# Packed rows: documents of these lengths, then padding (segment 0). Shards of 8 (sequence 8) or 16 (sequence 4)
# tokens: most documents cross a border.
DOCS = ([5, 13, 9, 20, 11], [30, 3, 27])


def packed_segments(docs=DOCS, t=T):
    seg = np.zeros((len(docs), t), np.int32)
    for row, lengths in enumerate(docs):
        at = 0
        for i, n in enumerate(lengths):
            seg[row, at:at + n] = i + 1
            at += n
    return seg


def inputs(heads=HEADS, kv_heads=KV_HEADS, seed=0, t=T):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, heads, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, t, kv_heads, D)).astype(np.float32) for _ in range(2))
    cotangent = rng.normal(size=(B, t, heads, D)).astype(np.float32)
    return q, k, v, cotangent


def reference(q, k, v, seg, window):
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return attend(q, k, v, attention_mask(seg, window), D ** -0.5)


def out_and_grads(attention, q, k, v, seg, cotangent):
    """(output, d loss / d (q, k, v)) of loss = sum(output * cotangent) over the real (unpadded) queries: a query
    that sees no key has an unused output that the implementations define differently."""
    real = jnp.asarray(seg != 0, jnp.float32)[:, :, None, None]

    def loss(q, k, v):
        out = attention(q, k, v)
        return jnp.sum(out * cotangent * real), out * real

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(q, k, v).compile()
    (_, out), grads = compiled(q, k, v)
    return out, grads, compiled.as_text()


def assert_equal_to_reference(attention, seg, window, **kw) -> str:
    """The compiled step's HLO, once its output and gradients have been checked."""
    q, k, v, ct = inputs(**kw)
    want = out_and_grads(lambda q, k, v: reference(q, k, v, jnp.asarray(seg), window), q, k, v, seg, ct)
    got = out_and_grads(attention, q, k, v, seg, ct)
    for name, w, g in zip(("out", "dq", "dk", "dv"), (want[0], *want[1]), (got[0], *got[1])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)
    return got[2]


def collectives(hlo: str) -> dict[str, list[str]]:
    """{collective: the result shapes of each}, e.g. {"collective-permute": ["f32[2,8,2,8]", ...]}."""
    out = {}
    for line in hlo.splitlines():
        found = re.search(r"= (\S+) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start)?\(",
                          line)
        if found:
            out.setdefault(found[2], []).append(found[1].split("{")[0])
    return out


CASES = {  # id: (mesh, packed, window, zigzag, sub-blocks per shard)
    "seq8": ({"sequence": 8}, False, 0, False, 2),
    "data2_seq4_packed_4blocks": ({"data": 2, "sequence": 4}, True, 0, False, 4),
    "seq8_packed_window": ({"sequence": 8}, True, 11, False, 2),
    "seq8_zigzag": ({"sequence": 8}, False, 0, True, 2),
    "data2_seq4_packed_window_zigzag": ({"data": 2, "sequence": 4}, True, 13, True, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ring_attention_equals_unsharded_attention(case):
    """Under zigzag the inputs are permuted, the ring runs on the permuted layout with positions = the permutation,
    and its output is permuted back; gradients flow through both permutations to the original order. The 4-block
    case takes its mesh and batch axes from the active rules, as the model would call it. In the
    compiled step K/V move only by collective-permute, one device's shard at a time (forward and backward: the
    backward is a ring, not the transpose of a gather), only the small int segment ids and positions are
    gathered, and the sub-block pairs are conditionals (skipped when masked)."""
    shape, packed, window, zigzag, chunks = CASES[case]
    mesh = mesh_lib.make_mesh(shape)
    seg = packed_segments() if packed else np.ones((B, T), np.int32)
    n = shape["sequence"]

    def attention(q, k, v):
        if chunks == 4:
            with mesh_lib.activation_sharding(mesh, mesh_lib.resolve_rules("dp_fsdp_tp")):
                return context.ring_attention(q, k, v, jnp.asarray(seg), window=window, chunks=chunks)
        if not zigzag:
            return context.ring_attention(q, k, v, jnp.asarray(seg), mesh=mesh, window=window, chunks=chunks)
        perm, inv = context.balance_permutation(T, n), context.inverse_balance_permutation(T, n)
        out = context.ring_attention(q[:, perm], k[:, perm], v[:, perm], jnp.asarray(seg[:, perm]),
                                     jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (B, T)), mesh=mesh,
                                     window=window, chunks=chunks)
        return out[:, inv]

    hlo = assert_equal_to_reference(attention, seg, window)
    moved = collectives(hlo)
    shard = f"f32[{B // shape.get('data', 1)},{T // n},{KV_HEADS},{D}]"
    assert set(moved["collective-permute"]) == {shard}, moved
    assert all(s.startswith("s32[") for s in moved.get("all-gather", [])), moved
    assert set(moved.get("all-reduce", [])) <= {"f32[]"}, moved  # the loss
    assert set(moved) <= {"collective-permute", "all-gather", "all-reduce"}, moved
    assert hlo.count(" conditional(") >= 2


@pytest.mark.parametrize("shape,window", [({"sequence": 4}, 0), ({"data": 2, "sequence": 4}, 9)],
                         ids=["seq4_packed", "data2_seq4_packed_window"])
def test_ulysses_attention_equals_unsharded_attention(shape, window):
    mesh = mesh_lib.make_mesh(shape)
    seg = packed_segments()
    assert_equal_to_reference(
        lambda q, k, v: context.ulysses_attention(q, k, v, jnp.asarray(seg), mesh=mesh, window=window), seg, window,
        heads=8, kv_heads=4)


def test_ring_across_ulysses_groups_equals_unsharded_attention():
    """USP on the one sequence axis of 8: Ulysses within groups of 4 consecutive devices (8 heads, 4 KV heads), the
    ring across the 2 groups, packed documents, a window, the zigzag layout of the ring (2 members). The compiled
    step's all-to-alls stay within the groups, and K/V hop between them."""
    mesh = mesh_lib.make_mesh({"sequence": 8})
    seg = packed_segments()
    window = 21
    perm, inv = context.balance_permutation(T, 2), context.inverse_balance_permutation(T, 2)

    def attention(q, k, v):
        out = context.usp_attention(q[:, perm], k[:, perm], v[:, perm], jnp.asarray(seg[:, perm]),
                                    jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (B, T)), mesh=mesh, ulysses=4,
                                    window=window)
        return out[:, inv]

    hlo = assert_equal_to_reference(attention, seg, window, heads=8, kv_heads=4)
    assert re.search(r"all-to-all\(.*replica_groups=\{\{0,1,2,3\},\{4,5,6,7\}\}", hlo), "all-to-all groups"
    assert set(collectives(hlo)["collective-permute"]) == {f"f32[{B},{T // 2},1,{D}]"}  # a group's block, 1 KV head


KERNEL_CASES = {  # id: (mesh, Ulysses ways, window); packed documents and the zigzag layout of the ring in each
    "ring_seq8_window": ({"sequence": 8}, 1, 37),
    "ring_data2_seq4": ({"data": 2, "sequence": 4}, 1, 0),
    "ulysses_seq4": ({"sequence": 4}, 4, 0),
    "usp_2x4_window": ({"sequence": 8}, 4, 21),
}


def assert_kernel_equals_unsharded_attention(kernel, shape: dict, ways: int, window: int, t: int, docs,
                                             rules=None):
    """usp_attention with `kernel` in each ring step, the zigzag layout and packed `docs`, equals the reference;
    `rules`: active while it traces (heads split over the tensor axis)."""
    n = shape["sequence"]
    mesh = mesh_lib.make_mesh(shape)
    seg = packed_segments(docs, t)
    perm, inv = context.balance_permutation(t, n // ways), context.inverse_balance_permutation(t, n // ways)

    def attention(q, k, v):
        with mesh_lib.activation_sharding(mesh, rules) if rules else contextlib.nullcontext():
            out = context.usp_attention(q[:, perm], k[:, perm], v[:, perm], jnp.asarray(seg[:, perm]),
                                        jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (B, t)), mesh=mesh,
                                        ulysses=ways, window=window, kernel=kernel)
        return out[:, inv]

    hlo = assert_equal_to_reference(attention, seg, window, heads=8, kv_heads=4, t=t)
    assert all(f"/ring_flash_{name}/" in hlo for name in ("forward", "dq", "dkv"))  # the kernels ran, not XLA's
    return hlo


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_the_ring_s_gpu_kernels_equal_unsharded_attention(case):
    """model.attention_impl=pallas on GPUs: each ring step's block in models.gpu_flash's Triton kernels (run by
    Pallas's interpreter), tiles of 16 so a block holds up to 4 and the kernels skip the ones the mask empties.
    Ulysses is the ring of one group. The kernels take the ring's log-sum-exp into the backward: a step's own
    would not give these gradients."""
    shape, ways, window = KERNEL_CASES[case]
    assert_kernel_equals_unsharded_attention(gpu_flash.RingKernel(interpret=True, block=16), shape, ways, window,
                                             128, ([20, 45, 18, 30], [64, 7, 50]))


TPU_DOCS = ([160, 360, 144, 240], [512, 56, 400])  # 1,024 tokens
TPU_KERNEL_CASES = {  # id: (mesh, Ulysses ways, window, heads over tensor)
    "ring_data2_seq4_window": ({"data": 2, "sequence": 4}, 1, 150, False),
    "usp_tensor2_2x2": ({"tensor": 2, "sequence": 4}, 2, 0, True),
}


@pytest.mark.parametrize("case", list(TPU_KERNEL_CASES))
def test_the_ring_s_tpu_kernels_equal_unsharded_attention(case):
    """model.attention_impl=pallas on TPUs: models.tpu_flash's Mosaic kernels (run by Pallas's interpreter),
    tiles of 128 (a vreg's lanes), so the ring's blocks of 256 or 512 tokens hold 4 or 16. Mosaic kernels run
    only where every mesh axis is manual: with the heads split over `tensor` by the rules, each device's
    shard_map holds its heads (the ring passes 2 of the 4 KV heads), not all of them gathered."""
    shape, ways, window, over_tensor = TPU_KERNEL_CASES[case]
    rules = {"batch": (), "act_heads": ("tensor",), "act_kv_heads": ("tensor",)} if over_tensor else None
    hlo = assert_kernel_equals_unsharded_attention(tpu_flash.RingKernel(interpret=True, block=128), shape, ways,
                                                   window, 1024, TPU_DOCS, rules)
    if over_tensor:
        kv_local = 4 // 2 // ways
        assert set(collectives(hlo)["collective-permute"]) == {f"f32[{B},{1024 * ways // 4},{kv_local},{D}]"}


def test_the_tpu_kernels_give_the_same_under_the_tpu_interpreter_on_two_cores():
    """One ring step, forward and backward, under Pallas's TPU interpreter (pltpu.InterpretParams): it keeps a
    TPU's memory spaces, fills uninitialised memory with NaN and splits the "parallel" grid axes over 2 cores, as
    a megacore chip does. The kernels give what the plain interpreter gives (that one is checked against the
    unsharded attention above), up to float rounding: one runs the kernel op by op, the other as one XLA program
    whose fusions may order a row's sums differently on another CPU."""
    from jax.experimental.pallas import tpu as pltpu

    b, t, heads, kv_heads, d = 1, 256, 2, 1, 128
    rng = np.random.default_rng(0)
    q, g = (jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv_heads, d)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(packed_segments(([100, 120],), t))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    state = (jnp.zeros((b, t, heads, d)), jnp.full((b, heads, t), context._MASKED), jnp.zeros((b, heads, t)))
    window = jnp.int32(60)

    def step(interpret):
        kernel = tpu_flash.RingKernel(interpret=interpret, block=128)
        o, m, l = kernel.forward(q, k, v, seg, pos, seg, pos, window, 0.1, True, state)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
        acc = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
        return o, m, l, *kernel.backward(q, k, v, g, lse, l, seg, pos, seg, pos, window, 0.1, True, acc)

    want, got = step(True), step(pltpu.InterpretParams(num_cores_or_threads=2))
    assert np.isfinite(np.asarray(want[0])).all()
    for name, w, x in zip(("o", "m", "l", "dq", "dk", "dv"), want, got):
        np.testing.assert_allclose(np.asarray(x), np.asarray(w), rtol=1e-6, atol=1e-6, err_msg=name)


def test_the_ring_s_tpu_kernels_lower_to_mosaic():
    """The whole ring's forward and backward, bf16 at 8K tokens over 8 devices (USP 2 x 4, head_dim 128, GQA), lower
    for TPUs: two forward and four backward Mosaic calls in a shard_map that holds every mesh axis. (Lowering is
    jax's; Mosaic's compile needs a TPU's libtpu, which CI lacks.)"""
    mesh = mesh_lib.make_mesh({"sequence": 8})
    b, t, heads, kv_heads, d = 1, 8192, 8, 4, 128

    def loss(q, k, v, seg, pos):
        out = context.usp_attention(q, k, v, seg, pos, mesh=mesh, ulysses=2, window=jnp.int32(4096),
                                    kernel=tpu_flash.RingKernel())
        return out.astype(jnp.float32).sum()

    shapes = [jax.ShapeDtypeStruct(s, x) for s, x in (((b, t, heads, d), jnp.bfloat16),
                                                     ((b, t, kv_heads, d), jnp.bfloat16),
                                                     ((b, t, kv_heads, d), jnp.bfloat16),
                                                     ((b, t), jnp.int32), ((b, t), jnp.int32))]
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*shapes).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert text.count("tpu_custom_call") == 6
    assert set(re.findall(r"ring_flash_(\w+)", text)) == {"forward", "dq", "dkv"}


def test_ulysses_needs_kv_heads_that_divide_by_the_axis():
    q, k, v, _ = inputs(heads=8, kv_heads=2)
    with pytest.raises(ConfigError) as e:
        context.ulysses_attention(q, k, v, jnp.ones((B, T), jnp.int32), mesh=mesh_lib.make_mesh({"sequence": 4}))
    assert e.value.field == "model.n_kv_heads" and "mesh.sequence=4" in str(e.value)
    with pytest.raises(ConfigError) as e:
        context.usp_attention(q, k, v, jnp.ones((B, T), jnp.int32), mesh=mesh_lib.make_mesh({"sequence": 8}),
                              ulysses=4)
    assert e.value.field == "model.n_kv_heads" and "model.ulysses_ways=4" in str(e.value)
    assert context.ulysses_ways(0, 8, 8, 2) == 2 and context.ulysses_ways(0, 16, 16, 16) == 8


def test_balance_permutation_puts_chunks_i_and_2n_minus_1_minus_i_on_device_i():
    n, t = 4, 32
    perm, inv = context.balance_permutation(t, n), context.inverse_balance_permutation(t, n)
    shards = perm.reshape(n, 2, t // (2 * n)) // (t // (2 * n))  # each shard's two chunk numbers
    device = np.arange(n)[:, None]
    assert (shards[:, 0, :] == device).all() and (shards[:, 1, :] == 2 * n - 1 - device).all()
    x = np.arange(t) * 10
    assert (x[perm][inv] == x).all()
    with pytest.raises(ConfigError, match="train.seq_len"):
        context.balance_permutation(36, n)


def test_zigzag_balances_the_causal_work():
    """Sequence 8, 1024 tokens, each shard cut in 2 sub-blocks: contiguous, device i computes 4i + 3 sub-block
    pairs (the last one 31, 1.82x the mean); zigzag every device 17, and the unmasked q.k pairs within 1.15x too.
    Packed documents (a batch of 64 rows of 200-2000 tokens): the unmasked pairs 1.07x under zigzag, 1.61x
    contiguous."""
    n, t = 8, 1024
    contiguous = np.broadcast_to(np.arange(t), (1, t))
    perm = context.balance_permutation(t, n)
    ones = np.ones((1, t), np.int32)
    blocks, pairs = context.attention_work(contiguous, ones, n)
    assert blocks.tolist() == [4 * i + 3 for i in range(n)] and context.imbalance(blocks) > 1.8
    assert context.imbalance(pairs) > 1.8
    blocks, pairs = context.attention_work(perm[None], ones, n)
    assert blocks.tolist() == [2 * n + 1] * n and context.imbalance(pairs) <= 1.15
    rng = np.random.default_rng(1)
    docs = []
    for _ in range(64):
        docs.append(list(rng.integers(200, 2000, size=8)))
    seg = packed_segments([cut(row, t) for row in docs], t)
    _, contiguous_pairs = context.attention_work(np.broadcast_to(contiguous, seg.shape), seg, n)
    _, zigzag_pairs = context.attention_work(np.broadcast_to(perm, seg.shape), seg[:, perm], n)
    assert context.imbalance(zigzag_pairs) <= 1.15 < 1.5 < context.imbalance(contiguous_pairs)


def test_the_compiled_ring_is_balanced_under_zigzag():
    """Read from the compiled ring (context.ring_work: the sub-block pairs its conditionals ran, forward and
    backward, on each of 8 sequence devices, times a pair's FLOPs), 1,024 tokens: causal, one document, the busiest
    device does 1.82x the mean contiguous and 1.00x zigzag; 64 packed rows of 200-2000-token documents the same
    (every sub-block below the diagonal holds some row's document). The counts are attention_work's sub-blocks."""
    n, t = 8, 1024
    mesh = mesh_lib.make_mesh({"sequence": n})
    perm = context.balance_permutation(t, n)
    rng = np.random.default_rng(1)
    packed = packed_segments([cut(rng.integers(200, 2000, size=8), t) for _ in range(64)], t)
    for seg, contiguous_bound in ((np.ones((1, t), np.int32), 1.8), (packed, 1.5)):
        ratios = []
        for order in (np.arange(t), perm):
            pos = np.broadcast_to(order, seg.shape)
            flops = context.ring_work(seg[:, order], pos, mesh=mesh)
            blocks, _ = context.attention_work(pos, seg[:, order], n)
            np.testing.assert_allclose(flops / flops.sum(), blocks / blocks.sum())
            ratios.append(context.imbalance(flops))
        assert ratios[1] <= 1.15 and ratios[0] > contiguous_bound, ratios


def cut(lengths, t):
    """The document lengths that fill t tokens: the last one cut short."""
    out = []
    for n in lengths:
        out.append(min(int(n), t - sum(out)))
        if sum(out) == t:
            return out
    return out
