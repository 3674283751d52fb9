"""An epoch's document order with O(1) memory per document: a keyed permutation of blocks, then windows.

The split's records are cut into blocks of consecutive records (layout.BLOCK_RECORDS). Epoch e visits the
blocks in the order of a Feistel network keyed by (seed, e), with cycle-walking onto [0, n_blocks): a
bijection computed on the fly, never stored. Consecutive groups of `window_blocks` blocks of that order form
windows, and inside a window its documents are drawn in a permutation seeded by (seed, e, window). So a
window mixes documents from `window_blocks` random places of the corpus, only one window's documents are
ever materialised, and a window reads `window_blocks` contiguous runs of records (few shards, few ranges).
Memory: a token count per block (8 bytes per 1,024 documents) and, per cached epoch, one per window.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6  # Luby-Rackoff: 4 rounds already make a strong pseudorandom permutation
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _round_function(half: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser of (half + key): every output bit depends on every input bit."""
    z = (half + key) * _MIX[0]
    z = (z ^ (z >> np.uint64(30))) * _MIX[1]
    z = (z ^ (z >> np.uint64(27))) * _MIX[2]
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A keyed bijection of [0, n), evaluated elementwise: `perm(x)` for an int array x."""

    def __init__(self, n: int, key: int | list[int]):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = n
        half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)  # 2*half_bits bits cover [0, n), at most 4n
        self.half_bits, self.mask = np.uint64(half_bits), np.uint64((1 << half_bits) - 1)
        self.keys = np.random.SeedSequence(key).generate_state(ROUNDS, np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half_bits, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_round_function(right, key) & self.mask)
        return (left << self.half_bits) | right

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"permutation of [0, {self.n}) applied to {x.min()}..{x.max()}")
        y = self._encrypt(x.astype(np.uint64))
        # Cycle-walking: re-encrypting a value outside [0, n) until it lands inside keeps the map a bijection
        # (it follows x's own cycle); with a domain under 4n, that takes under 4 rounds on average.
        outside = np.flatnonzero(y >= self.n)
        while outside.size:
            y[outside] = self._encrypt(y[outside])
            outside = outside[y[outside] >= self.n]
        return y.astype(np.int64)


class BlockOrder:
    """Which blocks each window of an epoch holds, and the tokens each window ends at.

    `block_tokens[b]` is block b's tokens in file order. `seed=None` keeps the file order (held-out data)."""

    def __init__(self, block_tokens: np.ndarray, seed: int | None, window_blocks: int):
        self.block_tokens = np.asarray(block_tokens, np.int64)
        self.seed, self.window_blocks = seed, window_blocks
        self.n_windows = -(-len(self.block_tokens) // window_blocks)
        self._window_ends: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int):
        if self.seed is None:
            return lambda x: np.asarray(x, np.int64)
        return FeistelPermutation(len(self.block_tokens), [self.seed, epoch, 0xB10C])

    def blocks(self, epoch: int, window: int) -> np.ndarray:
        """The block ids of `window` in `epoch`, in visiting order."""
        first = window * self.window_blocks
        return self._permutation(epoch)(np.arange(first, min(first + self.window_blocks, len(self.block_tokens))))

    def window_ends(self, epoch: int) -> np.ndarray:
        """Exclusive end, in tokens from the epoch's start, of each window (cached for two epochs: rows only
        ever straddle neighbouring ones)."""
        if epoch not in self._window_ends:
            n = len(self.block_tokens)
            tokens = self.block_tokens[self._permutation(epoch)(np.arange(n))]
            padded = np.zeros(self.n_windows * self.window_blocks, np.int64)
            padded[:n] = tokens
            if len(self._window_ends) >= 2:
                self._window_ends.pop(min(self._window_ends))
            self._window_ends[epoch] = np.cumsum(padded.reshape(self.n_windows, self.window_blocks).sum(1))
        return self._window_ends[epoch]

    def inner(self, epoch: int, window: int, size: int) -> np.ndarray:
        """The order of a window's `size` documents (as listed block by block)."""
        if self.seed is None:
            return np.arange(size)
        return np.random.default_rng(np.random.SeedSequence([self.seed, epoch, window])).permutation(size)
