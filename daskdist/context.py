"""What a closure and a per-worker factory know about where they run: the worker's
:class:`WorkerContext`, a dataset factory's :class:`InputContext`, and
:func:`get_worker_context` (the context of the closure running in this thread)."""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any

from daskdist.core.protocol import Preemption
from daskdist.session.preemption import preemption_of
from daskdist.session.scope import closure_scope_now


@dataclass(frozen=True)
class WorkerContext:
    """The worker a closure runs on, as seen by that closure (SPEC §2.2)."""

    worker_index: int
    num_workers: int
    device: Any  # torch.device; typed loosely so this module needs no torch import
    address: str
    attempt: int = 1
    name: str = "default"

    @property
    def preemption(self) -> Preemption | None:
        """``None``, or ``Preemption(deadline, reason)`` once this worker has been told
        it will be taken away (``deadline`` in epoch seconds): read it in a long
        closure to stop in time. Read afresh each time (a notice may come while the
        closure runs)."""
        return preemption_of(self.address)


@dataclass
class InputContext:
    """What a per-worker dataset factory receives (TensorFlow's ``tf.distribute.InputContext``).

    ``num_input_pipelines`` pipelines in all (one per worker), this one is
    ``input_pipeline_id``; ``num_replicas_in_sync`` replicas consume the global batch.
    ``worker`` is the worker's :class:`WorkerContext` when built by a worker plugin.
    ``services`` are the scheduler services of the worker session the dataset is built
    for (the ``"dynamic"`` policy's leases, among them: set by the worker plugin), or a
    :class:`~daskdist.data.LocalLeaseService` outside a coordinator, or ``None``.
    ``leases=`` is its former, deprecated name.
    ``dataset_id`` is the identity of the per-worker dataset being built (the call that
    made it, the same on every worker; ``None`` outside a coordinator): loaders take
    theirs from it (:meth:`next_dataset_id`).
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1
    worker: WorkerContext | None = None
    services: Any = None
    extra: dict = field(default_factory=dict)
    dataset_id: str | None = None
    _loaders: int = field(default=0, repr=False, compare=False)
    leases: InitVar[Any] = None  # deprecated: services=

    def __post_init__(self, leases: Any = None) -> None:
        if leases is not None and leases is not self.services:  # (replace() passes both)
            warnings.warn("InputContext(leases=...) is deprecated; pass services=...",
                          DeprecationWarning, stacklevel=3)
            if self.services is None:
                self.services = leases
        if self.num_input_pipelines < 1:
            raise ValueError(f"num_input_pipelines must be >= 1, got {self.num_input_pipelines}")
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id {self.input_pipeline_id} is outside "
                f"[0, {self.num_input_pipelines})"
            )
        if self.num_replicas_in_sync < 1:
            raise ValueError(f"num_replicas_in_sync must be >= 1, got {self.num_replicas_in_sync}")

    @property
    def device(self) -> Any:
        """The worker's device (``torch.device``), CPU outside a worker."""
        if self.worker is not None:
            return self.worker.device
        import torch

        return torch.device("cpu")

    def next_dataset_id(self) -> str | None:
        """The dataset id of the next loader built with this context: ``dataset_id`` for
        the first, ``"<dataset_id>.<k>"`` for the k-th after it (a factory that builds
        a training and an evaluation loader gets two datasets); ``None`` outside a
        coordinator."""
        if self.dataset_id is None:
            return None
        k, self._loaders = self._loaders, self._loaders + 1
        return self.dataset_id if k == 0 else f"{self.dataset_id}.{k}"

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Split a global batch evenly over the replicas (TensorFlow's rule: it must divide)."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by "
                f"num_replicas_in_sync {self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


def _deprecated_leases(self: InputContext) -> Any:
    """``ctx.leases``: the former name of :attr:`InputContext.services` (deprecated; read
    without a warning, since ``dataclasses.replace`` reads it too)."""
    return self.services


InputContext.leases = property(_deprecated_leases)  # type: ignore[assignment]


def get_worker_context() -> WorkerContext:
    """The context of the closure running in this thread; ``RuntimeError`` outside one."""
    scope = closure_scope_now()
    if scope is None or scope.context is None:
        raise RuntimeError("get_worker_context() must be called inside a daskdist closure")
    return scope.context


