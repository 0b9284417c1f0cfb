"""Per-worker datasets on the client: the handles ``create_per_worker_dataset`` and
``distribute_dataset`` return, and the factories their workers run.

A handle's per-worker resource is released on the scheduler and the workers once the
handle is garbage collected (``_ResourceHandle``); the factories are pickled to the
workers, which import ``daskdist.data`` (and torch) only there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from daskdist.client import reprs
from daskdist.client.values import PerWorkerValues

if TYPE_CHECKING:
    from daskdist.client.coordinator import Coordinator


class _ResourceHandle(PerWorkerValues):
    """The client's reference to a registered per-worker resource: when it is garbage
    collected, the resource is released on the scheduler and the workers (once every
    closure scheduled before has finished). Travels as a plain ``PerWorkerValues``."""

    __slots__ = ("__weakref__", "parent")

    def __init__(self, rid: str, kind: str, parent: PerWorkerValues | None = None):
        super().__init__(rid=rid, kind=kind)
        self.parent = parent  # an iterator keeps its dataset alive


class PerWorkerDataset:
    """A dataset built on every worker by a factory (``create_per_worker_dataset``).

    ``iter()`` gives a ``PerWorkerValues`` of iterators, one per worker.
    """

    def __init__(self, coordinator: Coordinator, values: PerWorkerValues):
        self._coordinator = coordinator
        self.values = values

    def __iter__(self) -> PerWorkerValues:  # type: ignore[override]
        return self._coordinator._register_resource("iterator", None, parent=self.values)

    def __repr__(self) -> str:
        return f"PerWorkerDataset({self.values.rid})"


class _LoaderFactory:
    """Builds a worker's ArrowLoader with the per-replica share of the global batch."""

    def __init__(self, shards: Any, global_batch_size: int, options: dict):
        self.shards = shards
        self.global_batch_size = global_batch_size
        self.options = options

    def __call__(self, ctx: Any) -> Any:
        from daskdist.data import ArrowLoader

        batch = ctx.get_per_replica_batch_size(self.global_batch_size)
        return ArrowLoader(self.shards, ctx, batch_size=batch, **self.options)


class _EpochIterator:
    """Starts a worker's loader on ``epoch`` and iterates it."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def __call__(self, loader: Any) -> Iterator:
        loader.set_epoch(self.epoch)
        return iter(loader)


class DistributedDataset(PerWorkerDataset):
    """Per-worker ArrowLoaders over shared shards (``Coordinator.distribute_dataset``).

    ``iter()`` gives iterators for the current epoch (``set_epoch`` changes it).
    Under ``policy="dynamic"``, ``progress()`` reports the epoch's acknowledged rows:
    loop over closures until ``progress()["complete"]``.
    """

    def __init__(self, coordinator: Coordinator, values: PerWorkerValues, shards: Any,
                 dataset_id: str):
        super().__init__(coordinator, values)
        self.shards = shards
        self.dataset_id = dataset_id
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> PerWorkerValues:  # type: ignore[override]
        return self._coordinator._register_resource(
            "iterator", _EpochIterator(self.epoch), parent=self.values)

    def progress(self, epoch: int | None = None, bar: bool = False) -> dict:
        """The dynamic policy's counts for ``epoch``: total, acknowledged, leased, free,
        complete. ``bar=True`` also shows them on a ``tqdm.auto`` bar (one per dataset)."""
        epoch = self.epoch if epoch is None else int(epoch)
        unit_rows = [u.num_rows for u in self.shards.units]
        p = self._coordinator._call("daskdist_lease_progress", dataset_id=self.dataset_id,
                                    epoch=epoch, unit_rows=unit_rows)
        if bar:
            reprs.update_epoch_bar(self, p)
        return p

    def _repr_html_(self) -> str:
        return reprs.dataset_html(self)
