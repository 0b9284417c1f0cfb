"""The datasets a lease table knows (pure): their definitions, the keys packed commits
name them by, and read-only queries of their epochs. :class:`~daskdist.core.leases.table.LeaseTable`
adds the sessions and the transitions of rows between them.

Imports nothing from Dask, torch, pyarrow or the rest of the package.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from daskdist.core.intervals import Interval
from daskdist.core.leases.epochs import Dataset
from daskdist.core.leases.units import DenseUnits, StridedUnits, Units
from daskdist.core.protocol import dataset_key

__all__ = ["DatasetIndex", "UnknownDataset"]


class UnknownDataset(LookupError):
    """A lease for a dataset this table has no units for (never defined, or forgotten
    when its handle was dropped or its coordinator closed)."""


class DatasetIndex:
    """Datasets by id, defined once, and what can be asked of them without a session.

    A dataset goes with :meth:`forget` (its handle was dropped) or :meth:`drop_owner`
    (its coordinator closed)."""

    def __init__(self) -> None:
        self.datasets: dict[str, Dataset] = {}
        # dataset_key(id) -> id (None: two ids share the key): a packed commit names it
        self._keys: dict[int, str | None] = {}
        # "<id>" -> the datasets "<id>.<k>" of its further loaders (they go with it)
        self._children: dict[str, set[str]] = {}

    def dataset_of(self, key: int) -> str | None:
        """The dataset whose :func:`~daskdist.core.protocol.dataset_key` is ``key``
        (``None``: none, or two datasets share it and a packed commit naming it is
        refused)."""
        return self._keys.get(key)

    def register(self, dataset_id: str, label: str = "", owner: str = "",
                 seed: int = 0) -> Dataset:
        """Know ``dataset_id`` (its label, owner, seed) before its units are defined. A
        dataset ``"<id>.<k>"`` (a second loader built for one per-worker dataset) takes
        the label and owner of ``"<id>"``."""
        ds = self.datasets.get(dataset_id)
        if ds is None:
            parent = self.datasets.get(dataset_id.partition(".")[0])
            if parent is not None and not owner:
                owner, label = parent.owner, label or parent.label
            ds = self.datasets[dataset_id] = Dataset(label, owner, seed)
            root, dot, _ = dataset_id.partition(".")
            if dot:
                self._children.setdefault(root, set()).add(dataset_id)
            key = dataset_key(dataset_id)
            known = self._keys.get(key, dataset_id)
            self._keys[key] = dataset_id if known == dataset_id else None
        elif label and not ds.label:
            ds.label = label
        return ds

    def define(self, dataset_id: str, runs: Sequence[Sequence[int]] | None = None,
               label: str = "", owner: str = "", seed: int = 0, units: int | None = None,
               shuffle: bool = False, whole: bool = False) -> None:
        """Define the dataset's units once: ``runs`` (see
        :func:`~daskdist.core.leases.units.unit_runs`) when their row counts are known, else
        ``units`` partitions whose lengths are learned (:mod:`daskdist.core.leases.resume`);
        ``shuffle``: units leased in an order seeded by ``(seed, epoch)``; ``whole``: a
        unit is never split. A later definition must agree (``ValueError`` naming the
        dataset if not)."""
        if runs is not None:
            new: Units = DenseUnits(runs)
            if units is not None and new.units != int(units):
                raise ValueError(f"dataset {self.label_of(dataset_id)}: its runs hold "
                                 f"{new.units} units, not {units}")
        elif units is not None:
            new = StridedUnits(units)
        else:
            raise ValueError(f"dataset {dataset_id!r}: give its units' runs or count")
        ds = self.register(dataset_id, label, owner, seed)
        ds.seed, ds.shuffle, ds.whole = seed, bool(shuffle), bool(whole)
        if ds.units is None:
            ds.units = new
        elif new.runs != ds.units.runs:
            raise ValueError(
                f"dataset {self.label_of(dataset_id)}: its units differ from its definition "
                f"({new.units} units / {new.total} rows given, {ds.units.units} units / "
                f"{ds.units.total} rows defined); build one loader per dataset call")

    def forget(self, dataset_id: str) -> list[str]:
        """Drop a dataset (and the datasets ``"<id>.<k>"`` of its other loaders): its
        epoch tables and completed epochs. The ids dropped."""
        gone = [dataset_id, *self._children.pop(dataset_id, ())]
        root, dot, _ = dataset_id.partition(".")
        if dot and root in self._children:
            self._children[root].discard(dataset_id)
        out = []
        for d in gone:
            ds = self.datasets.pop(d, None)
            if ds is None:
                continue
            key = dataset_key(d)
            if self._keys.get(key) == d:
                del self._keys[key]
            self._forgotten(d, ds)
            out.append(d)
        return out

    def _forgotten(self, dataset_id: str, ds: Dataset) -> None:
        """``dataset_id`` was dropped (the lease table forgets its sessions' keys)."""

    def drop_owner(self, owner: str) -> list[str]:
        """Forget every dataset of ``owner`` (its coordinator closed); their ids."""
        gone = [d for d, ds in self.datasets.items() if ds.owner == owner and owner]
        return [x for d in gone for x in self.forget(d)]

    # -- queries -----------------------------------------------------------------------
    def newest_epochs(self) -> dict[str, int]:
        """Every defined dataset's newest epoch, live or completed (its table dropped)."""
        newest = {}
        for dataset_id, ds in self.datasets.items():
            epochs = list(ds.epochs) + ([ds.completed[-1][1] - 1] if ds.completed else [])
            if epochs:
                newest[dataset_id] = max(epochs)
        return newest

    def progress(self, dataset_id: str, epoch: int) -> dict:
        """An epoch's counts (:meth:`~daskdist.core.leases.epochs.Dataset.progress`); an unknown
        dataset reports ``known=False``. Read-only: never creates a table."""
        ds = self.datasets.get(dataset_id)
        if ds is not None:
            return ds.progress(dataset_id, int(epoch))
        return Dataset("", "").progress(dataset_id, int(epoch))

    def takes(self, dataset_id: str, session: str) -> bool:
        """Whether a closure reading ``dataset_id`` should run on ``session`` now
        (:meth:`~daskdist.core.leases.epochs.Dataset.takes`)."""
        ds = self.datasets.get(dataset_id)
        return ds is None or ds.takes(session)

    def holders(self, dataset_id: str) -> Iterator[str]:
        """The sessions holding leased rows of ``dataset_id`` (lazily: take a few)."""
        ds = self.datasets.get(dataset_id)
        if ds is not None:
            for ep in ds.epochs.values():
                yield from ep.leased

    def only_with(self, session: str, keys: Iterable[tuple[str, int]]) -> bool:
        """Whether each of these ``(dataset, epoch)`` has no row left to read: every row
        not acknowledged is ``session``'s (an asynchronous model's staged pushes, which
        complete the epoch once durable). O(1) an epoch; ``False`` for no epoch, or one
        not open."""
        keys = list(keys)
        for dataset_id, epoch in keys:
            ds = self.datasets.get(dataset_id)
            ep = ds.epochs.get(int(epoch)) if ds is not None else None
            held = ep.leased.get(session) if ep is not None else None
            if held is None or ep.n_free or ep.n_leased != held.size:
                return False
        return bool(keys)

    def is_complete(self, dataset_id: str, epoch: int) -> bool:
        """Every row of the epoch was acknowledged (its table may be dropped already)."""
        ds = self.datasets.get(dataset_id)
        return ds is not None and ds.is_complete(int(epoch))

    def dataset(self, dataset_id: str) -> Dataset:
        """A defined dataset, or :class:`UnknownDataset`."""
        ds = self.datasets.get(dataset_id)
        if ds is None or ds.units is None:
            raise UnknownDataset(
                f"dataset {dataset_id!r} is not defined here (never defined, or forgotten "
                "when its handle was dropped or its coordinator closed)")
        return ds

    def label_of(self, dataset_id: str) -> str:
        """How messages name a dataset: its label and id."""
        ds = self.datasets.get(dataset_id)
        label = ds.label if ds is not None else ""
        return f"{label!r} ({dataset_id})" if label else repr(dataset_id)

    # -- resuming (the rest is in core/leases/resume.py) ---------------------------------------
    def known_lengths(self, dataset_id: str) -> list[tuple[int, int]] | None:
        """A collection's partition lengths learned so far, run-length encoded (``-1``
        for unknown ones); ``None`` for a dataset whose lengths were defined."""
        return self.dataset(dataset_id).defined.length_runs()

    def acknowledged(self, dataset_id: str, epoch: int) -> list[Interval]:
        """The epoch's acknowledged rows as intervals (what :meth:`start_epoch` takes)."""
        ds = self.dataset(dataset_id)
        epoch = int(epoch)
        if ds.is_complete(epoch):
            return ds.defined.universe()
        ep = ds.epochs.get(epoch)
        return [] if ep is None else ep.acked.items()
