"""jaxtrain.models.gpu_grouped's weight-gradient kernel, run by Pallas's interpreter on CPU: it equals XLA's
ragged-contracting `ragged_dot_general` for groups of every size (empty ones, one past a block, rows left over
past sum(sizes)) and for shapes that do not fill its blocks. tests/tools/test_plan_gpu.py compiles it for
described H100s inside a MoE train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models import gpu_grouped

RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])


@pytest.mark.parametrize("m, k, n, sizes", [
    (100, 64, 48, [30, 0, 41, 7, 12]),  # 10 rows past sum(sizes), an empty group, n below a block
    (200, 96, 80, [0, 0, 3, 150]),  # a group over two blocks of rows; k and n over one block, under two
    (70, 24, 130, [70]),  # one group, every row
    (40, 16, 16, [0, 0]),  # no rows at all: zeros
])
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
