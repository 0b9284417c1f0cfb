"""daskdist: a Dask cluster as a fault-tolerant PyTorch training cluster."""

from daskdist.context import InputContext, WorkerContext, get_worker_context
from daskdist.errors import CancelledError, CollectiveError, InputError, WorkerLostError

__all__ = [
    "CancelledError",
    "CollectiveError",
    "InputContext",
    "InputError",
    "WorkerContext",
    "WorkerLostError",
    "get_worker_context",
]
