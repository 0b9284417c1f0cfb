"""Dask collections as a loader's source (SPEC §3.2): a dask DataFrame, or a dict of
dask Arrays chunked alike along axis 0, streamed partition by partition.

- :class:`DaskCollection` is built on the client (:func:`as_source`): one ``Delayed``
  per partition (a DataFrame's ``to_delayed()``; for Arrays, each array's blocks of
  one row chunk as a dict), the lengths when they are known (Arrays' chunks), the keys
  of partitions the user persisted (locality) and a deterministic token of the
  collection (its fingerprint). It is pickled to the workers with the loader factory.
- :class:`PartitionSource` (``"dynamic"``) leases one partition at a time, computes
  up to ``partitions_ahead`` of them ahead of the consumer on Dask (the worker's own
  client: the collection's own graph on Dask's scheduler), reports each one's length
  to the lease table when it is computed (rows past it leave the epoch), reads only
  its leased rows, and lets Dask forget it as soon as it is converted.
- :class:`StaticPartitionSource` (``"file"``, ``"auto"``, ``"data"``, ``"off"``):
  partitions assigned to input pipelines like files.

Nothing here imports pandas or dask.dataframe until a collection is given, so
``import daskdist`` stays cheap. Threads: the loader's prefetch thread owns a
source's generator and its computer (submits, waits, releases); the lock of
:class:`PartitionSource` guards the rows leased and not yet delivered (the prefetch
thread adds and trims, callers' threads remove, ``close`` gives back).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from daskdist.context import record_consumed
from daskdist.core.intervals import Interval, RowSet
from daskdist.core.leases import unit_runs
from daskdist.core.partitions import STRIDE
from daskdist.core.protocol import CollectionDef, LeaseToken
from daskdist.data import batching
from daskdist.data.convert import Chunk, convert_chunk
from daskdist.data.sources import ChunkItem
from daskdist.errors import InputError
from daskdist.observe import phases

if TYPE_CHECKING:
    from daskdist.data.loader import ArrowLoader

__all__ = ["DaskCollection", "PartitionSource", "StaticPartitionSource", "as_source",
           "is_collection"]


# -- what a collection is ---------------------------------------------------------------
def _is_dask_dataframe(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("dask.dataframe") and hasattr(obj, "to_delayed") \
        and hasattr(obj, "npartitions")


def _is_dask_array(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("dask.array") and hasattr(obj, "chunks")


def is_collection(obj: Any) -> bool:
    """A dask DataFrame (or Series), or a non-empty dict of dask Arrays."""
    if isinstance(obj, DaskCollection) or _is_dask_dataframe(obj):
        return True
    return (isinstance(obj, dict) and bool(obj)
            and all(_is_dask_array(v) for v in obj.values()))


def _what(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def as_source(source: Any, columns: Sequence[str] | None = None) -> Any:
    """A loader's source: ``ArrowShards`` for files (a path, glob, list of paths or a
    ``pyarrow.dataset``), a :class:`DaskCollection` for a dask DataFrame or a dict of
    dask Arrays. Anything else: ``TypeError`` naming what was given."""
    from daskdist.data.shards import ArrowShards

    if isinstance(source, (ArrowShards, DaskCollection)):
        return source
    if _is_dask_dataframe(source):
        return DaskCollection.of(source, columns)
    if isinstance(source, dict):
        bad = {k: _what(v) for k, v in source.items() if not _is_dask_array(v)}
        if bad or not source:
            raise TypeError(
                "a dict source must map names to dask Arrays chunked alike along axis 0; "
                + (f"got {bad}" if bad else "got an empty dict"))
        return DaskCollection.of(source, columns)
    if isinstance(source, (str, os.PathLike)) or (
            isinstance(source, (list, tuple)) and source
            and all(isinstance(s, (str, os.PathLike)) for s in source)):
        return ArrowShards(source)
    if _what(source).startswith("pyarrow.") and hasattr(source, "files"):
        return ArrowShards(source)
    raise TypeError(
        f"a dataset source must be Parquet/Arrow files (a path, a glob, a list of paths, "
        f"a pyarrow.dataset or ArrowShards), a dask DataFrame, or a dict of dask Arrays; "
        f"got {_what(source)}"
        + (" (make it one with dask.dataframe.from_pandas or dask.array.from_array)"
           if _what(source).startswith(("pandas.", "numpy.")) else ""))


def _token(*objs: Any) -> str:
    """A deterministic token of the collection when Dask can make one (else a random
    one: a state_dict then matches only this collection object)."""
    from dask.base import tokenize

    try:
        return tokenize(*objs, ensure_deterministic=True)
    except Exception:  # noqa: BLE001 - dask.tokenize.TokenizationError (a local function)
        return tokenize(*objs, ensure_deterministic=False)


def _stack(names: tuple, *blocks: Any) -> dict:
    """One row chunk of a dict of Arrays: its blocks by name (a partition's value)."""
    return dict(zip(names, blocks, strict=True))


def _deps(graph: Any, key: Any, value: Any) -> list:
    """The keys ``graph[key]`` (``value``) depends on: a task spec's, or a legacy
    task's or alias's (a key as a value)."""
    deps = getattr(value, "dependencies", None)
    if deps is not None:
        return list(deps)
    from dask.core import get_dependencies

    try:
        return list(get_dependencies(graph, key))
    except Exception:  # noqa: BLE001 - not a task: no dependencies
        return []


def _is_alias(graph: Any, value: Any) -> bool:
    """Whether a graph value only names another key (a task spec ``Alias``, or a
    legacy key as a value): the partition *is* that key's data."""
    if type(value).__name__ == "Alias":
        return True
    try:
        return isinstance(value, (str, tuple)) and value in graph
    except TypeError:
        return False


def _persisted_keys(parts: list) -> tuple[list | None, list[bool] | None]:
    """Per partition, the key of a future its graph reads (data the user persisted or
    scattered: ``None`` when there is none), where the partition can be read with no
    transfer; and whether the partition is that future's data as it is (only aliases
    between: read it from the worker's memory, no task at all). One walk of each
    partition's own dependencies, on the client."""
    try:
        from distributed import Future
    except ImportError:  # pragma: no cover - distributed is a dependency
        return None, None
    keys: list = []
    direct: list[bool] = []
    for part in parts:
        graph = part.__dask_graph__()
        stack, seen, found, chain = [part.key], set(), None, True
        while stack and found is None:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            v = graph.get(k)
            if isinstance(v, Future):
                found = v.key
            elif v is not None:
                chain = chain and _is_alias(graph, v)
                stack.extend(_deps(graph, k, v))
        keys.append(found)
        direct.append(found is not None and chain)
    if all(k is None for k in keys):
        return None, None
    return keys, direct


class DaskCollection:
    """A dask DataFrame or dict of dask Arrays, as partitions a loader computes.

    ``parts[p]`` is a ``Delayed`` of partition ``p`` (a pandas DataFrame, or a dict of
    numpy arrays); ``lengths`` the partitions' rows when known (Arrays), else ``None``;
    ``holders[p]`` the key of a persisted partition (or ``None``); ``token`` a
    deterministic token of the collection (:meth:`fingerprint`).
    """

    def __init__(self, kind: str, columns: list[str], parts: list, lengths: list[int] | None,
                 token: str, holders: list | None, what: str,
                 direct: list[bool] | None = None) -> None:
        self.kind = kind
        self.columns = columns
        self.parts = parts
        self.lengths = lengths
        self.token = token
        self.holders = holders
        # per partition: it is its holder key's data as it is (read in place, no task)
        self.direct = direct
        self.what = what

    @classmethod
    def of(cls, obj: Any, columns: Sequence[str] | None = None) -> DaskCollection:
        """Build one from a dask DataFrame (or Series) or a dict of dask Arrays;
        ``columns`` selects columns (a DataFrame's projection is pushed into its graph)."""
        if isinstance(obj, DaskCollection):
            return obj
        if _is_dask_dataframe(obj):
            if not hasattr(obj, "columns"):  # a Series
                obj = obj.to_frame()
            names = [str(c) for c in obj.columns]
            if columns is not None:
                missing = [c for c in columns if c not in names]
                if missing:
                    raise ValueError(f"column(s) {missing} not in the dask DataFrame's "
                                     f"columns {names}")
                obj = obj[list(columns)]
                names = list(columns)
            parts = list(obj.to_delayed())
            n = len(parts)
            holders, direct = _persisted_keys(parts)
            return cls("dataframe", names, parts, None, _token(obj), holders,
                       f"dask DataFrame ({n} partitions)", direct)
        if not is_collection(obj):
            as_source(obj)  # raises the TypeError naming what was given
        import dask

        arrays = dict(obj)
        if columns is not None:
            missing = [c for c in columns if c not in arrays]
            if missing:
                raise ValueError(f"array(s) {missing} not in the dict's {list(arrays)}")
            arrays = {c: arrays[c] for c in columns}
        first, x0 = next(iter(arrays.items()))
        for name, x in arrays.items():
            if x.ndim < 1:
                raise ValueError(f"array {name!r} is 0-dimensional; rows are along axis 0")
            if x.chunks[0] != x0.chunks[0]:
                raise ValueError(f"arrays {first!r} and {name!r} are chunked differently "
                                 f"along axis 0 ({x0.chunks[0][:4]}... vs "
                                 f"{x.chunks[0][:4]}...); rechunk them alike")
            if any(np.isnan(c) for c in x.chunks[0]):
                raise ValueError(f"array {name!r} has unknown chunk sizes; call "
                                 "compute_chunk_sizes() first")
        lengths = [int(c) for c in x0.chunks[0]]
        names = tuple(arrays)
        blocks = []
        for x in arrays.values():
            if x.ndim > 1 and any(len(c) > 1 for c in x.chunks[1:]):
                x = x.rechunk({i: -1 for i in range(1, x.ndim)})  # a row chunk is one block
            blocks.append(x.to_delayed().reshape(len(lengths)))
        stack = dask.delayed(_stack, pure=True)
        parts = [stack(names, *(b[p] for b in blocks)) for p in range(len(lengths))]
        holders, _ = _persisted_keys(parts)  # a row chunk is a dict of blocks: a task
        return cls("arrays", list(names), parts, lengths, _token(*arrays.items()), holders,
                   f"dict of {len(names)} dask Arrays ({len(lengths)} row chunks)")

    @property
    def num_partitions(self) -> int:
        return len(self.parts)

    def fingerprint(self) -> str:
        """What a ``state_dict`` is checked against: the collection's token."""
        return f"dask:{self.token}"

    def definition(self, dataset_id: str, label: str, seed: int,
                   shuffle: bool) -> CollectionDef:
        """How the lease table defines this collection's units."""
        runs = unit_runs(self.lengths) if self.lengths is not None else None
        return CollectionDef(dataset_id, label, self.num_partitions, runs, int(seed),
                             bool(shuffle), self.holders)

    def __repr__(self) -> str:
        return f"DaskCollection({self.what}, columns={self.columns})"


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


def _arrow_column(x: np.ndarray) -> pa.Array:
    """An array's rows as an Arrow column (N-D rows as nested fixed-size lists)."""
    if x.ndim == 1:
        return pa.array(x)
    flat = pa.array(np.ascontiguousarray(x).reshape(-1))
    for size in reversed(x.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat


def _frame_table(frame: Any, columns: Sequence[str]) -> pa.Table:
    """``columns`` of a pandas DataFrame as an Arrow table, as ``Table.from_pandas``
    makes it (NaN is null), numeric NumPy columns without its per-frame work (pandas
    metadata, type inference: 7x slower than reading the same rows from Parquet)."""
    if len(set(frame.columns)) != len(frame.columns):  # duplicates: pyarrow names them
        return pa.Table.from_pandas(frame, preserve_index=False).select(list(columns))
    arrays = []
    for c in columns:
        col = frame[c]
        dtype = col.dtype
        if isinstance(dtype, np.dtype) and dtype.kind in "biuf":
            arrays.append(pa.array(col.to_numpy(), from_pandas=True))
        else:  # strings, objects, categoricals, extension and datetime dtypes
            arrays.append(pa.Array.from_pandas(col))
    return pa.Table.from_arrays(arrays, names=list(columns))


@phases.partitions(phases.READING)  # ... or on reading partitions (SPEC §5.1)
def convert_part(coll: DaskCollection, data: Any, rows: np.ndarray | None,
                 fill_null: Any, collate: bool, shared: bool,
                 columns: Sequence[str] | None = None) -> Any:
    """Rows ``rows`` (positions, in order; ``None``: all) of a computed partition: a
    :class:`Chunk` (tensors, N-D arrays kept N-D, other columns as lists), or an Arrow
    table for ``collate``. ``shared``: the data is Dask's own object (read from the
    worker's memory), so tensors get buffers of their own. ``columns``: a subset of
    the collection's (default: all)."""
    columns = list(columns) if columns is not None else coll.columns
    if coll.kind == "dataframe":
        table = _frame_table(data, columns)
        if collate:
            return table if rows is None else table.take(pa.array(rows))
        chunk = convert_chunk(table, fill_null, rows)
        return chunk.map_tensors(torch.clone) if shared and rows is None else chunk
    arrays = {k: np.asarray(data[k]) for k in columns}
    if rows is not None:
        arrays = {k: np.take(v, rows, axis=0) for k, v in arrays.items()}
        shared = False  # the gather copied
    if collate:
        return pa.table({k: _arrow_column(v) for k, v in arrays.items()})
    return Chunk(columns, {k: _as_tensor(v, shared) for k, v in arrays.items()})


# -- computing partitions ---------------------------------------------------------------
class Interrupted(Exception):
    """A source's wait for a partition ended by :meth:`Interrupt.interrupt` (its
    iterator closed or was dropped): internal, the source stops."""


class Interrupt:
    """Ends a source's waits for Dask: each :meth:`wait` returns when its future is
    done, or raises :class:`Interrupted` once :meth:`interrupt` was called (from any
    thread, at once; also from ``__del__``: it only sets events). So closing a loader
    never waits for a partition still computing (a slow or stuck graph)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: set[threading.Event] = set()
        self.interrupted = False

    def interrupt(self) -> None:
        with self._lock:
            self.interrupted = True
            for ev in self._waits:
                ev.set()

    @phases.partitions(phases.COMPUTING)  # a gang's data waits on Dask (SPEC §5.1)
    def wait(self, future: Any) -> None:
        """Until ``future`` (a Dask or ``concurrent.futures`` future) is done."""
        ev = threading.Event()
        with self._lock:
            if self.interrupted:
                raise Interrupted
            self._waits.add(ev)
        try:
            future.add_done_callback(lambda _: ev.set())
            ev.wait()  # ends: the future is done (finished, erred, cancelled), or interrupt()
        finally:
            with self._lock:
                self._waits.discard(ev)
        if self.interrupted:
            raise Interrupted


class _Computed:
    """A partition asked of Dask: its future (or local future) until released, or its
    data read in place from this worker's memory (``future`` None)."""

    __slots__ = ("data", "future", "unit")

    def __init__(self, unit: int, future: Any, data: Any = None) -> None:
        self.unit = unit
        self.future = future
        self.data = data


class DaskComputer:
    """Computes partitions on the cluster through the worker's own Dask client.

    ``helpers()`` names the workers preprocessing should prefer (non-members, when the
    coordinator's members are restricted by ``resources=``): a loose restriction, so
    Dask may still run a task elsewhere. A partition computed on this worker is read
    from its memory (no transfer); one computed elsewhere is gathered. Releasing the
    future lets Dask forget the partition (a persisted one keeps the user's keys)."""

    def __init__(self, worker: Any, helpers: Any = None) -> None:
        self.worker = worker
        self.client = worker._get_client()
        self.helpers = helpers

    def submit(self, coll: DaskCollection, unit: int) -> _Computed:
        if coll.direct is not None and coll.direct[unit]:
            # a persisted partition as it is: read in place if this worker holds it
            from distributed.utils import sync

            found = sync(self.worker.loop, _local, self.worker, coll.holders[unit])
            if found is not _MISSING:
                return _Computed(unit, None, found)
        workers = self.helpers() if self.helpers is not None else None
        kw = {"workers": workers, "allow_other_workers": True} if workers else {}
        return _Computed(unit, self.client.compute(coll.parts[unit], **kw))

    def result(self, c: _Computed, interrupt: Interrupt) -> tuple[Any, bool]:
        """The partition's data (waits for Dask, or until ``interrupt``; the user's
        error if its graph raised), and whether it is the user's own object (persisted
        data read in place: its tensors get buffers of their own). A partition this
        loader computed is its own, read in place when computed here, and forgotten
        once released. A partition lost after it finished is gathered once Dask
        recomputed it (its lineage; the worker client's gather waits for that)."""
        from distributed.utils import sync

        if c.future is None:
            return c.data, True
        fut = c.future
        interrupt.wait(fut)
        while fut.status not in ("finished", "error", "cancelled"):
            interrupt.wait(fut)  # its data was lost as it finished: Dask computes it again
        if fut.status == "finished":
            found = sync(self.worker.loop, _local, self.worker, fut.key)
            if found is not _MISSING:
                return found, False
        return fut.result(), False

    def release(self, c: _Computed) -> None:
        if c.future is not None:
            c.future.release()
        c.data = None

    def close(self) -> None:
        """Nothing to close: the client is the worker's own."""


_MISSING = object()


async def _local(worker: Any, key: Any) -> Any:
    """A key's value in this worker's memory, or ``_MISSING`` (on its event loop)."""
    try:
        return worker.data[key] if key in worker.data else _MISSING
    except KeyError:
        return _MISSING


class LocalComputer:
    """Computes partitions in this process (a loader outside a coordinator): Dask's
    synchronous scheduler in ``threads`` threads of its own."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max(1, threads), "daskdist-partition")

    def submit(self, coll: DaskCollection, unit: int) -> _Computed:
        part = coll.parts[unit]
        return _Computed(unit, self.pool.submit(part.compute, scheduler="sync"))

    def result(self, c: _Computed, interrupt: Interrupt) -> tuple[Any, bool]:
        interrupt.wait(c.future)
        return c.future.result(), False

    def release(self, c: _Computed) -> None:
        c.future.cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def make_computer(loader: ArrowLoader) -> Any:
    """The computer for a loader: the worker's Dask client inside a coordinator (its
    lease service knows the worker), else local threads."""
    svc = loader.ctx.services
    worker = getattr(svc, "worker", None)
    if worker is not None and hasattr(worker, "_get_client"):
        helpers = getattr(svc, "collection_helpers", None)
        return DaskComputer(worker, helpers)
    return LocalComputer(loader.partitions_ahead + 1)  # the one read next and those ahead


def partition_error(coll: DaskCollection, unit: int, exc: BaseException) -> InputError:
    """The error a closure gets when partition ``unit`` could not be computed: names
    the partition and carries the user's error (``original``, ``__cause__``)."""
    err = InputError(f"partition {unit} of the {coll.what} could not be computed: "
                     f"{type(exc).__name__}: {exc}", exc)
    err.__cause__ = exc
    return err


# -- sources ------------------------------------------------------------------------------
class PartitionSource:
    """``"dynamic"``: leased partitions, computed ahead, their leased rows converted.

    Keeps, per lease, the rows not yet delivered (its lock), so :meth:`close` gives
    back what no caller received. A partition whose graph raises gives back its rows
    (deferred, its failure counted: the epoch fails after ``max_worker_failures``) and
    the other partitions' leases as free; the error names the partition.
    """

    def __init__(self, loader: ArrowLoader, epoch: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self._lock = threading.Lock()
        self._leases: list[RowSet] = []
        self._interrupt = Interrupt()

    def interrupt(self) -> None:
        """End the producer's wait for a partition now (its iterator is closing)."""
        self._interrupt.interrupt()

    def _first(self, unit: int) -> int:
        ld = self.loader
        return unit * STRIDE if ld.shards.lengths is None else ld._starts[unit]

    def _by_unit(self, ranges: list[Interval]) -> list[tuple[int, list[Interval]]]:
        """A lease's rows split by partition, in order."""
        ld = self.loader
        out: list[tuple[int, list[Interval]]] = []
        for a, b in ranges:
            while a < b:
                if ld.shards.lengths is None:
                    u = a // STRIDE
                    stop = min(b, (u + 1) * STRIDE)
                else:
                    u = ld._unit_of(a)
                    stop = min(b, ld._starts[u] + ld.shards.lengths[u])
                if out and out[-1][0] == u:
                    out[-1][1].append((a, stop))
                else:
                    out.append((u, [(a, stop)]))
                a = stop
        return out

    def chunks(self) -> Iterator[ChunkItem]:
        """Lease, compute (ahead), convert partitions until none is free right now.

        ``partitions_ahead`` partitions are leased (and being computed) ahead of the
        one being read or waited for, so at most ``partitions_ahead + 1`` are held per
        reader: when one is taken, its replacement is asked for without waiting (when
        the service can), so the lease's round trip overlaps the compute and the read.
        Lengths are reported without waiting too; a differing one raises at the next
        one."""
        ld = self.loader
        svc = ld.ctx.services
        coll = ld.shards
        ld._define()
        computer = ld._computer()
        ask_ahead = getattr(svc, "acquire_partition_async", None)
        report_ahead = getattr(svc, "report_length_async", None)
        pending: deque[tuple[int, list[Interval], _Computed]] = deque()
        reports: deque = deque()  # length reports on their way
        ask = None  # a lease asked for, not yet taken
        exhausted = False

        def take(ranges: list | None) -> bool:
            """A lease's partitions go to Dask to compute; ``False`` for no lease."""
            if not ranges:
                return False
            ranges = [(int(a), int(b)) for a, b in ranges]
            with self._lock:
                self._leases.append(RowSet(ranges))
            for unit, rows in self._by_unit(ranges):
                pending.append((unit, rows, computer.submit(coll, unit)))
            return True

        try:
            while True:
                # the partition to read next and ``partitions_ahead`` behind it
                while not exhausted and len(pending) <= ld.partitions_ahead:
                    if ask is not None:
                        ranges, ask = ask.result(), None
                    else:
                        ranges = svc.acquire_partition(ld.dataset_id, self.epoch)
                    exhausted = not take(ranges)
                while reports and reports[0].done():
                    reports.popleft().result()  # InputError: a length differed
                if not pending:
                    for f in reports:  # the last lengths reached the table
                        f.result()
                    return
                unit, rows, comp = pending.popleft()
                if ask_ahead is not None and not exhausted:
                    ask = ask_ahead(ld.dataset_id, self.epoch)
                try:
                    data, shared = computer.result(comp, self._interrupt)
                except Interrupted:  # closed: its rows are given back by close()
                    computer.release(comp)
                    return
                except Exception as e:  # noqa: BLE001 - the user's graph: given back, raised
                    computer.release(comp)
                    self._give_back(unit, rows, pending, computer, e)
                    failed = svc.progress(ld.dataset_id, self.epoch).get("failed")
                    err = partition_error(coll, unit, e)
                    if failed:  # its last allowed failure: the epoch cannot complete
                        raise InputError(failed, e) from e
                    raise err from e
                try:
                    n = part_rows(data)
                    if report_ahead is not None:
                        reports.append(report_ahead(ld.dataset_id, self.epoch, unit, n))
                    else:
                        svc.report_length(ld.dataset_id, self.epoch, unit, n)  # InputError
                    item = self._item(unit, rows, data, shared, n)
                finally:  # converted (or failed): Dask may forget the partition
                    computer.release(comp)
                    del data
                if item is not None:
                    yield item
        finally:
            for _, _, comp in pending:  # closed early: their rows are given back by close()
                computer.release(comp)
            if ask is not None:  # asked ahead, never read: given back
                try:
                    rest = ask.result()
                except Exception:  # noqa: BLE001 - no lease came
                    rest = None
                if rest:
                    svc.release(ld.dataset_id, self.epoch, rest)

    def _item(self, unit: int, rows: list[Interval], data: Any, shared: bool,
              n: int) -> ChunkItem | None:
        """The computed partition's leased rows (of its ``n``), converted."""
        ld = self.loader
        first = self._first(unit)
        end = first + n
        if ld.shards.lengths is None and rows and rows[-1][1] > end:
            with self._lock:  # ids past its end do not exist: the table dropped them
                for held in self._leases:
                    for lo, hi in held.intersect(end, first + STRIDE):
                        held.remove(lo, hi)
                self._leases = [h for h in self._leases if h]
            rows = [(a, min(b, end)) for a, b in rows if a < end]
        if not rows:
            return None
        ids = batching.ids_of_ranges(rows)
        index = None if (len(rows) == 1 and rows[0] == (first, end)) else ids - first
        if ld.shuffle:
            order = batching.dynamic_order(len(ids), ld.seed, self.epoch, first,
                                           batching.dynamic_tile(ld.batch_size))
            ids = ids[order]
            index = order if index is None else index[order]
        try:
            cols = convert_part(ld.shards, data, index, ld.fill_null, ld.collate is not None,
                                shared, ld.columns)
        except Exception as e:
            raise ValueError(f"partition {unit} of the {ld.shards.what}: {e}") from e
        return ChunkItem(cols, ids, len(ids), ascending=not ld.shuffle)

    def _give_back(self, unit: int, rows: list[Interval], pending: deque, computer: Any,
                   exc: BaseException) -> None:
        """Partition ``unit`` failed: its rows go back deferred (the failure counted),
        the partitions computed ahead go back free and Dask forgets them."""
        ld = self.loader
        rest = [iv for _, r, _ in pending for iv in r]
        for _, _, comp in pending:
            computer.release(comp)
        pending.clear()
        with self._lock:
            for held in self._leases:
                for a, b in rows + rest:
                    for lo, hi in held.intersect(a, b):
                        held.remove(lo, hi)
            self._leases = [h for h in self._leases if h]
        svc = ld.ctx.services
        if rest:
            svc.release(ld.dataset_id, self.epoch, rest)
        svc.release(ld.dataset_id, self.epoch, rows,
                    failure=(f"partition {unit}", f"partition {unit} of the "
                             f"{ld.shards.what} raised {type(exc).__name__}: {exc}"))

    def delivered(self, ranges: list[Interval]) -> None:
        """Rows handed to a caller: they count for its closure."""
        with self._lock:
            for a, b in ranges:
                for held in self._leases:
                    for lo, hi in held.intersect(a, b):
                        held.remove(lo, hi)
            self._leases = [h for h in self._leases if h]
        record_consumed(LeaseToken.of(self.loader.dataset_id, self.epoch, ranges))

    def close(self) -> None:
        """Give back leased rows no caller received."""
        with self._lock:
            rest = [iv for held in self._leases for iv in held]
            self._leases = []
        if rest:
            self.loader.ctx.services.release(self.loader.dataset_id, self.epoch, rest)

    def state(self) -> dict:
        with self._lock:
            return {"epoch": self.epoch,
                    "outstanding": [iv for held in self._leases for iv in held]}


class StaticPartitionSource:
    """Static policies: this pipeline's partitions (``"file"``/``"auto"``: every
    ``num_input_pipelines``-th of the epoch's order; ``"data"``: every partition, every
    ``num_input_pipelines``-th row; ``"off"``: everything), computed ahead, from stream
    ``position`` (rows before it are skipped; lengths unknown ahead are learned by
    computing)."""

    def __init__(self, loader: ArrowLoader, epoch: int, position: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self.start = position
        self._interrupt = Interrupt()

    def interrupt(self) -> None:
        """End the producer's wait for a partition now (its iterator is closing)."""
        self._interrupt.interrupt()

    def _plan(self) -> list[int]:
        ld = self.loader
        n = ld.shards.num_partitions
        order = list(range(n))
        if ld.shuffle:
            order = [int(k) for k in batching.block_permutation(n, ld.seed, self.epoch, -1)]
        i, k = ld._pipeline  # i < 0: no share (a worker that joined after the split)
        if i < 0:
            return []
        if ld.policy in ("file", "auto") and k > 1:
            order = order[i::k]
        return order

    def chunks(self) -> Iterator[ChunkItem]:
        ld = self.loader
        computer = ld._computer()
        order = self._plan()
        i, k = ld._pipeline
        stride = k if ld.policy == "data" else 1
        skip = self.start
        pending: deque[_Computed] = deque()
        nxt = 0
        try:
            while True:
                # the partition to read next and ``partitions_ahead`` behind it
                while nxt < len(order) and len(pending) <= ld.partitions_ahead:
                    pending.append(computer.submit(ld.shards, order[nxt]))
                    nxt += 1
                if not pending:
                    return
                comp = pending.popleft()
                try:
                    data, shared = computer.result(comp, self._interrupt)
                except Interrupted:
                    return
                except Exception as e:  # noqa: BLE001 - the user's graph
                    raise partition_error(ld.shards, comp.unit, e) from e
                finally:
                    computer.release(comp)
                n = part_rows(data)
                index = np.arange(i if stride > 1 else 0, n, stride, dtype=np.int64)
                if ld.shuffle:
                    index = index[batching.block_permutation(len(index), ld.seed, self.epoch,
                                                             comp.unit)]
                if skip >= len(index):
                    skip -= len(index)
                    continue
                index = index[skip:]
                skip = 0
                whole = stride == 1 and not ld.shuffle and len(index) == n
                cols = convert_part(ld.shards, data, None if whole else index, ld.fill_null,
                                    ld.collate is not None, shared, ld.columns)
                if len(index):
                    yield ChunkItem(cols, None, len(index))
        finally:
            for comp in pending:
                computer.release(comp)

    def delivered(self, ranges: list[Interval]) -> None:
        """Static rows are counted by position; nothing to track."""

    def close(self) -> None:
        """Nothing was taken from anyone."""

    def state(self) -> dict:
        return {"epoch": self.epoch, "start": self.start}
