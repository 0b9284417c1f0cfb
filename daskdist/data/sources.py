"""The seam between a loader and the kinds of data it reads (files, Dask collections, ...).

A kind of data is a :class:`Source`: a picklable description built on the client (it
travels to the workers with the loader's factory) that the loader asks to

- **count its rows**: :meth:`Source.unit_rows`, per unit (``None`` while lengths are
  learned by reading) and :meth:`Source.unit_groups` (the "files" static policies
  keep whole);
- **define itself** with the lease service: :meth:`Source.definition`;
- **name itself** for checkpoints' ledgers and ``state_dict``: :meth:`Source.fingerprint`;
- **open an epoch at a position**: :meth:`Source.open` gives a per-loader
  :class:`SourceReader` (its resources: readers, a partition pool) whose
  :meth:`~SourceReader.static_pass` reads the pieces a static policy assigned
  (:mod:`.sharding`) from a stream position, and whose :meth:`~SourceReader.unit_reads`
  reads the rows of leases (the ``"dynamic"`` policy, :mod:`.leased`).

Everything a source needs of the loader comes in a :class:`ReadSpec`; sources never
touch the loader. A new kind is one file that subclasses :class:`Source` and
:class:`SourceReader` and calls :func:`register_source` (this package's own kinds are
imported by the first :func:`as_source`).

A pass over an epoch is a :class:`ChunkSource`: a generator of :class:`ChunkItem` run by
the loader's prefetch thread (which owns it), ``delivered`` called under the iterator's
lock in the caller's thread, ``close`` after the prefetch thread was joined (when the
iterator closes, and when a failure of the pass reached it: rows held and not delivered
go back; ``chunks()`` may run again after), and ``interrupt`` from any thread (it only
sets events).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from daskdist.core.intervals import Interval
from daskdist.core.protocol import DatasetDef
from daskdist.data.sharding import Piece

__all__ = [
    "ChunkItem",
    "ChunkSource",
    "Pending",
    "ReadSpec",
    "Source",
    "SourceReader",
    "UnitFailure",
    "UnitReads",
    "as_source",
    "register_source",
]


class ChunkItem(NamedTuple):
    """One converted block on its way to the iterator."""

    cols: Any  # a convert.Chunk, or a pyarrow Table when the loader has ``collate``
    ids: np.ndarray | None  # global row ids (dynamic policy), else None
    rows: int
    staged: Any = None  # set by the device stage: what consumers wait on before use
    ascending: bool = False  # ``ids`` ascend (unshuffled): a batch's runs without a sort


class ChunkSource(Protocol):
    """One pass over an epoch, as the loader's iterator reads it (see the module doc)."""

    def chunks(self) -> Iterator[ChunkItem]: ...

    def delivered(self, ranges: list[Interval]) -> None: ...

    def close(self) -> None: ...

    def interrupt(self) -> None: ...

    def state(self) -> dict: ...


@dataclass(frozen=True)
class ReadSpec:
    """How one loader reads (what its source's reader is given): the columns, batch
    size, shuffling, null filling, whether rows go to ``collate`` as Arrow tables, how
    many units to read ahead, and, for leases, the dataset's id, label and lease size
    and the lease service."""

    columns: tuple
    batch_size: int
    shuffle: bool
    seed: int
    shuffle_buffer: int
    fill_null: Any
    collate: bool
    ahead: int  # units (a collection's partitions) being read ahead of the consumer
    dataset_id: str
    label: str
    lease_rows: int
    services: Any  # the lease service (``None``: static policies only)


class UnitFailure(Exception):
    """Reading or converting the rows of one unit failed (internal: the leased pass gives
    its rows back, counting a failure of ``source``, then raises :meth:`error`).
    ``rows``: the failed unit's rows, when a read covers several units (``None``: all
    of the read's)."""

    def __init__(self, source: str, exc: BaseException, error: BaseException | None = None,
                 rows: list[Interval] | None = None) -> None:
        super().__init__(str(exc))
        self.source = source  # how the lease table names it: a file, "partition 3"
        self.exc = exc  # what was raised
        self._error = error if error is not None else exc
        self.rows = rows

    def __reduce__(self) -> tuple:
        # not the error it carries: that error's context is this failure (a cycle)
        return (type(self), (self.source, self.exc))

    def error(self) -> BaseException:
        """The error the closure gets (naming the unit and the column)."""
        return self._error


class Pending(NamedTuple):
    """One read of a lease's rows, planned (for a collection: its partition computing)."""

    rows: list[Interval]  # the leased rows it reads
    handle: Any  # the kind's own: a file block's pieces, a computing partition


class UnitReads(Protocol):
    """How a kind of source reads the rows of its leases (:class:`~.leased.LeasedPass`
    drives it in the prefetch thread; ``interrupt`` comes from any thread)."""

    ahead: int  # planned reads kept beyond the one being read
    lease_size: tuple[int, int]  # a lease asked for: (rows, at least)

    def plan(self, ranges: list[Interval]) -> list[Pending]:
        """A new lease's rows as reads, in read order (may start them: a computation)."""
        ...

    def read(self, pending: Pending) -> ChunkItem | None:
        """The planned read's rows, converted (``None``: none of them exist). Raises
        :class:`UnitFailure` (its rows are given back by the caller), or
        :class:`~.compute.Interrupted` when interrupted."""
        ...

    def cancel(self, pending: Pending) -> None:
        """A planned read that will not be read (closed, or a failure before it)."""
        ...

    def check(self) -> None:
        """Raise what reports sent without waiting found wrong (a learned length that
        differs: ``InputError``); called between reads."""
        ...

    def finish(self) -> None:
        """Wait for those reports (the pass ends, or asks for rows with none left to
        read: the lease table must know every unit read before it answers)."""
        ...

    def close(self) -> None:
        """The pass is over, however it ended: release what the reads hold (open files)."""
        ...

    def interrupt(self) -> None: ...


class SourceReader:
    """A source's reading for one loader (its :class:`ReadSpec`): passes over epochs and
    its own resources."""

    spec: ReadSpec

    def static_pass(self, epoch: int, position: int, pieces: list[Piece]) -> ChunkSource:
        """``pieces`` (a static policy's share, in unit order) of ``epoch`` from stream
        ``position`` (rows before it are skipped)."""
        raise NotImplementedError

    def unit_reads(self, epoch: int, drop: Callable[[list[Interval]], None]) -> UnitReads:
        """How leases of ``epoch`` are read; ``drop(rows)``: leased ids found not to
        exist (a partition shorter than its id space) leave the pass's holdings."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the reader holds (thread pools); idempotent."""


class Source:
    """A kind of data a loader reads (see the module doc).

    ``shards``: what the user-facing loader shows as its data (the files' listing, the
    collection); ``columns``: the batch keys there are; ``what``: how messages name it;
    ``leases_by_default``: the default policy is ``"dynamic"`` when a lease service
    exists (a collection streams; files default to ``"auto"``)."""

    shards: Any
    columns: list
    what: str
    leases_by_default = False

    def unit_rows(self) -> list[int] | None:
        """Rows per unit, in the stable order of units; ``None`` while unknown."""
        raise NotImplementedError

    def unit_groups(self) -> list[int]:
        """Per unit, the group the ``"file"`` policy keeps whole (its file)."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """What a ``state_dict`` (and a checkpoint's ledger) is checked against."""
        raise NotImplementedError

    def definition(self, dataset_id: str, label: str, seed: int, shuffle: bool) -> DatasetDef:
        """How the lease table defines this source's units."""
        raise NotImplementedError

    def open(self, spec: ReadSpec) -> SourceReader:
        """A reader for one loader."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.what


# -- the kinds of source: each registers how to recognise what it reads ------------------
_KINDS: list[tuple[Callable[[Any], bool], Callable[[Any, Sequence | None], Source]]] = []
# the kinds this package ships, in the order they are asked: each module registers
# itself when imported, which the first ``as_source`` does
BUILTIN_KINDS = ("daskdist.data.collections.source", "daskdist.data.files.source")


def register_source(accepts: Callable[[Any], bool],
                    make: Callable[[Any, Sequence | None], Source]) -> None:
    """Make ``as_source`` build ``make(obj, columns)`` for objects ``accepts(obj)``."""
    _KINDS.append((accepts, make))


def type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def as_source(obj: Any, columns: Sequence | None = None) -> Source:
    """The :class:`Source` for ``obj``: Parquet/Arrow files (a path, a glob, a list of
    paths, a ``pyarrow.dataset``, :class:`~.shards.ArrowShards`), a dask DataFrame, a
    dict of dask Arrays, or a source already; anything else: ``TypeError`` naming what
    was given. ``columns`` selects columns where the kind can push it down."""
    if isinstance(obj, Source):
        return obj
    for module in BUILTIN_KINDS:  # imported once: later calls find them loaded
        importlib.import_module(module)
    for accepts, make in _KINDS:
        if accepts(obj):
            return make(obj, columns)
    what = type_name(obj)
    raise TypeError(
        f"a dataset source must be Parquet/Arrow files (a path, a glob, a list of paths, "
        f"a pyarrow.dataset or ArrowShards), a dask DataFrame, or a dict of dask Arrays; "
        f"got {what}"
        + (" (make it one with dask.dataframe.from_pandas or dask.array.from_array)"
           if what.startswith(("pandas.", "numpy.")) else ""))


def is_path_like(obj: Any) -> bool:
    """A path, or a non-empty list or tuple of paths."""
    return isinstance(obj, (str, os.PathLike)) or (
        isinstance(obj, (list, tuple)) and bool(obj)
        and all(isinstance(s, (str, os.PathLike)) for s in obj))
