"""Epoch planning (pure): the order in which a pipeline's pieces are read and shuffled.

An epoch's row stream is a sequence of *blocks*. Without shuffling each piece is its
own block, read in stable order. With ``shuffle=True`` the piece order is permuted by
a generator seeded with ``(seed, epoch)``, consecutive pieces are grouped into blocks
of at least ``buffer_rows`` rows (the bounded shuffle buffer), and each block's rows
are permuted as a whole, by one vectorised gather, with a generator seeded with
``(seed, epoch, block)``. Batches are consecutive ``batch_size`` slices of the stream,
across block boundaries.

Because the stream is a pure function of (pieces, seed, epoch, buffer_rows), a
loader's resumable state is just the number of rows consumed: :func:`locate` finds
the block and offset to restart from without reading anything before it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Block",
    "block_permutation",
    "dynamic_order",
    "dynamic_tile",
    "ids_of_ranges",
    "locate",
    "plan_blocks",
    "ranges_of_ascending",
    "ranges_of_ids",
]


@dataclass(frozen=True)
class Block:
    pieces: tuple[int, ...]  # positions in the pipeline's piece list, in read order
    start: int  # stream position of the block's first row
    rows: int
    shuffled: bool


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


def plan_blocks(
    piece_rows: Sequence[int],
    shuffle: bool,
    seed: int,
    epoch: int,
    buffer_rows: int,
) -> list[Block]:
    """Blocks of the epoch for pieces with the given row counts (see module doc)."""
    if shuffle:
        order = [int(k) for k in _rng(seed, epoch, 0x5EED).permutation(len(piece_rows))]
    else:
        order = list(range(len(piece_rows)))
    blocks: list[Block] = []
    pos = 0
    cur: list[int] = []
    cur_rows = 0
    limit = max(1, buffer_rows) if shuffle else 1
    for k in order:
        cur.append(k)
        cur_rows += int(piece_rows[k])
        if cur_rows >= limit:
            blocks.append(Block(tuple(cur), pos, cur_rows, shuffle))
            pos += cur_rows
            cur, cur_rows = [], 0
    if cur:
        blocks.append(Block(tuple(cur), pos, cur_rows, shuffle))
    return blocks


def block_permutation(rows: int, seed: int, epoch: int, block: int) -> np.ndarray:
    """The row permutation of one shuffled block (int64)."""
    return _rng(seed, epoch, block, 0xB10C).permutation(rows).astype(np.int64, copy=False)


def locate(blocks: Sequence[Block], position: int) -> tuple[int, int]:
    """``(block index, offset in block)`` of stream position ``position``;
    ``(len(blocks), 0)`` at or past the end."""
    if not blocks or position >= blocks[-1].start + blocks[-1].rows:
        return len(blocks), 0
    b = bisect_right([blk.start for blk in blocks], position) - 1
    while blocks[b].rows == 0 or position >= blocks[b].start + blocks[b].rows:
        b += 1
    return b, position - blocks[b].start


def ranges_of_ids(ids: np.ndarray) -> list[tuple[int, int]]:
    """Row ids as sorted, merged half-open intervals (vectorised run detection)."""
    if len(ids) == 0:
        return []
    s = np.sort(ids)
    breaks = np.flatnonzero(np.diff(s) != 1) + 1
    starts = s[np.concatenate(([0], breaks))]
    stops = s[np.concatenate((breaks - 1, [len(s) - 1]))] + 1
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def ranges_of_ascending(ids: np.ndarray) -> list[tuple[int, int]]:
    """:func:`ranges_of_ids` for ids known to ascend (no sort; one run: O(1))."""
    n = len(ids)
    if n == 0:
        return []
    a, b = int(ids[0]), int(ids[-1]) + 1
    if b - a == n:
        return [(a, b)]
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    stops = ids[np.concatenate((breaks - 1, [n - 1]))] + 1
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def ids_of_ranges(ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The row ids of intervals, as one int64 array."""
    if not ranges:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges])


def dynamic_tile(batch_size: int) -> int:
    """Rows per tile under the dynamic shuffle: a batch spans about 32 tiles."""
    return max(4, batch_size // 32)


def dynamic_order(n: int, seed: int, epoch: int, unit: int, tile: int) -> np.ndarray:
    """Row order within a leased unit under ``shuffle=True`` with the dynamic policy.

    Tiles of ``tile`` consecutive rows are permuted (seeded by ``(seed, epoch, unit)``).
    A batch of ``b`` rows then holds at most about ``b / tile + 2`` contiguous runs
    wherever the consumer cuts it, which keeps its acknowledgement (a list of
    intervals) and the lease table small while rows still mix across the unit.
    """
    rng = _rng(seed, epoch, unit, 0xD1)
    n_tiles = -(-n // tile)
    starts = rng.permutation(n_tiles).astype(np.int64) * tile
    if n % tile == 0:
        return (starts[:, None] + np.arange(tile, dtype=np.int64)).ravel()
    out = (starts[:, None] + np.arange(tile, dtype=np.int64)).ravel()
    return out[out < n]
