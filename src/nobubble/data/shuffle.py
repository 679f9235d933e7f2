"""Seeded hashing and shuffling on numpy uint64 arrays, without materializing permutations."""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a fast bijective 64-bit mixer (uint64 arithmetic wraps)."""
    x = np.asarray(x, dtype=np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key64(*parts: int) -> int:
    """Combine integers into one well-mixed 64-bit key."""
    key = 0x9E3779B97F4A7C15
    for part in parts:
        key = int(mix64(np.array([(key ^ part) & _MASK64], dtype=np.uint64))[0])
    return key


class Permutation:
    """A pseudo-random bijection of ``range(n)`` determined by ``key``.

    A 4-round Feistel network on the smallest even-bit power-of-two domain >= n is a bijection of
    that domain; indices that land outside ``range(n)`` are re-encrypted until they come back
    (cycle walking, fewer than 4 tries on average). Memory is O(1) whatever n is, so shuffling
    billions of rows costs nothing up front.
    """

    ROUNDS = 4

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError("a permutation needs n >= 1")
        self.n = n
        half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self._half = np.uint64(half)
        self._mask = np.uint64((1 << half) - 1)
        self._keys = [np.uint64(key64(key, r)) for r in range(self.ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (mix64(right ^ k) & self._mask)
        return (left << self._half) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        x = self._encrypt(np.asarray(index, dtype=np.uint64))
        outside = x >= self.n
        while outside.any():
            x[outside] = self._encrypt(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)
