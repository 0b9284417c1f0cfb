"""daskdist: a Dask cluster as a fault-tolerant PyTorch training cluster.

``daskdist.data`` and ``daskdist.collective`` are imported on first use, so that
importing the package (as the scheduler does for its plugin) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from daskdist import config  # noqa: F401 - loads daskdist.yaml into dask.config
from daskdist.context import InputContext, WorkerContext, get_worker_context
from daskdist.coordinator import Coordinator, DistributedDataset, PerWorkerDataset
from daskdist.errors import CancelledError, CollectiveError, InputError, WorkerLostError
from daskdist.values import PerWorkerValues, RemoteValue, RemoteValueStatus

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("data", "collective")


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"daskdist.{name}")
    raise AttributeError(f"module 'daskdist' has no attribute {name!r}")


__all__ = [
    "CancelledError",
    "CollectiveError",
    "Coordinator",
    "InputContext",
    "InputError",
    "DistributedDataset",
    "PerWorkerDataset",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
    "WorkerContext",
    "WorkerLostError",
    "collective",
    "data",
    "get_worker_context",
]
