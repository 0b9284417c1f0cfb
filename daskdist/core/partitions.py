"""Row ids of a Dask collection's partitions, and the order partitions are leased in (pure).

A collection whose partition lengths are unknown (a lazy DataFrame: they are learned as
partitions are computed, never by a pass before training) gives each partition
``STRIDE`` row ids: row ``i`` of partition ``p`` is ``p * STRIDE + i``, its partition's
index plus its position. :class:`StridedUnits` is the lease table's view of such a
dataset: ``n`` units of ``STRIDE`` ids each, of which only the first ``length`` exist
once the length is known (the table drops the rest). A collection whose lengths are
known up front (dask Arrays' chunks) uses the dense ids of files instead.

:class:`Permutation` is the seeded order in which a shuffled collection's partitions
are leased (a Feistel network with cycle walking: O(1) memory and time per index, the
same order for the same ``(seed, epoch)`` on any process). Imports nothing from Dask,
torch or the rest of the package.
"""

from __future__ import annotations

import hashlib
from array import array
from itertools import groupby

__all__ = ["MAX_UNITS", "STRIDE", "Permutation", "StridedUnits"]

STRIDE = 1 << 30  # row ids per partition of unknown length (one of STRIDE rows or more
#                   is an error naming it)
MAX_UNITS = 1 << 20  # partitions of one such collection: ids stay below the wire's
#                      limit on row ids (core.checks.MAX_ROWS, 2**50)


class StridedUnits:
    """``units`` partitions of ``STRIDE`` row ids each, with the lengths known so far
    (``-1``: unknown). Same interface as the lease table's dense units: ``total`` (the
    id space), ``units``, ``runs`` (what a definition is compared by), ``stop_of``,
    ``bounds``."""

    __slots__ = ("_runs", "known", "known_rows", "lengths", "stride", "total", "units")

    def __init__(self, units: int, stride: int = STRIDE) -> None:
        units, stride = int(units), int(stride)
        if not 0 <= units <= MAX_UNITS:
            raise ValueError(f"a collection has 0 .. {MAX_UNITS} partitions, got {units}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.units = units
        self.stride = stride
        self.total = units * stride
        self.lengths = array("q", [-1]) * units
        self.known = 0  # partitions whose length is known
        self.known_rows = 0  # rows of those
        self._runs: tuple[int, list[tuple[int, int]]] | None = None  # (known, runs)

    @property
    def runs(self) -> list[tuple[int, int]]:
        """What two definitions are compared by: ``[(-stride, units)]`` (a negative
        row count marks strided ids; dense runs never have one)."""
        return [(-self.stride, self.units)]

    def unit_of(self, row: int) -> int:
        return row // self.stride

    def bounds(self, unit: int) -> tuple[int, int]:
        """The ids of ``unit`` that may exist (all ``STRIDE`` until its length is known)."""
        a = unit * self.stride
        n = self.lengths[unit]
        return a, a + (self.stride if n < 0 else n)

    def stop_of(self, row: int) -> int:
        """The end of the unit holding ``row``'s ids (its id space's end)."""
        return (row // self.stride + 1) * self.stride

    def learn(self, unit: int, length: int) -> int | None:
        """Record ``unit``'s length; the length recorded before if it differs (nothing
        changes then), else ``None``. ``ValueError`` for a length over ``stride``."""
        if not 0 <= length < self.stride:
            raise ValueError(f"partition {unit} has {length} rows; a partition may have "
                             f"at most {self.stride - 1}")
        old = self.lengths[unit]
        if old >= 0:
            return None if old == length else old
        self.lengths[unit] = length
        self.known += 1
        self.known_rows += length
        return None

    def length_runs(self) -> list[tuple[int, int]]:
        """The lengths known so far, run-length encoded: ``[(length, partitions), ...]``
        in partition order, ``-1`` for a run of unknown ones (what a ledger carries, so
        a resumed epoch computes no partition just to learn its length). Built once per
        change: lengths are only ever added."""
        if self._runs is None or self._runs[0] != self.known:
            runs = [(n, sum(1 for _ in same)) for n, same in groupby(self.lengths)]
            self._runs = (self.known, runs)
        return list(self._runs[1])

    def nbytes(self) -> int:
        return self.lengths.itemsize * len(self.lengths)


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
