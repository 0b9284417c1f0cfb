"""Where a dataset's units already are, on the scheduler (SPEC §3.2): partitions of a Dask
collection the user persisted, leased first to the member whose worker holds them.

A :class:`~daskdist.core.leases.locality.LocalityIndex` per persisted collection is built once
from ``Scheduler.tasks[key].who_has`` when the dataset is defined and checked lazily
when a partition comes up, so a lease costs O(1) amortized whatever the number of
partitions. The lease book asks it; an index goes with its dataset or coordinator.
Never imports torch, pyarrow or ``collective/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daskdist.core.intervals import Interval
from daskdist.core.leases.locality import LocalityIndex


def _key(value: Any) -> Any:
    """A Dask key from the wire (a tuple may arrive as a list)."""
    if isinstance(value, list):
        return tuple(_key(v) for v in value)
    return value


class Locality:
    """Persisted partitions' holders, for one scheduler."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        # (coordinator, dataset id) -> (its locality index, the holder key per partition)
        self.indexes: dict[tuple[str, str], tuple[LocalityIndex, list]] = {}
        self.local_leases = 0  # partitions leased to the member holding them
        self.other_leases = 0  # partitions of persisted collections leased elsewhere

    # -- persisted partitions -------------------------------------------------------------
    def define(self, name: str, dataset_id: str, holders: list, seed: int,
               shuffle: bool) -> None:
        """A dataset with persisted units: index where each one is now (once)."""
        if (name, dataset_id) in self.indexes:
            return
        keys = [_key(k) for k in holders]
        tasks = self.scheduler.tasks
        where = []
        for unit, key in enumerate(keys):
            ts = tasks.get(key) if key is not None else None
            if ts is not None and ts.who_has:
                where.append((unit, [ws.address for ws in ts.who_has]))
        self.indexes[(name, dataset_id)] = (LocalityIndex(where, seed, shuffle), keys)

    def indexed(self, name: str, dataset_id: str) -> bool:
        return (name, dataset_id) in self.indexes

    def take(self, name: str, dataset_id: str, address: str, epoch: int,
             lease_unit: Callable[[int], list[Interval] | None]) -> list[Interval] | None:
        """A lease of a unit the worker at ``address`` holds now (``lease_unit(unit)``
        leases it, ``None`` if none of its rows is free), or ``None``."""
        found = self.indexes.get((name, dataset_id))
        if found is None:
            return None
        index, keys = found
        scheduler = self.scheduler
        ws = scheduler.workers.get(address)

        def held_there(unit: int) -> bool:
            ts = scheduler.tasks.get(keys[unit])
            return ts is not None and ws is not None and ws in ts.who_has

        lease = index.take(address, epoch, lease_unit, held_there)
        if lease is not None:
            self.local_leases += 1
        return lease

    def leased_elsewhere(self, name: str, dataset_id: str) -> None:
        """A unit of an indexed dataset went to a member not holding it."""
        if (name, dataset_id) in self.indexes:
            self.other_leases += 1

    def forget(self, name: str, dataset_ids: list[str] | None = None) -> None:
        """Datasets gone (their handles dropped: every id, those of their further
        loaders too), or a whole coordinator (``None``)."""
        if dataset_ids is None:
            gone = [k for k in self.indexes if k[0] == name]
        else:
            gone = [(name, d) for d in dataset_ids]
        for key in gone:
            self.indexes.pop(key, None)
