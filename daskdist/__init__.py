"""daskdist: a Dask cluster as a fault-tolerant PyTorch training cluster.

The public API, imported on first use: ``import daskdist`` loads neither Dask's
``distributed`` nor tornado nor torch (the scheduler unpickles its plugin through this
package, and the pure state machines in ``daskdist.core`` are used without Dask).
``Coordinator`` and the values come from ``daskdist.client``; ``daskdist.data`` and
``daskdist.collective`` (which import torch) are imported when first named.
``SPEC §N`` in the package's docstrings is section N of ``docs/spec.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from daskdist import config  # noqa: F401 - loads daskdist.yaml into dask.config
from daskdist.context import InputContext, WorkerContext, get_worker_context
from daskdist.core.protocol import Preemption
from daskdist.errors import (
    CancelledError,
    CollectiveError,
    CoordinatorClosedError,
    InputError,
    WorkerLostError,
)

__version__ = "0.1.0"

_LAZY = {
    "Coordinator": "daskdist.client.coordinator",
    "DistributedDataset": "daskdist.client.datasets",
    "PerWorkerDataset": "daskdist.client.datasets",
    "PerWorkerValues": "daskdist.client.closures",
    "RemoteValue": "daskdist.client.closures",
    "RemoteValueStatus": "daskdist.client.closures",
    "Report": "daskdist.client.report",
    "collective": None,
    "data": None,
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'daskdist' has no attribute {name!r}")
    module = _LAZY[name]
    if module is None:
        return importlib.import_module(f"daskdist.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CancelledError",
    "CollectiveError",
    "Coordinator",
    "CoordinatorClosedError",
    "DistributedDataset",
    "InputContext",
    "InputError",
    "PerWorkerDataset",
    "PerWorkerValues",
    "Preemption",
    "RemoteValue",
    "RemoteValueStatus",
    "Report",
    "WorkerContext",
    "WorkerLostError",
    "collective",
    "data",
    "get_worker_context",
]
