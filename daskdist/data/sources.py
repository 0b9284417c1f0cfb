"""Where a loader's converted blocks come from: a static plan, or leases (``"dynamic"``).

Both sources implement one small interface (:class:`ChunkSource`):

- ``chunks()``: a generator of :class:`ChunkItem` (converted rows of one block, their
  global row ids under ``"dynamic"``); run by the prefetch thread, which owns it;
- ``delivered(ranges)``: rows the iterator handed to a caller (called under the
  iterator's lock, in the caller's thread);
- ``close()``: give back what was taken and never delivered (after the prefetch thread
  was joined, under the iterator's lock);
- ``state()``: what the source holds now (for ``state_dict`` and debugging).

:class:`StaticSource` reads the pipeline's pieces in the epoch plan's order from a
position (:mod:`.batching`); its ``chunks()`` runs once. :class:`DynamicSource` leases
units from ``ctx.leases`` until none are free *right now*; ``chunks()`` may run again
later (after the previous generator ended) to pick up rows that came back to the pool.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from daskdist.core.intervals import Interval, normalize, subtract, union
from daskdist.data import batching
from daskdist.data.convert import convert_chunk, num_rows
from daskdist.data.shards import UnitReader

if TYPE_CHECKING:
    from daskdist.data.loader import ArrowLoader

__all__ = ["ChunkItem", "ChunkSource", "DynamicSource", "StaticSource"]

_BUILDERS = 2  # shuffled blocks read, gathered and converted at once


class ChunkItem(NamedTuple):
    """One converted block on its way to the iterator."""

    cols: Any  # a convert.Chunk, or a pyarrow Table when the loader has ``collate``
    ids: np.ndarray | None  # global row ids (dynamic policy), else None
    rows: int
    staged: Any = None  # set by the device stage: what consumers wait on before use


class ChunkSource(Protocol):
    """What the loader iterator reads blocks from (see the module doc)."""

    def chunks(self) -> Iterator[ChunkItem]: ...

    def delivered(self, ranges: list[Interval]) -> None: ...

    def close(self) -> None: ...

    def state(self) -> dict: ...


def _convert(loader: ArrowLoader, table: pa.Table, index: np.ndarray | None) -> Any:
    """Rows ``index`` of ``table``: a table for ``collate``, else a ``Chunk``.

    Gathers release the GIL (one Arrow ``take``; ``index_select`` per column into 2-D
    buffers), so they overlap with consumers cutting batches.
    """
    if loader.collate is not None:
        return table if index is None else table.take(pa.array(index))
    return convert_chunk(table, loader.fill_null, index)


def _item(cols: Any, ids: np.ndarray | None) -> ChunkItem:
    return ChunkItem(cols, ids, num_rows(cols))


class StaticSource:
    """The pipeline's pieces (a sharding policy's assignment) from stream ``position``."""

    def __init__(self, loader: ArrowLoader, epoch: int, position: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self.start = position

    def _block(self, blocks: list[batching.Block], bi: int, skip: int,
               reader: UnitReader) -> Any:
        """Block ``bi`` read, gathered (strided pieces, shuffle) and converted, from its
        row ``skip`` on."""
        ld = self.loader
        blk = blocks[bi]
        units = ld.shards.units
        tables = [reader.read(units[ld._pieces[k].unit], ld.columns) for k in blk.pieces]
        idx, strided, base = [], False, 0
        for k in blk.pieces:
            p = ld._pieces[k]
            if p.stride != 1:
                strided = True
            idx.append(np.arange(p.first_local(), p.num_rows, p.stride) + base)
            base += p.num_rows
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        index = np.concatenate(idx) if strided else None
        if blk.shuffled:
            perm = batching.block_permutation(blk.rows, ld.seed, self.epoch, bi)
            index = perm if index is None else index[perm]
        if skip:
            if index is None:
                table = table.slice(skip)
            else:
                index = index[skip:]
        return _convert(ld, table, index)

    def chunks(self) -> Iterator[ChunkItem]:
        """The epoch's blocks from the start position, in plan order (non-empty only)."""
        for cols in self._blocks():
            item = _item(cols, None)
            if item.rows:
                yield item

    def _blocks(self) -> Iterator[Any]:
        ld = self.loader
        blocks = batching.plan_blocks(
            [p.rows for p in ld._pieces], ld.shuffle, ld.seed, self.epoch, ld.shuffle_buffer
        )
        b, off = batching.locate(blocks, self.start)
        if not ld.shuffle:  # reading is the work, and pyarrow spreads it over threads
            reader = ld.shards.reader()
            try:
                for bi in range(b, len(blocks)):
                    yield self._block(blocks, bi, off if bi == b else 0, reader)
            finally:
                reader.close()
            return
        # Shuffled: gathers are single-threaded, so _BUILDERS blocks are built at once,
        # each in a thread with a reader of its own, and handed on in order.
        local = threading.local()
        readers: list[UnitReader] = []

        def build(bi: int) -> Any:
            reader = getattr(local, "reader", None)
            if reader is None:
                reader = local.reader = ld.shards.reader()
                readers.append(reader)
            return self._block(blocks, bi, off if bi == b else 0, reader)

        pool = ThreadPoolExecutor(_BUILDERS, "daskdist-block")
        futs: deque = deque()
        try:
            for bi in range(b, len(blocks)):
                futs.append(pool.submit(build, bi))
                if len(futs) >= _BUILDERS:
                    yield futs.popleft().result()
            while futs:
                yield futs.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for r in readers:
                r.close()

    def delivered(self, ranges: list[Interval]) -> None:
        """Static rows are counted by position; nothing to track."""

    def close(self) -> None:
        """Nothing was taken from anyone."""

    def state(self) -> dict:
        return {"epoch": self.epoch, "start": self.start}


class DynamicSource:
    """Units leased from ``ctx.leases``, only their unacknowledged rows read.

    Keeps the rows leased and not yet delivered (``outstanding``; its own lock, since
    the prefetch thread adds and callers' threads remove) so :meth:`close` can give
    them back.
    """

    def __init__(self, loader: ArrowLoader, epoch: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self._lock = threading.Lock()
        self.outstanding: list[Interval] = []

    def chunks(self) -> Iterator[ChunkItem]:
        """Lease, read and convert units until no free rows remain right now."""
        ld = self.loader
        svc = ld.ctx.leases
        units = ld.shards.units
        reader = ld.shards.reader()
        try:
            while True:
                lease = svc.acquire(ld.dataset_id, self.epoch, ld._unit_rows)
                if lease is None:
                    return
                u, intervals = lease
                with self._lock:
                    self.outstanding = union(self.outstanding, normalize(intervals))
                unit = units[u]
                ids = batching.ids_of_ranges(intervals)
                if len(ids) == 0:
                    continue
                table = reader.read(unit, ld.columns)
                local = ids - unit.start
                if ld.shuffle:
                    tile = batching.dynamic_tile(ld.batch_size)
                    order = batching.dynamic_order(len(ids), ld.seed, self.epoch, u, tile)
                    ids, index = ids[order], local[order]
                else:
                    index = None if len(ids) == unit.num_rows else local
                item = _item(_convert(ld, table, index), ids)
                if item.rows:
                    yield item
        finally:
            reader.close()

    def delivered(self, ranges: list[Interval]) -> None:
        with self._lock:
            self.outstanding = subtract(self.outstanding, ranges)

    def close(self) -> None:
        """Give back leased rows no caller received (when the service supports it)."""
        with self._lock:
            rest, self.outstanding = self.outstanding, []
        if rest:
            release = getattr(self.loader.ctx.leases, "release", None)
            if release is not None:
                release(self.loader.dataset_id, self.epoch, rest)

    def state(self) -> dict:
        with self._lock:
            return {"epoch": self.epoch, "outstanding": list(self.outstanding)}
