"""Collective groups and elastic state on Dask workers (SPEC §4).

Worker side only (imports torch). The scheduler plugin never imports this package;
it drives formation through worker RPCs that call the bootstrap functions:
``create_store`` on rank 0, then ``init_member`` on every member at once (a re-formation
whose rank 0 reported its ``spare_store_port`` opens the store inside rank 0's
``init_member``), ``mark_peer_lost`` when a peer leaves, ``destroy_member`` to leave.

Inside a closure: ``get_group()`` for collectives, ``broadcast_parameters`` /
``allreduce_gradients`` (or plain ``DistributedDataParallel``) for replicas, and
``State`` for elastic training, ``ShardedState`` for a model sharded over the group with
FSDP2 (imported when first named: it loads FSDP2 and DCP), ``synced(iterator)`` for the
end of an epoch.
"""

from typing import Any

from daskdist.client.group import CollectiveGroup
from daskdist.collective.bootstrap import (
    create_store,
    destroy_member,
    init_member,
    mark_peer_lost,
    spare_store_port,
)
from daskdist.collective.device import backend_for, bind_device
from daskdist.collective.group import Group, get_group
from daskdist.collective.replicas import allreduce_gradients, broadcast_parameters
from daskdist.collective.state.elastic import HostsUpdatedInterrupt, State
from daskdist.collective.step.synced import synced

__all__ = [
    "CollectiveGroup",
    "Group",
    "HostsUpdatedInterrupt",
    "ShardedState",
    "State",
    "allreduce_gradients",
    "backend_for",
    "bind_device",
    "broadcast_parameters",
    "create_store",
    "destroy_member",
    "get_group",
    "init_member",
    "mark_peer_lost",
    "spare_store_port",
    "synced",
]


def __getattr__(name: str) -> Any:
    if name == "ShardedState":
        from daskdist.collective.sharded.state import ShardedState

        globals()[name] = ShardedState
        return ShardedState
    raise AttributeError(f"module 'daskdist.collective' has no attribute {name!r}")
