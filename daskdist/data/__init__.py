"""Per-worker datasets from Arrow shards (SPEC §3).

- :class:`ArrowShards`: Parquet / Arrow IPC files as an ordered list of units.
- :class:`ArrowLoader`: batches of ``dict[str, torch.Tensor]`` for one input pipeline,
  with static sharding policies or the exactly-once ``"dynamic"`` policy.
- :class:`LeaseService` / :class:`LocalLeaseService`: what the dynamic policy talks to.

Each is imported when first named (as ``daskdist``'s own names are), so the pure
modules here (:mod:`.options`, :mod:`.sharding`) load without torch or pyarrow: the
client checks a dataset's options with them.
"""

from __future__ import annotations

import importlib
from typing import Any

from daskdist.context import InputContext

_LAZY = {
    "ArrowLoader": "daskdist.data.loader",
    "ArrowShards": "daskdist.data.files.arrow",
    "Unit": "daskdist.data.files.arrow",
    "LeaseService": "daskdist.data.leased.service",
    "LocalLeaseService": "daskdist.data.leased.service",
    "lease_token": "daskdist.data.leased.service",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'daskdist.data' has no attribute {name!r}")
    try:
        module = importlib.import_module(_LAZY[name])
    except AttributeError as e:  # raised inside the import: not "no such name here"
        raise ImportError(f"importing {_LAZY[name]} failed: {e!r}") from e
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ArrowLoader",
    "ArrowShards",
    "InputContext",
    "LeaseService",
    "LocalLeaseService",
    "Unit",
    "lease_token",
]
