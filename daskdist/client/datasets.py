"""Per-worker datasets on the client: the handles ``create_per_worker_dataset`` and
``distribute_dataset`` return, and the factories their workers run.

A dataset is the call that made it: its identity is its per-worker resource's id, fresh
per call (``name=`` is only a label), so a re-run notebook cell, a new coordinator, or
a training and an evaluation dataset over one directory each read every row. A
handle's per-worker resource, and the dataset's lease tables on the scheduler, are
released once the handle is garbage collected (a
:class:`~daskdist.client.closures.ResourceHandle`) or its coordinator closes. Resuming
an epoch across coordinators is explicit: ``state_dict()`` / ``load_state_dict()``.
The factories are pickled to the workers, which import ``daskdist.data`` (and torch)
only there. A handle asks its coordinator only what :class:`DatasetCoordinator` says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from daskdist.client import reprs
from daskdist.client.closures import PerWorkerValues
from daskdist.core.protocol import EpochLedger
from daskdist.errors import InputError


class DatasetCoordinator(Protocol):
    """What a dataset handle asks its coordinator (a ``Coordinator``'s
    :class:`~daskdist.client.coordinator.DatasetLink`)."""

    def workers(self, ask: bool = False) -> int:
        """The coordinator's member count as it last heard it (``ask``: asked now)."""

    def register_iterator(self, factory: Callable | None,
                          dataset: PerWorkerValues) -> PerWorkerValues:
        """Per-worker iterators of ``dataset``: ``factory(component)`` on each worker
        (``iter`` when ``None``), released when the handle returned is dropped."""

    def progress(self, dataset_id: str, epoch: int) -> dict:
        """A dynamic epoch's counts (``daskdist_lease_progress``)."""

    def ledger(self, dataset_id: str, epoch: int) -> EpochLedger:
        """An epoch's acknowledged rows (``daskdist_dataset_state``)."""

    def start_epoch(self, ledger: EpochLedger) -> None:
        """Start an epoch from a ledger (``daskdist_dataset_start``)."""


class PerWorkerDataset:
    """A dataset built on every worker by a factory (``create_per_worker_dataset``).

    ``iter()`` gives a ``PerWorkerValues`` of iterators, one per worker. Its
    :attr:`dataset_id` is what a ``"dynamic"`` ArrowLoader the factory builds leases
    under (the worker hands it over in the factory's ``InputContext``).
    """

    def __init__(self, coordinator: DatasetCoordinator, values: PerWorkerValues,
                 name: str = ""):
        self._coordinator = coordinator
        self.values = values
        self.name = name

    @property
    def dataset_id(self) -> str:
        return self.values.rid

    def __iter__(self) -> PerWorkerValues:  # type: ignore[override]
        return self._coordinator.register_iterator(None, self.values)

    def progress(self, epoch: int = 0) -> dict:
        """A ``"dynamic"`` epoch's counts: total, acknowledged, leased, free, complete
        (``known`` is False until a worker's loader defined the dataset). Raises
        ``dd.InputError`` once the epoch failed (a file's reads failed
        ``max_worker_failures`` times), so a loop until ``complete`` ends."""
        p = self._coordinator.progress(self.dataset_id, int(epoch))
        if p.get("failed"):
            raise InputError(p["failed"])
        return p

    def __repr__(self) -> str:
        return f"PerWorkerDataset({self.values.rid})"


class LoaderFactory:
    """Builds a worker's ArrowLoader with the per-replica share of the global batch, as
    it was when the dataset was made (``replicas``): a worker that joins later uses the
    same batch size (TensorFlow fixes it when the dataset is distributed), so a global
    batch that does not divide by the grown count is no error, and ranks never get
    different batch sizes."""

    def __init__(self, source: Any, global_batch_size: int, options: dict,
                 replicas: int = 1):
        self.source = source
        self.global_batch_size = global_batch_size
        self.options = options
        self.replicas = max(1, int(replicas))

    def __call__(self, ctx: Any) -> Any:
        from daskdist.context import InputContext
        from daskdist.data import ArrowLoader

        batch = InputContext(num_replicas_in_sync=self.replicas).get_per_replica_batch_size(
            self.global_batch_size)
        return ArrowLoader(self.source, ctx, batch_size=batch, **self.options)


class _EpochIterator:
    """Starts a worker's loader on ``epoch`` (with the dataset's shuffle ``seed``) and
    iterates it. A static policy reads the share of ``pipelines`` (the workers when the
    epoch was set) of the worker's index; a worker that joined since reads none until the
    next epoch, so no file is read twice or skipped when the cluster grows."""

    def __init__(self, epoch: int, seed: int | None = None, pipelines: int | None = None):
        self.epoch = epoch
        self.seed = seed
        self.pipelines = pipelines

    def __call__(self, loader: Any) -> Iterator:
        if self.seed is not None:
            loader.seed = int(self.seed)
        if self.pipelines is not None and loader.policy != "dynamic":
            worker = loader.ctx.worker
            index = worker.worker_index if worker is not None else loader.ctx.input_pipeline_id
            loader.split(self.pipelines, index if index < self.pipelines else None)
        loader.set_epoch(self.epoch)
        return iter(loader)


class DistributedDataset(PerWorkerDataset):
    """Per-worker ArrowLoaders over shared shards (``Coordinator.distribute_dataset``).

    ``iter()`` gives iterators for the current epoch (``set_epoch`` changes it).
    Under ``policy="dynamic"``, ``progress()`` reports the epoch's acknowledged rows:
    loop over closures until ``progress()["complete"]``. ``state_dict()`` exports the
    epoch's ledger (epoch, seed, acknowledged rows as intervals, name) and
    ``load_state_dict()`` starts this dataset's epoch from one, on any coordinator.
    """

    def __init__(self, coordinator: DatasetCoordinator, values: PerWorkerValues,
                 source: Any, name: str = "", seed: int = 0):
        super().__init__(coordinator, values, name)
        self.source = source  # what its loaders read (data.sources.Source)
        self.shards = source.shards
        self.seed = int(seed)
        self.epoch = 0
        self._pipelines = max(1, coordinator.workers())  # static policies' split, per epoch
        self._bar: tuple[int, Any] | None = None  # (epoch, its progress bar), once shown

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` reads. Static policies split the files
        over the workers there now (a worker that joins later reads nothing until the
        next ``set_epoch``); ``"dynamic"`` needs no split."""
        self.epoch = int(epoch)
        self._pipelines = max(1, self._coordinator.workers(ask=True))

    def __iter__(self) -> PerWorkerValues:  # type: ignore[override]
        return self._coordinator.register_iterator(
            _EpochIterator(self.epoch, self.seed, self._pipelines), self.values)

    def progress(self, epoch: int | None = None, bar: bool = False) -> dict:
        """The dynamic policy's counts for ``epoch``: total, acknowledged, leased, free,
        complete. ``bar=True`` also shows them on a ``tqdm.auto`` bar (one per dataset).
        Raises ``dd.InputError`` once the epoch failed."""
        p = super().progress(self.epoch if epoch is None else int(epoch))
        if bar:
            self._bar = reprs.update_epoch_bar(self._bar, p)
        return p

    def state_dict(self) -> dict:
        """The current epoch's ledger: ``name``, ``epoch``, ``seed``, ``acknowledged``
        (row intervals), ``total`` and ``files`` (the shards' fingerprint); for a
        collection of partitions of unknown length, ``lengths`` too (those learned so
        far, run-length encoded), so a resumed epoch computes none of the partitions it
        already trained. Small: it grows with the acknowledged rows' fragmentation and
        the lengths' runs, never with the rows."""
        led = self._coordinator.ledger(self.dataset_id, self.epoch)
        out = {"name": self.name, "epoch": self.epoch, "seed": self.seed,
               "acknowledged": [[int(a), int(b)] for a, b in led.acknowledged],
               "total": int(led.total), "files": self.source.fingerprint()}
        if led.lengths is not None:
            out["lengths"] = [[int(n), int(k)] for n, k in led.lengths]
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue a ledger (:meth:`state_dict`, of this or an earlier dataset over the
        same files, on any coordinator): this dataset's epoch becomes the ledger's, its
        acknowledged rows are not read again. Call it before iterating that epoch
        (``ValueError`` once it started, or for other files)."""
        if state.get("files") != self.source.fingerprint():
            raise ValueError(f"the state is of dataset {state.get('name')!r} over other "
                             f"files than {self.shards!r} (fingerprints differ)")
        epoch = int(state["epoch"])
        lengths = state.get("lengths")
        ledger = EpochLedger(self.dataset_id, epoch,
                             [[int(a), int(b)] for a, b in state["acknowledged"]],
                             int(state["total"]),
                             None if lengths is None else [[int(n), int(k)]
                                                           for n, k in lengths])
        self._coordinator.start_epoch(ledger)
        self.epoch = epoch
        self.seed = int(state.get("seed", self.seed))

    def _repr_html_(self) -> str:
        return reprs.dataset_html(self)
