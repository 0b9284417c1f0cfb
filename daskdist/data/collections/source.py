"""Dask collections as a loader's source (SPEC §3.2): a dask DataFrame, or a dict of dask
Arrays chunked alike along axis 0, streamed partition by partition.

:class:`DaskCollection` is built on the client (:func:`~.sources.as_source`): one
``Delayed`` per partition (a DataFrame's ``to_delayed()``; for Arrays, each array's blocks
of one row chunk as a dict), the lengths when they are known (Arrays' chunks), the keys
of partitions the user persisted (locality) and a deterministic token of the collection
(its fingerprint). It is pickled to the workers with the loader's factory, where its
reader (:mod:`.partitions`) computes the partitions.

A DataFrame's column labels are the batch keys as they are: a frame built from a NumPy
array (labels ``0, 1, ...``) gives ``batch[0]``, ``batch[1]``, as ``df[0]`` does.

Nothing here imports pandas or dask.dataframe until a collection is given, so
``import daskdist`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from daskdist.core.leases.units import unit_runs
from daskdist.core.protocol import DatasetDef
from daskdist.data.sources import ReadSpec, Source, SourceReader, register_source, type_name

__all__ = ["DaskCollection", "is_collection"]


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


class DaskCollection(Source):
    """A dask DataFrame or dict of dask Arrays, as partitions a loader computes.

    ``parts[p]`` is a ``Delayed`` of partition ``p`` (a pandas DataFrame, or a dict of
    numpy arrays); ``lengths`` the partitions' rows when known (Arrays), else ``None``;
    ``holders[p]`` the key of a persisted partition (or ``None``); ``token`` a
    deterministic token of the collection (:meth:`fingerprint`). Its partitions stream
    through leases by default.
    """

    leases_by_default = True

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
        self.shards = self

    @classmethod
    def of(cls, obj: Any, columns: Sequence[str] | None = None) -> DaskCollection:
        """Build one from a dask DataFrame (or Series) or a dict of dask Arrays;
        ``columns`` selects columns (a DataFrame's projection is pushed into its graph)."""
        if isinstance(obj, DaskCollection):
            return obj
        if _is_dask_dataframe(obj):
            if not hasattr(obj, "columns"):  # a Series
                obj = obj.to_frame()
            names = list(obj.columns)
            if len({str(c) for c in names}) != len(names):
                raise ValueError(f"the dask DataFrame's column labels {names} are not "
                                 "distinct as strings; rename them")
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
        if not isinstance(obj, dict):
            raise TypeError(f"a dask DataFrame or a dict of dask Arrays, got {type_name(obj)}")
        bad = {k: type_name(v) for k, v in obj.items() if not _is_dask_array(v)}
        if bad or not obj:
            raise TypeError(
                "a dict source must map names to dask Arrays chunked alike along axis 0; "
                + (f"got {bad}" if bad else "got an empty dict"))
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

    def unit_rows(self) -> list[int] | None:
        return list(self.lengths) if self.lengths is not None else None

    def unit_groups(self) -> list[int]:
        return list(range(self.num_partitions))  # each partition is its own "file"

    def definition(self, dataset_id: str, label: str, seed: int, shuffle: bool) -> DatasetDef:
        """How the lease table defines this collection's partitions: whole units (a
        partition read in part is computed whole), leased in a seeded order when
        shuffled, a persisted one first to the member holding it."""
        runs = unit_runs(self.lengths) if self.lengths is not None else None
        return DatasetDef(dataset_id, label, runs, int(seed), self.num_partitions,
                          bool(shuffle), True, self.holders)

    def open(self, spec: ReadSpec) -> SourceReader:
        from daskdist.data.collections.partitions import PartitionReader

        return PartitionReader(self, spec)

    def __repr__(self) -> str:
        return f"DaskCollection({self.what}, columns={self.columns})"


# a dict of anything else is refused by DaskCollection.of, naming its values' types
register_source(lambda obj: is_collection(obj) or isinstance(obj, dict), DaskCollection.of)
