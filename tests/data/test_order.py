"""The keyed block permutation behind the train order (jaxtrain/data/order.py)."""

import numpy as np
import pytest

from jaxtrain.data import order


@pytest.mark.parametrize("n", [*range(1, 70), 255, 256, 257, 1000, 4097])
def test_feistel_is_a_bijection_of_a_full_small_range(n):
    image = order.FeistelPermutation(n, [7, 1])(np.arange(n))
    np.testing.assert_array_equal(np.sort(image), np.arange(n))


def test_feistel_on_samples_of_a_large_range():
    n = 10**12 + 39  # an odd size, so cycle-walking is exercised
    perm = order.FeistelPermutation(n, [11, 2])
    x = np.unique(np.random.default_rng(0).integers(0, n, 200_000))
    y = perm(x)
    assert y.min() >= 0 and y.max() < n and len(np.unique(y)) == len(x)  # in range, and no two collide
    np.testing.assert_array_equal(perm(x[::-1])[::-1], y)  # elementwise: a pure function of the input
    # and it moves everything, with images spread over the whole range
    assert (y != x).mean() > 0.999 and np.histogram(y, bins=10, range=(0, n))[0].min() > 19_000
    with pytest.raises(IndexError):
        perm(np.array([n]))


def test_keys_give_different_permutations_and_the_same_key_the_same():
    x = np.arange(5000)
    a, b = order.FeistelPermutation(5000, [1, 0])(x), order.FeistelPermutation(5000, [1, 1])(x)
    np.testing.assert_array_equal(a, order.FeistelPermutation(5000, [1, 0])(x))
    assert (a == b).mean() < 0.01
    # a shuffle, not a rotation: neighbours land far apart
    assert np.median(np.abs(np.diff(a))) > 500


def test_block_order_windows_and_their_token_ends():
    tokens = np.arange(1, 24)  # 23 blocks of 1..23 tokens
    blocks = order.BlockOrder(tokens, seed=4, window_blocks=5)
    assert blocks.n_windows == 5
    for epoch in range(3):
        windows = [blocks.blocks(epoch, w) for w in range(5)]
        assert [len(w) for w in windows] == [5, 5, 5, 5, 3]
        np.testing.assert_array_equal(np.sort(np.concatenate(windows)), np.arange(23))
        np.testing.assert_array_equal(blocks.window_ends(epoch), np.cumsum([tokens[w].sum() for w in windows]))
        assert sorted(blocks.inner(epoch, 1, 40).tolist()) == list(range(40))
    assert blocks.blocks(0, 0).tolist() != blocks.blocks(1, 0).tolist()
    in_file_order = order.BlockOrder(tokens, seed=None, window_blocks=5)
    assert in_file_order.blocks(2, 1).tolist() == [5, 6, 7, 8, 9]
    assert in_file_order.inner(2, 1, 4).tolist() == [0, 1, 2, 3]
