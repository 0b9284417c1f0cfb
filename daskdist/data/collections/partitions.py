"""A Dask collection's partitions read as rows: :class:`PartitionReader`, its reader for one
loader (:meth:`~.source.DaskCollection.open`).

- :meth:`PartitionReader.static_pass`: a static policy's partitions (:mod:`.sharding`),
  each computed (``ahead`` of the one read), its share of rows converted, from a stream
  position;
- :meth:`PartitionReader.unit_reads`: a lease is one partition (leased whole): it is
  submitted to Dask when leased, its length reported to the lease table when computed
  (ids past it leave the epoch), its leased rows converted, and Dask may forget it once
  converted. A partition whose graph raises, or whose rows fail to convert (a null
  without ``fill_null``), is a :class:`~.sources.UnitFailure` naming the partition (and
  the column).

Threads: the loader's prefetch thread owns a pass and the partitions it computes
(submits, waits, releases); :meth:`interrupt` comes from any thread. The reader's
computer (a local thread pool outside a coordinator) is closed with the loader.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch

from daskdist.core.intervals import Interval
from daskdist.core.leases.partitions import STRIDE
from daskdist.data import batching
from daskdist.data.collections.compute import Computed, Interrupt, Interrupted, make_computer
from daskdist.data.convert import Chunk, arrow_column, convert_chunk
from daskdist.data.sharding import Piece
from daskdist.data.sources import ChunkItem, Pending, ReadSpec, SourceReader, UnitFailure
from daskdist.errors import InputError
from daskdist.observe import phases

__all__ = ["PartitionReader", "convert_part", "part_rows"]


# -- a partition as converted rows ------------------------------------------------------
def part_rows(data: Any) -> int:
    """Rows of a computed partition (a pandas DataFrame or a dict of arrays)."""
    if isinstance(data, dict):
        return len(next(iter(data.values()))) if data else 0
    return len(data)


def _as_tensor(x: np.ndarray, copy: bool) -> Any:
    if x.dtype.kind in "biufc":
        x = np.ascontiguousarray(x)
        if copy or not x.flags.writeable:
            x = x.copy()
        return torch.from_numpy(x)
    if x.dtype.kind == "M" or x.dtype.kind == "m":
        return torch.from_numpy(x.astype(np.int64))
    return x.tolist()


def _frame_table(frame: Any, columns: Sequence[Any]) -> pa.Table:
    """``columns`` (the frame's labels) of a pandas DataFrame as an Arrow table named by
    the labels as strings, as ``Table.from_pandas`` makes it (NaN is null), numeric NumPy
    columns without its per-frame work (pandas metadata, type inference: 7x slower than
    reading the same rows from Parquet)."""
    names = [str(c) for c in columns]
    if len(set(frame.columns)) != len(frame.columns):  # duplicates: pyarrow names them
        return pa.Table.from_pandas(frame, preserve_index=False).select(names)
    arrays = []
    for c in columns:
        col = frame[c]
        dtype = col.dtype
        if isinstance(dtype, np.dtype) and dtype.kind in "biuf":
            arrays.append(pa.array(col.to_numpy(), from_pandas=True))
        else:  # strings, objects, categoricals, extension and datetime dtypes
            arrays.append(pa.Array.from_pandas(col))
    return pa.Table.from_arrays(arrays, names=names)


@phases.partitions(phases.READING)  # a gang's data waits on reading partitions (SPEC §5.1)
class Partitioned(Protocol):
    """What a reader reads of its collection (a :class:`~.source.DaskCollection`, which
    makes the reader: this module does not import it back)."""

    kind: str  # "dataframe" or "arrays"
    what: str  # how errors name it
    columns: list | None
    lengths: list[int] | None  # rows per partition, when known
    direct: list | None  # per partition: computed on the client already


def convert_part(coll: Partitioned, data: Any, rows: np.ndarray | None,
                 fill_null: Any, collate: bool, shared: bool,
                 columns: Sequence[Any] | None = None) -> Any:
    """Rows ``rows`` (positions, in order; ``None``: all) of a computed partition: a
    :class:`Chunk` keyed by the collection's labels (tensors, N-D arrays kept N-D, other
    columns as lists), or an Arrow table (string names) for ``collate``. ``shared``: the
    data is Dask's own object (read from the worker's memory), so tensors get buffers of
    their own. ``columns``: a subset of the collection's (default: all)."""
    columns = list(columns) if columns is not None else coll.columns
    if coll.kind == "dataframe":
        table = _frame_table(data, columns)
        if collate:
            return table if rows is None else table.take(pa.array(rows))
        labels = {str(c): c for c in columns if not isinstance(c, str)}
        if labels and isinstance(fill_null, dict):  # named by label, read by string
            fill_null = {str(k): v for k, v in fill_null.items()}
        chunk = convert_chunk(table, fill_null, rows)
        if labels:
            chunk = chunk.relabel(labels)
        return chunk.map_tensors(torch.clone) if shared and rows is None else chunk
    arrays = {k: np.asarray(data[k]) for k in columns}
    if rows is not None:
        arrays = {k: np.take(v, rows, axis=0) for k, v in arrays.items()}
        shared = False  # the gather copied
    if collate:
        return pa.table({k: arrow_column(v) for k, v in arrays.items()})
    return Chunk(columns, {k: _as_tensor(v, shared) for k, v in arrays.items()})


def partition_error(coll: Partitioned, unit: int, exc: BaseException,
                    computed: bool) -> BaseException:
    """The error a closure gets for partition ``unit``: its graph raised (an
    ``InputError`` carrying the user's error), or its rows failed to convert (a
    ``ValueError`` naming the partition and the column)."""
    if computed:
        return ValueError(f"partition {unit} of the {coll.what}: {exc}")
    err = InputError(f"partition {unit} of the {coll.what} could not be computed: "
                     f"{type(exc).__name__}: {exc}", exc)
    err.__cause__ = exc
    return err


class PartitionReader(SourceReader):
    """One loader's reading of a collection: its computer (built at the first pass)."""

    def __init__(self, coll: Partitioned, spec: ReadSpec) -> None:
        self.coll = coll
        self.spec = spec
        self._computer: Any = None
        self._starts: list[int] | None = None
        if coll.lengths is not None:  # known lengths: dense ids
            self._starts = [0]
            for n in coll.lengths[:-1]:
                self._starts.append(self._starts[-1] + n)

    def computer(self) -> Any:
        """What computes partitions (built once, by the first pass's prefetch thread;
        a loader's passes run one at a time)."""
        if self._computer is None:
            self._computer = make_computer(self.spec.services, self.spec.ahead)
        return self._computer

    def first_id(self, unit: int) -> int:
        """Partition ``unit``'s first row id (``STRIDE`` ids each while lengths are
        unknown)."""
        return unit * STRIDE if self._starts is None else self._starts[unit]

    def unit_of(self, row: int) -> int:
        """The partition holding row id ``row``."""
        if self._starts is None:
            return row // STRIDE
        return bisect_right(self._starts, row) - 1

    def convert(self, data: Any, rows: np.ndarray | None, shared: bool) -> Any:
        s = self.spec
        return convert_part(self.coll, data, rows, s.fill_null, s.collate, shared, s.columns)

    def static_pass(self, epoch: int, position: int, pieces: list[Piece]) -> StaticPartitions:
        return StaticPartitions(self, epoch, position, pieces)

    def unit_reads(self, epoch: int, drop: Callable[[list[Interval]], None]) -> PartitionUnits:
        return PartitionUnits(self, epoch, drop)

    def close(self) -> None:
        computer, self._computer = self._computer, None
        if computer is not None:
            computer.close()


class StaticPartitions:
    """A static policy's partitions, computed ahead, from stream ``position`` (rows
    before it are skipped; lengths unknown ahead are learned by computing)."""

    def __init__(self, reader: PartitionReader, epoch: int, position: int,
                 pieces: list[Piece]) -> None:
        self.reader = reader
        self.epoch = epoch
        self.start = position
        spec = reader.spec
        order = list(range(len(pieces)))
        if spec.shuffle:
            order = [int(k) for k in batching.block_permutation(len(pieces), spec.seed,
                                                                 epoch, -1)]
        self.pieces = [pieces[k] for k in order]
        self._interrupt = Interrupt()

    def interrupt(self) -> None:
        self._interrupt.interrupt()

    def chunks(self) -> Iterator[ChunkItem]:
        reader = self.reader
        spec, coll = reader.spec, reader.coll
        computer = reader.computer()
        skip = self.start
        pending: deque[tuple[Piece, Computed]] = deque()
        nxt = 0
        try:
            while True:
                # the partition to read next and ``ahead`` behind it
                while nxt < len(self.pieces) and len(pending) <= spec.ahead:
                    piece = self.pieces[nxt]
                    pending.append((piece, computer.submit(coll, piece.unit)))
                    nxt += 1
                if not pending:
                    return
                piece, comp = pending.popleft()
                try:
                    data, shared = computer.result(comp, self._interrupt)
                except Interrupted:
                    return
                except Exception as e:  # noqa: BLE001 - the user's graph
                    raise partition_error(coll, piece.unit, e, False) from e
                finally:
                    computer.release(comp)
                n = part_rows(data)
                index = np.arange(piece.first_local(), n, piece.stride, dtype=np.int64)
                if spec.shuffle:
                    index = index[batching.block_permutation(len(index), spec.seed,
                                                             self.epoch, piece.unit)]
                if skip >= len(index):
                    skip -= len(index)
                    continue
                index = index[skip:]
                skip = 0
                whole = piece.stride == 1 and not spec.shuffle and len(index) == n
                cols = reader.convert(data, None if whole else index, shared)
                if len(index):
                    yield ChunkItem(cols, None, len(index))
        finally:
            for _, comp in pending:
                computer.release(comp)

    def delivered(self, ranges: list[Interval]) -> None:
        """Static rows are counted by position; nothing to track."""

    def close(self) -> None:
        """Nothing was taken from anyone."""

    def state(self) -> dict:
        return {"epoch": self.epoch, "start": self.start}


class PartitionUnits:
    """How leases of a collection are read: a lease is one partition, computed from the
    moment it is leased (``ahead`` of the one read), its length reported when computed
    without waiting (a differing one raises at the next :meth:`check`)."""

    def __init__(self, reader: PartitionReader, epoch: int,
                 drop: Callable[[list[Interval]], None]) -> None:
        self.reader = reader
        self.epoch = epoch
        self.ahead = reader.spec.ahead
        self.lease_size = (1, 1)  # one partition (leased whole)
        self._drop = drop
        self._computer = reader.computer()
        self._interrupt = Interrupt()
        self._reports: deque = deque()  # length reports on their way

    def plan(self, ranges: list[Interval]) -> list[Pending]:
        """A lease's rows split by partition, each submitted to Dask now."""
        reader = self.reader
        by_unit: list[tuple[int, list[Interval]]] = []
        lengths = reader.coll.lengths
        for a, b in ranges:
            while a < b:
                u = reader.unit_of(a)
                end = reader.first_id(u) + (STRIDE if lengths is None else lengths[u])
                stop = min(b, end)
                if by_unit and by_unit[-1][0] == u:
                    by_unit[-1][1].append((a, stop))
                else:
                    by_unit.append((u, [(a, stop)]))
                a = stop
        return [Pending(rows, self._computer.submit(reader.coll, u)) for u, rows in by_unit]

    def read(self, pending: Pending) -> ChunkItem | None:
        """The computed partition's leased rows, converted."""
        reader = self.reader
        comp: Computed = pending.handle
        unit = comp.unit
        spec = reader.spec
        try:
            data, shared = self._computer.result(comp, self._interrupt)
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001 - the user's graph: given back, raised
            raise UnitFailure(f"partition {unit}", e,
                              partition_error(reader.coll, unit, e, False)) from e
        try:
            n = part_rows(data)
            svc = spec.services
            self._reports.append(svc.report_length_async(spec.dataset_id, self.epoch, unit, n))
            first = reader.first_id(unit)
            end = first + n
            rows = pending.rows
            if reader.coll.lengths is None and rows and rows[-1][1] > end:
                # ids past its end do not exist: the table dropped them
                self._drop([(end, first + STRIDE)])
                rows = [(a, min(b, end)) for a, b in rows if a < end]
            if not rows:
                return None
            ids = batching.ids_of_ranges(rows)
            index = None if (len(rows) == 1 and rows[0] == (first, end)) else ids - first
            if spec.shuffle:
                order = batching.dynamic_order(len(ids), spec.seed, self.epoch, first,
                                               batching.dynamic_tile(spec.batch_size))
                ids = ids[order]
                index = order if index is None else index[order]
            try:
                cols = reader.convert(data, index, shared)
            except Exception as e:  # noqa: BLE001 - a bad row (a null): given back, raised
                raise UnitFailure(f"partition {unit}", e,
                                  partition_error(reader.coll, unit, e, True)) from e
            return ChunkItem(cols, ids, len(ids), ascending=not spec.shuffle)
        finally:  # converted (or failed): Dask may forget the partition
            self._computer.release(comp)
            del data

    def cancel(self, pending: Pending) -> None:
        self._computer.release(pending.handle)

    def check(self) -> None:
        while self._reports and self._reports[0].done():
            self._reports.popleft().result()  # InputError: a length differed

    def finish(self) -> None:
        while self._reports:  # the last lengths reached the table
            self._reports.popleft().result()

    def close(self) -> None:
        """Nothing held beyond the planned reads (each cancelled)."""

    def interrupt(self) -> None:
        self._interrupt.interrupt()
