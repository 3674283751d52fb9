"""jaxtrain.models.gpu_grouped's kernels, run by Pallas's interpreter on CPU: the weight gradient equals XLA's
ragged-contracting `ragged_dot_general`, and the input gradient XLA's `ragged_dot` on the transposed weight, for
groups of every size (empty ones, one past a block, rows left over past sum(sizes)) and for shapes that do not
fill their blocks. tests/tools/test_plan_gpu.py compiles them for described H100s inside a MoE train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models import gpu_grouped

RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])


SHAPES = [
    (100, 64, 48, [30, 0, 41, 7, 12]),  # 10 rows past sum(sizes), an empty group, n below a block
    (200, 96, 80, [0, 0, 3, 150]),  # a group over two blocks of rows; k and n over one block, under two
    (70, 24, 130, [70]),  # one group, every row
    (40, 16, 16, [0, 0]),  # no rows at all: zeros
]


@pytest.mark.parametrize("m, k, n, sizes", [*SHAPES, (130, 32, 16, [64, 1, 63, 2])])  # borders in mid-tile
def test_input_gradient_equals_xla_s_on_the_transposed_weight(m, k, n, sizes):
    rng = np.random.default_rng(m)
    g = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, n)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    want = jax.lax.ragged_dot(g, jnp.swapaxes(w, 1, 2), sizes)
    got = gpu_grouped.ragged_transposed_dot(g, w, sizes, interpret=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m, sizes", [
    (300, [0, 64, 1, 63, 0, 100, 2]),  # borders on and off tiles, empty groups, 70 rows left over
    (5, [2, 0, 3]),  # fewer rows than a tile
    (256, [256]), (200, [0, 0]), (129, [1] * 129),  # one group; none; a border at every row
])
def test_the_input_gradient_s_programs_write_every_row_once(m, sizes):
    """Its output is written by masked stores only, so a row no program covers would be left as it was: every row
    is within exactly one program's group and tile, those past sum(sizes) in the zero pseudo-group."""
    sizes = np.asarray(sizes)
    group, tile, starts, ends = map(np.asarray, jax.jit(gpu_grouped._row_tiles, static_argnums=1)(
        jnp.asarray(sizes, jnp.int32), m))
    row = tile[:, None] * gpu_grouped.BM + np.arange(gpu_grouped.BM)
    covered = (row >= starts[group][:, None]) & (row < ends[group][:, None])
    counts = np.bincount(row[covered], minlength=m)
    assert counts.shape == (m,) and (counts == 1).all(), (sizes, counts)
    owner = np.broadcast_to(group[:, None], row.shape)[covered][np.argsort(row[covered])]
    np.testing.assert_array_equal(owner, np.repeat(np.arange(len(sizes) + 1), [*sizes, m - sizes.sum()]))


@pytest.mark.parametrize("m, k, n, sizes", SHAPES)
def test_weight_gradient_equals_xla_s(m, k, n, sizes):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    want = jax.lax.ragged_dot_general(x, g, sizes, RAGGED_CONTRACTING)
    got = gpu_grouped.ragged_weight_grad(x, g, sizes, interpret=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)  # sums of up to 150 products of N(0, 1)


def test_bf16_accumulates_in_f32():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(96, 32)), jnp.bfloat16)
    g = jnp.asarray(rng.normal(size=(96, 32)), jnp.bfloat16)
    sizes = jnp.asarray([40, 56], jnp.int32)
    got = gpu_grouped.ragged_weight_grad(x, g, sizes, interpret=True)
    want = jax.lax.ragged_dot_general(x.astype(jnp.float32), g.astype(jnp.float32), sizes, RAGGED_CONTRACTING)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=1e-2, atol=0.1)  # bf16's output rounding


def test_vmapped_each_slice_equals_xla_s():  # a pipeline's stages and weight copies vmap the MoE layer
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(3, 50, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(3, 50, 24)), jnp.float32)
    sizes = jnp.asarray([[10, 0, 40], [50, 0, 0], [1, 2, 3]], jnp.int32)
    got = jax.vmap(lambda a, b, s: gpu_grouped.ragged_weight_grad(a, b, s, interpret=True))(x, g, sizes)
    want = jax.vmap(lambda a, b, s: jax.lax.ragged_dot_general(a, b, s, RAGGED_CONTRACTING))(x, g, sizes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_vmapped_input_gradient_equals_xla_s():
    rng = np.random.default_rng(3)
    g = jnp.asarray(rng.normal(size=(2, 90, 24)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 3, 16, 24)), jnp.float32)
    sizes = jnp.asarray([[10, 0, 70], [1, 66, 3]], jnp.int32)
    got = jax.vmap(lambda a, b, s: gpu_grouped.ragged_transposed_dot(a, b, s, interpret=True))(g, w, sizes)
    want = jax.vmap(lambda a, b, s: jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), s))(g, w, sizes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
