"""ResourceBook: a coordinator's per-worker resources on the scheduler, and their routes.

A per-worker resource (``create_per_worker_resource``, a dataset, its iterators) is a
spec its owner's client registers once (opaque bytes: pickled on the client, built on
each worker); a worker asks for the spec of one it needs, and a warming session builds
them all before it joins the group. Released when its owner drops it or leaves: then
forgotten here and on every worker, a dataset's lease tables with it (a dataset's
identity is its resource id), and an asynchronous model with its replicas. Its routes
are :data:`RESOURCE_ROUTES`; what it asks its coordinator is
:class:`ResourceCoordinator`. Runs on the scheduler's event loop; imports nothing from
Dask.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from daskdist.core import checks
from daskdist.core.protocol import OWNER, SESSION, Route


class ResourceCoordinator(Protocol):
    """What the resource book asks its coordinator (the scheduler's ``CoordinatorState``)."""

    name: str

    def broadcast(self, msg: dict, sessions: Iterable[str] | None = None,
                  addressed: bool = False) -> None: ...

    def resources_released(self, rids: list[str]) -> None:
        """These resources' handles were dropped: what is made of them goes (a dataset's
        lease tables, an asynchronous model whose replicas they were)."""


class ResourceBook:
    """Per-worker resources' specs by id, and the owner that registered each."""

    def __init__(self, co: ResourceCoordinator) -> None:
        self.co = co
        self.specs: dict[str, bytes] = {}
        self.owners: dict[str, str] = {}  # rid -> the owner that registered it
        self.released = 0  # resources released so far

    def add(self, owner: str, rid: str, payload: bytes) -> None:
        self.specs[rid] = payload
        self.owners[rid] = owner

    def warm(self) -> list[str]:
        """The resources a joining session builds before it joins the group (its
        datasets' iterators are built when a closure needs them)."""
        return [rid for rid in self.specs if not rid.startswith("iterator-")]

    def release(self, rids: list[str]) -> None:
        """Forget per-worker resources here and on every worker (their objects and
        iterators are closed there)."""
        rids = [rid for rid in rids if self.specs.pop(rid, None) is not None]
        for rid in rids:
            self.owners.pop(rid, None)
        self.co.resources_released(rids)  # a dataset's identity is its resource id
        if rids:
            self.released += len(rids)
            self.co.broadcast({"op": "daskdist-release", "name": self.co.name, "rids": rids})

    def release_owner(self, owner: str) -> None:
        """``owner`` left: every resource it registered is released."""
        self.release([rid for rid, o in self.owners.items() if o == owner])

    # -- routes ------------------------------------------------------------------------
    def resource_add(self, owner: str, token: str, rid: str, payload: bytes) -> None:
        """Register a per-worker resource's spec (one-way)."""
        op = "daskdist_add_resource"
        checks.text(rid, f"{op}: rid")
        if not isinstance(payload, bytes):
            raise TypeError(f"{op}: payload must be bytes, got {type(payload).__name__}")
        if self.owners.get(rid, owner) != owner:
            raise PermissionError(f"{op}: resource {rid!r} is another owner's")
        self.add(owner, rid, payload)

    def resource_get(self, session: str, rid: str) -> bytes | None:
        """A worker session's per-worker resource spec (``None``: released or unknown)."""
        return self.specs.get(checks.text(rid, "daskdist_get_resource: rid"))

    def resource_release(self, owner: str, token: str, rids: list) -> None:
        """The client dropped these per-worker resources: forget them here and on every
        worker (one-way; the client sends it once no closure can still use them)."""
        rids = checks.texts(rids, "daskdist_release_resources: rids")
        self.release([rid for rid in rids if self.owners.get(rid) == owner])


# The resource book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler); the caller is checked by the route.
RESOURCE_ROUTES = {
    "daskdist_add_resource": Route(ResourceBook.resource_add, caller=OWNER),
    "daskdist_get_resource": Route(ResourceBook.resource_get, caller=SESSION, ended=None),
    "daskdist_release_resources": Route(ResourceBook.resource_release, caller=OWNER),
}
