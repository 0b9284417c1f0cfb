"""Row ids of a Dask collection's partitions, and the order partitions are leased in (pure).

A collection whose partition lengths are unknown (a lazy DataFrame: they are learned as
partitions are computed, never by a pass before training) gives each partition
``STRIDE`` row ids: row ``i`` of partition ``p`` is ``p * STRIDE + i``, its partition's
index plus its position (:class:`~daskdist.core.leases.units.StridedUnits` is the lease
table's view of them). A collection whose lengths are known up front (dask Arrays'
chunks) uses the dense ids of files instead.

:class:`Permutation` is the seeded order in which a shuffled collection's partitions
are leased (a Feistel network with cycle walking: O(1) memory and time per index, the
same order for the same ``(seed, epoch)`` on any process). Imports nothing from Dask,
torch or the rest of the package.
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_UNITS", "STRIDE", "Permutation"]

STRIDE = 1 << 30  # row ids per partition of unknown length (one of STRIDE rows or more
#                   is an error naming it)
MAX_UNITS = 1 << 20  # partitions of one such collection: ids stay below the wire's
#                      limit on row ids (core.checks.MAX_ROWS, 2**50)


def _round(key: bytes, r: int, x: int, bits: int) -> int:
    h = hashlib.blake2b(x.to_bytes(8, "little") + bytes([r]), key=key, digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << bits) - 1)


class Permutation:
    """A seeded permutation of ``range(n)``: ``self[k]`` is the k-th index in the
    order. A 4-round Feistel network on the smallest even number of bits covering
    ``n``, cycle-walked into range (fewer than 4 steps on average)."""

    __slots__ = ("_half", "_key", "n")

    def __init__(self, n: int, *seed: int) -> None:
        self.n = int(n)
        bits = max(2, (max(1, self.n - 1)).bit_length())
        self._half = (bits + 1) // 2
        self._key = hashlib.blake2b(
            b"".join(int(s).to_bytes(16, "little", signed=True) for s in seed),
            digest_size=16).digest()

    def _encrypt(self, x: int) -> int:
        h = self._half
        mask = (1 << h) - 1
        left, right = x >> h, x & mask
        for r in range(4):
            left, right = right, left ^ _round(self._key, r, right, h)
        return (left << h) | right

    def __getitem__(self, k: int) -> int:
        if not 0 <= k < self.n:
            raise IndexError(k)
        x = self._encrypt(k)
        while x >= self.n:
            x = self._encrypt(x)
        return x

    def __len__(self) -> int:
        return self.n
