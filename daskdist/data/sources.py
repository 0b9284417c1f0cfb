"""Where a loader's converted blocks come from: a static plan, or leases (``"dynamic"``).

Both sources implement one small interface (:class:`ChunkSource`):

- ``chunks()``: a generator of :class:`ChunkItem` (converted rows of one block, their
  global row ids under ``"dynamic"``); run by the prefetch thread, which owns it;
- ``delivered(ranges)``: rows the iterator handed to a caller (called under the
  iterator's lock, in the caller's thread: under ``"dynamic"`` it records the batch's
  :class:`~daskdist.core.protocol.LeaseToken` for the caller's closure);
- ``close()``: give back what was taken and never delivered (after the prefetch thread
  was joined, under the iterator's lock);
- ``state()``: what the source holds now (for ``state_dict`` and debugging).

:class:`StaticSource` reads the pipeline's pieces in the epoch plan's order from a
position (:mod:`.batching`); its ``chunks()`` runs once. :class:`DynamicSource` leases
rows from ``ctx.services`` until none are free *right now*; ``chunks()`` may run again
later (after the previous generator ended) to pick up rows that came back to the pool.

The path of a dynamic row, end to end: ``DynamicSource.chunks`` asks
``ctx.services.acquire`` (:class:`~daskdist.plugins.worker.services.SessionServices`, an
RPC to ``CoordinatorState.lease_acquire`` on the scheduler, which asks its
:class:`~daskdist.core.leases.LeaseTable`); ``DynamicSource.delivered`` records the
batch's ``LeaseToken`` for the closure that took it
(:func:`daskdist.context.record_consumed`); the worker's runner sends the tokens in the
closure's ``Outcome``, and ``CoordinatorState.apply_results`` acknowledges them in the
table if the closure completed, or releases them if it failed.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from daskdist.context import ClosureEndedError, record_consumed
from daskdist.core.intervals import Interval, RowSet
from daskdist.core.protocol import LeaseToken
from daskdist.data import batching
from daskdist.data.convert import convert_chunk, num_rows
from daskdist.data.shards import Unit, UnitReader
from daskdist.errors import InputError

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
    ascending: bool = False  # ``ids`` ascend (unshuffled): a batch's runs without a sort


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


def _item(cols: Any, ids: np.ndarray | None, ascending: bool = False) -> ChunkItem:
    return ChunkItem(cols, ids, num_rows(cols), ascending=ascending)


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


class UnitFailure(Exception):
    """Reading or converting one unit failed (internal: the source gives its rows back,
    then raises the error it names)."""

    def __init__(self, unit: Unit, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.unit = unit
        self.exc = exc

    def __reduce__(self) -> tuple:
        return (type(self), (self.unit, self.exc))

    def error(self) -> BaseException:
        """The error to raise: a data error names the file and row group (the column is
        in the converter's message); anything else is raised as it is."""
        e, unit = self.exc, self.unit
        if not isinstance(e, (ValueError, OSError, pa.ArrowException)):
            return e
        text = str(e)
        if not text.startswith(unit.path):
            text = f"{unit.path} (row group {unit.piece}): {text}"
        return ValueError(text)


# (unit, its leased rows as intervals) in row order: what one lease reads
Piece = tuple[Unit, list[Interval]]


def pieces_of(units: list[Unit], starts: list[int], ranges: list[Interval]) -> list[Piece]:
    """The units a lease's rows fall in, with the rows of each (``starts``: the units'
    first rows, for bisection)."""
    out: list[Piece] = []
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


class _Ask:
    """A lease asked for: at once when the service can ask ahead (``acquire_async``,
    a future), else when :meth:`result` is called."""

    def __init__(self, svc: Any, dataset_id: str, epoch: int, rows: int, least: int) -> None:
        self._svc = svc
        self._args = (dataset_id, epoch, rows)
        self._least = least
        ahead = getattr(svc, "acquire_async", None)
        self._future = ahead(*self._args, least=least) if ahead is not None else None

    def result(self) -> list[Interval] | None:
        """The lease (waits for the reply; ends when the RPC does)."""
        if self._future is None:
            return self._svc.acquire(*self._args, least=self._least)
        return self._future.result()

    def collect(self) -> list[Interval] | None:
        """The rows of a lease asked ahead and not used (``None``: never asked, or it
        failed): the caller gives them back."""
        if self._future is None:
            return None
        try:
            return self._future.result()
        except Exception:  # noqa: BLE001 - no lease came: nothing to give back
            return None


class DynamicSource:
    """Rows leased from ``ctx.services``, read unit by unit (under ``shuffle``, in blocks
    of at least ``shuffle_buffer`` rows, tile-permuted).

    Keeps, per lease, the rows not yet delivered (its own lock: the prefetch thread
    adds and gives back, callers' threads remove), so :meth:`close` can give them back.
    A unit that cannot be read gives back at once the rows of the lease not yet handed
    on: its own deferred with the failure counted (the scheduler fails the epoch after
    ``max_worker_failures``), the rest as free. Then the error is raised once, to the
    closure that reaches it, naming the file (and the column, for a null).
    """

    def __init__(self, loader: ArrowLoader, epoch: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self._lock = threading.Lock()
        self._leases: list[RowSet] = []  # leased rows not yet delivered, per lease

    def chunks(self) -> Iterator[ChunkItem]:
        """Lease, read and convert rows until none are free right now."""
        ld = self.loader
        svc = ld.ctx.services
        ld._define()
        reader = ld.shards.reader()
        ask: _Ask | None = _Ask(svc, ld.dataset_id, self.epoch, ld.lease_rows,
                                2 * ld.batch_size)
        try:
            while True:
                ranges = ask.result()  # type: ignore[union-attr]
                ask = None
                if not ranges:
                    return
                ranges = [(int(a), int(b)) for a, b in ranges]
                held = RowSet(ranges)
                with self._lock:
                    self._leases.append(held)
                groups = self._groups(pieces_of(ld.shards.units, ld._starts, ranges), ranges)
                # the next lease is asked for now and read after this one: its round
                # trip overlaps this lease's reads (a service that cannot ask ahead is
                # asked when the next lease is needed)
                ask = _Ask(svc, ld.dataset_id, self.epoch, ld.lease_rows, 2 * ld.batch_size)
                for k, group in enumerate(groups):
                    try:
                        item = self._read(reader, group)
                    except UnitFailure as f:
                        err = f.error()
                        self._give_back(held, f.unit, groups[k:], str(err))
                        failed = svc.progress(ld.dataset_id, self.epoch).get("failed")
                        if failed:  # that was the file's last allowed failure
                            raise InputError(failed, err) from f.exc
                        raise err from f.exc
                    if item.rows:
                        yield item
        finally:
            reader.close()
            rest = ask.collect() if ask is not None else None
            if rest:  # asked ahead, never read (closed, or a read failed): given back
                svc.release(ld.dataset_id, self.epoch, rest)

    def _groups(self, pieces: list[Piece], ranges: list[Interval]) -> list[list[Piece]]:
        """A lease's pieces in read order: one unit per block, or, shuffled, the units
        in a seeded order grouped into blocks of at least ``shuffle_buffer`` rows."""
        ld = self.loader
        if not ld.shuffle:
            return [[p] for p in pieces]
        key = ranges[0][0]
        order = batching.block_permutation(len(pieces), ld.seed, self.epoch, key)
        groups: list[list[Piece]] = []
        rows = ld.shuffle_buffer
        for i in order.tolist():
            if rows >= ld.shuffle_buffer:
                groups.append([])
                rows = 0
            groups[-1].append(pieces[i])
            rows += sum(b - a for a, b in pieces[i][1])
        return groups

    def _read(self, reader: UnitReader, group: list[Piece]) -> ChunkItem:
        """One block: its units read (only their leased rows), gathered and converted."""
        ld = self.loader
        tables, ids = [], []
        for unit, rows in group:
            try:
                table = reader.read(unit, ld.columns)
            except Exception as e:  # noqa: BLE001 - given back, then raised (UnitFailure)
                raise UnitFailure(unit, e) from e
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
        if ld.shuffle:
            tile = batching.dynamic_tile(ld.batch_size)
            index = batching.dynamic_order(len(all_ids), ld.seed, self.epoch,
                                           int(all_ids[0]), tile)
            all_ids = all_ids[index]
        try:
            return _item(_convert(ld, table, index), all_ids, ascending=not ld.shuffle)
        except Exception as e:  # noqa: BLE001 - find the unit whose rows fail
            raise UnitFailure(self._culprit(tables, group), e) from e

    def _culprit(self, tables: list[pa.Table], group: list[Piece]) -> Unit:
        """The first unit of a block whose own rows fail to convert (error path only)."""
        for table, (unit, _) in zip(tables, group, strict=True):
            try:
                _convert(self.loader, table, None)
            except Exception:  # noqa: BLE001 - this one
                return unit
        return group[0][0]

    def _give_back(self, held: RowSet, failed: Unit, groups: list[list[Piece]],
                   message: str) -> None:
        """A unit could not be read: the lease's rows not handed on go back at once,
        the failed unit's with the failure (deferred, counted), the rest as free."""
        bad: list[Interval] = []
        rest: list[Interval] = []
        for group in groups:
            for unit, rows in group:
                (bad if unit is failed else rest).extend(rows)
        with self._lock:
            for a, b in bad + rest:
                held.remove(a, b)
            if not held and held in self._leases:
                self._leases.remove(held)
        ld = self.loader
        svc = ld.ctx.services
        if rest:
            svc.release(ld.dataset_id, self.epoch, rest)
        if bad:
            svc.release(ld.dataset_id, self.epoch, bad, failure=(failed.path, message))

    def delivered(self, ranges: list[Interval]) -> None:
        """Rows handed to the caller: no longer ours to give back; they count for the
        caller's closure (acknowledged if it completes, released if it fails)."""
        rows = ranges
        with self._lock:
            if len(ranges) == 1 and self._leases and self._leases[0].remove(*ranges[0]):
                if not self._leases[0]:  # the usual case: one run of the oldest lease
                    del self._leases[0]
                ranges = []
            emptied = False
            for a, b in ranges:
                left = b - a
                for held in self._leases:
                    for lo, hi in held.intersect(a, b):
                        held.remove(lo, hi)
                        left -= hi - lo
                    emptied |= not held
                    if not left:
                        break
            if emptied:
                self._leases = [held for held in self._leases if held]
        try:
            token = LeaseToken.of(self.loader.dataset_id, self.epoch, rows)
            if record_consumed(token) or self.loader.ctx.worker is None:
                return  # outside a coordinator the caller acknowledges (LocalLeaseService)
            problem = "which runs no daskdist closure"
        except ClosureEndedError:
            problem = "after the closure it was started in ended"
        # no closure will acknowledge these rows: back to the pool now, never stranded
        self.loader.ctx.services.release(self.loader.dataset_id, self.epoch, rows)
        label = self.loader.name or self.loader.dataset_id
        raise RuntimeError(
            f"thread {threading.current_thread().name!r} took a batch of dataset "
            f"{label!r} {problem}: no closure could acknowledge its rows, so "
            f"they went back to the pool. Take batches in the closure's own thread, or "
            f"start the thread in the closure's context (threading.Thread(target="
            f"contextvars.copy_context().run, args=(fn,))) and join it before the "
            f"closure returns: its rows then count for the closure")

    def close(self) -> None:
        """Give back leased rows no caller received (when the service supports it)."""
        with self._lock:
            rest = [iv for held in self._leases for iv in held]
            self._leases = []
        if rest:
            release = getattr(self.loader.ctx.services, "release", None)
            if release is not None:
                release(self.loader.dataset_id, self.epoch, rest)

    def state(self) -> dict:
        with self._lock:
            return {"epoch": self.epoch,
                    "outstanding": [iv for held in self._leases for iv in held]}
