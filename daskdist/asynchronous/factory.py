"""The per-worker resource behind ``am.replica``: what the client pickles once, and
each worker calls to build its replicas of the model.

Loads no torch: the client makes it; the replicas' module is imported on the worker.
"""

from __future__ import annotations

from typing import Any

from daskdist.asynchronous.spec import AsyncSpec


class ReplicaFactory:
    """The per-worker resource behind ``am.replica``: ``factory(ctx)`` is the worker's
    :class:`~daskdist.asynchronous.replica.ReplicaPool` (a replica per closure thread)."""

    def __init__(self, spec: AsyncSpec) -> None:
        self.spec = spec

    def __call__(self, ctx: Any) -> Any:
        from daskdist.asynchronous.replica import ReplicaPool

        return ReplicaPool(self.spec, ctx)
