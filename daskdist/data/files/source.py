"""Parquet / Arrow IPC files as a loader's source (:class:`FileSource`).

The files' listing and units are :class:`~.shards.ArrowShards`'; this module reads them:

- :meth:`FileReader.static_pass`: a static policy's pieces in the epoch plan's order
  (:mod:`.batching`: shuffled pieces, each block's rows permuted by one gather) from a
  stream position; shuffled blocks are built two at a time, each in a thread with a
  reader of its own;
- :meth:`FileReader.unit_reads`: a lease's rows, unit by unit (under ``shuffle``, in
  blocks of at least ``shuffle_buffer`` rows, tile-permuted), only the leased rows of
  each unit read. A unit that cannot be read or converted is a
  :class:`~.sources.UnitFailure` naming the file and row group (and the column).
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from daskdist.core.intervals import Interval
from daskdist.core.leases.units import unit_runs
from daskdist.core.protocol import DatasetDef
from daskdist.data import batching
from daskdist.data.convert import convert_chunk, num_rows
from daskdist.data.files.arrow import ArrowShards, Unit, UnitReader
from daskdist.data.sharding import Piece
from daskdist.data.sources import (
    ChunkItem,
    Pending,
    ReadSpec,
    Source,
    SourceReader,
    UnitFailure,
    is_path_like,
    register_source,
    type_name,
)

__all__ = ["FileReader", "FileSource"]

_BUILDERS = 2  # shuffled blocks read, gathered and converted at once


def convert(spec: ReadSpec, table: pa.Table, index: np.ndarray | None) -> Any:
    """Rows ``index`` of ``table``: a table for ``collate``, else a ``Chunk``. Gathers
    release the GIL (one Arrow ``take``; ``index_select`` per column into 2-D buffers),
    so they overlap with consumers cutting batches."""
    if spec.collate:
        return table if index is None else table.take(pa.array(index))
    return convert_chunk(table, spec.fill_null, index)


def item_of(cols: Any, ids: np.ndarray | None, ascending: bool = False) -> ChunkItem:
    return ChunkItem(cols, ids, num_rows(cols), ascending=ascending)


class FileSource(Source):
    """Files (:class:`~.shards.ArrowShards`) as a source."""

    def __init__(self, shards: ArrowShards) -> None:
        self.shards = shards
        self.columns = list(shards.schema.names)  # reads footers: a bad file raises here
        self.what = repr(shards)

    def unit_rows(self) -> list[int]:
        return [u.num_rows for u in self.shards.units]

    def unit_groups(self) -> list[int]:
        return [u.file_index for u in self.shards.units]

    def fingerprint(self) -> str:
        return self.shards.fingerprint()

    def definition(self, dataset_id: str, label: str, seed: int, shuffle: bool) -> DatasetDef:
        return DatasetDef(dataset_id, label, unit_runs(self.unit_rows()), int(seed))

    def open(self, spec: ReadSpec) -> FileReader:
        return FileReader(self.shards, spec)

    @classmethod
    def of(cls, obj: Any, columns: Sequence | None = None) -> FileSource:
        return cls(obj if isinstance(obj, ArrowShards) else ArrowShards(obj))


def _accepts(obj: Any) -> bool:
    return (isinstance(obj, ArrowShards) or is_path_like(obj)
            or (type_name(obj).startswith("pyarrow.") and hasattr(obj, "files")))


register_source(_accepts, FileSource.of)


class FileReader(SourceReader):
    """One loader's reading of files (its readers are opened per pass)."""

    def __init__(self, shards: ArrowShards, spec: ReadSpec) -> None:
        self.shards = shards
        self.spec = spec
        units = shards.units
        self._starts = [u.start for u in units]

    def static_pass(self, epoch: int, position: int, pieces: list[Piece]) -> StaticFiles:
        return StaticFiles(self, epoch, position, pieces)

    def unit_reads(self, epoch: int, drop: Callable[[list[Interval]], None]) -> FileUnits:
        return FileUnits(self, epoch)


class StaticFiles:
    """A static policy's pieces, in plan order, from stream ``position`` (one pass)."""

    def __init__(self, reader: FileReader, epoch: int, position: int,
                 pieces: list[Piece]) -> None:
        self.reader = reader
        self.epoch = epoch
        self.start = position
        self.pieces = pieces

    def _block(self, blocks: list[batching.Block], bi: int, skip: int,
               units: UnitReader) -> Any:
        """Block ``bi`` read, gathered (strided pieces, shuffle) and converted, from its
        row ``skip`` on."""
        spec = self.reader.spec
        blk = blocks[bi]
        all_units = self.reader.shards.units
        tables = [units.read(all_units[self.pieces[k].unit], spec.columns)
                  for k in blk.pieces]
        idx, strided, base = [], False, 0
        for k in blk.pieces:
            p = self.pieces[k]
            if p.stride != 1:
                strided = True
            idx.append(np.arange(p.first_local(), p.num_rows, p.stride) + base)
            base += p.num_rows
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        index = np.concatenate(idx) if strided else None
        if blk.shuffled:
            perm = batching.block_permutation(blk.rows, spec.seed, self.epoch, bi)
            index = perm if index is None else index[perm]
        if skip:
            if index is None:
                table = table.slice(skip)
            else:
                index = index[skip:]
        return convert(spec, table, index)

    def chunks(self) -> Iterator[ChunkItem]:
        """The epoch's blocks from the start position, in plan order (non-empty only)."""
        for cols in self._blocks():
            item = item_of(cols, None)
            if item.rows:
                yield item

    def _blocks(self) -> Iterator[Any]:
        spec = self.reader.spec
        blocks = batching.plan_blocks([p.rows for p in self.pieces], spec.shuffle,
                                      spec.seed, self.epoch, spec.shuffle_buffer)
        b, off = batching.locate(blocks, self.start)
        shards = self.reader.shards
        if not spec.shuffle:  # reading is the work, and pyarrow spreads it over threads
            reader = shards.reader()
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
                reader = local.reader = shards.reader()
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

    def interrupt(self) -> None:
        """Reads end by themselves."""

    def state(self) -> dict:
        return {"epoch": self.epoch, "start": self.start}


def _failure(unit: Unit, e: BaseException, rows: list[Interval] | None) -> UnitFailure:
    """A unit's read or conversion failed: a data error names the file and row group
    (the column is in the converter's message); anything else is raised as it is."""
    err = e
    if isinstance(e, (ValueError, OSError, pa.ArrowException)):
        text = str(e)
        if not text.startswith(unit.path):
            text = f"{unit.path} (row group {unit.piece}): {text}"
        err = ValueError(text)
    return UnitFailure(unit.path, e, err, rows)


# (unit, its leased rows as intervals) in row order: what one lease reads
Part = tuple[Unit, list[Interval]]


class FileUnits:
    """How leases of files are read: blocks of units, only their leased rows."""

    ahead = 0  # a lease's blocks are read before the next lease (asked ahead) is taken

    def __init__(self, reader: FileReader, epoch: int) -> None:
        self.reader = reader
        self.spec = reader.spec
        self.epoch = epoch
        # a lease covers at least ``lease_rows`` rows (whole units); near the end of
        # the epoch leases shrink toward a batch (the tail rule), so ranks end together
        self.lease_size = (self.spec.lease_rows, self.spec.batch_size)
        self._units = reader.shards.reader()

    def _parts(self, ranges: list[Interval]) -> list[Part]:
        """The units a lease's rows fall in, with the rows of each."""
        units, starts = self.reader.shards.units, self.reader._starts
        out: list[Part] = []
        for a, b in ranges:
            u = bisect_right(starts, a) - 1
            while a < b:
                unit = units[u]
                stop = min(b, unit.start + unit.num_rows)
                if stop > a:
                    if out and out[-1][0] is unit:
                        out[-1][1].append((a, stop))
                    else:
                        out.append((unit, [(a, stop)]))
                    a = stop
                u += 1
        return out

    def plan(self, ranges: list[Interval]) -> list[Pending]:
        """A lease's units in read order: one unit per block, or, shuffled, the units in
        a seeded order grouped into blocks of at least ``shuffle_buffer`` rows."""
        parts = self._parts(ranges)
        spec = self.spec
        if not spec.shuffle:
            return [Pending(rows, [(unit, rows)]) for unit, rows in parts]
        order = batching.block_permutation(len(parts), spec.seed, self.epoch, ranges[0][0])
        groups: list[list[Part]] = []
        rows = spec.shuffle_buffer
        for i in order.tolist():
            if rows >= spec.shuffle_buffer:
                groups.append([])
                rows = 0
            groups[-1].append(parts[i])
            rows += sum(b - a for a, b in parts[i][1])
        return [Pending([iv for _, r in g for iv in r], g) for g in groups]

    def read(self, pending: Pending) -> ChunkItem:
        """One block: its units read (only their leased rows), gathered and converted."""
        spec = self.spec
        group: list[Part] = pending.handle
        tables, ids = [], []
        for unit, rows in group:
            try:
                table = self._units.read(unit, spec.columns)
            except Exception as e:  # noqa: BLE001 - given back, then raised
                raise _failure(unit, e, rows) from e
            if len(rows) == 1:  # one run of rows: a zero-copy slice
                a, b = rows[0]
                if b - a != unit.num_rows:
                    table = table.slice(a - unit.start, b - a)
            else:
                table = table.take(pa.array(batching.ids_of_ranges(rows) - unit.start))
            tables.append(table)
            ids.append(batching.ids_of_ranges(rows))
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        all_ids = ids[0] if len(ids) == 1 else np.concatenate(ids)
        index = None
        if spec.shuffle:
            tile = batching.dynamic_tile(spec.batch_size)
            index = batching.dynamic_order(len(all_ids), spec.seed, self.epoch,
                                           int(all_ids[0]), tile)
            all_ids = all_ids[index]
        try:
            return item_of(convert(spec, table, index), all_ids, ascending=not spec.shuffle)
        except Exception as e:  # noqa: BLE001 - find the unit whose rows fail
            unit, rows = self._culprit(tables, group)
            raise _failure(unit, e, rows) from e

    def _culprit(self, tables: list[pa.Table], group: list[Part]) -> Part:
        """The first unit of a block whose own rows fail to convert (error path only)."""
        for table, part in zip(tables, group, strict=True):
            try:
                convert(self.spec, table, None)
            except Exception:  # noqa: BLE001 - this one
                return part
        return group[0]

    def cancel(self, pending: Pending) -> None:
        """Nothing started."""

    def check(self) -> None:
        """Nothing reported."""

    def finish(self) -> None:
        """Nothing reported."""

    def close(self) -> None:
        self._units.close()

    def interrupt(self) -> None:
        """Reads end by themselves."""
