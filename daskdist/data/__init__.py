"""Per-worker datasets from Arrow shards (SPEC §3).

- :class:`ArrowShards`: Parquet / Arrow IPC files as an ordered list of units.
- :class:`ArrowLoader`: batches of ``dict[str, torch.Tensor]`` for one input pipeline,
  with static sharding policies or the exactly-once ``"dynamic"`` policy.
- :class:`LeaseService` / :class:`LocalLeaseService`: what the dynamic policy talks to.
"""

from daskdist.context import InputContext
from daskdist.data.collections import source as _collections  # noqa: F401 - registers itself
from daskdist.data.files import source as _files  # noqa: F401 - registers itself
from daskdist.data.files.arrow import ArrowShards, Unit
from daskdist.data.leased.service import LeaseService, LocalLeaseService, lease_token
from daskdist.data.loader import ArrowLoader

__all__ = [
    "ArrowLoader",
    "ArrowShards",
    "InputContext",
    "LeaseService",
    "LocalLeaseService",
    "Unit",
    "lease_token",
]
