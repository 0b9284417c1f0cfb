"""Dask collections on the scheduler (SPEC §3.2): their definition, partition leases
(a partition the member's own worker holds first), learned lengths, and the workers
that compute partitions for the members of a coordinator restricted by ``resources=``
or ``members=``.

The lease table keeps the rows (``core/leases.py``); this module adds what needs Dask's
scheduler: a :class:`~daskdist.core.locality.LocalityIndex` per persisted collection,
built once from ``Scheduler.tasks[key].who_has`` when the collection is defined and
checked lazily when a partition comes up (so an acquire costs O(1) amortized, whatever
the number of partitions), and the non-member workers, which the coordinator keeps as
they say so (no scan of all workers per call).
Never imports torch, pyarrow or ``collective/``.
"""

from __future__ import annotations

import time
from typing import Any

from daskdist.core import protocol
from daskdist.core.leases import EpochFailed, SessionExpired
from daskdist.core.locality import LocalityIndex
from daskdist.core.partitions import MAX_UNITS
from daskdist.core.protocol import SESSION_ENDED, CollectionDef


def _key(value: Any) -> Any:
    """A Dask key from the wire (a tuple may arrive as a list)."""
    if isinstance(value, list):
        return tuple(_key(v) for v in value)
    return value


class CollectionHandlers:
    """The collection handlers of one scheduler plugin (see the module doc)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        # (coordinator, dataset id) -> (its locality index, the holder key per partition)
        self.indexes: dict[tuple[str, str], tuple[LocalityIndex, list]] = {}
        self.local_leases = 0  # partitions leased to the member holding them
        self.other_leases = 0  # partitions of persisted collections leased elsewhere

    def handlers(self) -> dict:
        return {
            "daskdist_collection_define": self.define,
            "daskdist_partition_acquire": self.acquire,
            "daskdist_partition_length": self.length,
            "daskdist_collection_helpers": self.helpers_of,
        }

    # -- definition ------------------------------------------------------------------
    def define(self, name: str, dataset: Any, owner: str | None = None,
               token: str | None = None, session: str | None = None) -> dict:
        """Define a collection's partitions (:class:`CollectionDef`) from its owner's
        client (``distribute_dataset``) or a worker's loader (``session``); a differing
        definition is refused. A persisted collection's locality index is built here,
        once."""
        co = self.plugin._get(name)
        d = protocol.named(dataset, "dataset", CollectionDef)
        dataset_id = protocol.text(d.dataset_id, "dataset_id")
        label = protocol.text(d.label, "label", empty=True)
        units = protocol.integer(d.units, "units", 0, MAX_UNITS)
        runs = protocol.optional(protocol.pairs, d.runs, "runs", protocol.MAX_RUNS)
        seed = protocol.integer(d.seed, "seed", -(1 << 63), (1 << 63) - 1)
        shuffle = protocol.flag(d.shuffle, "shuffle")
        holders = None
        if d.holders is not None:
            holders = list(protocol.items(d.holders, "holders", MAX_UNITS))
            if len(holders) != units:
                raise ValueError(f"holders must name one key per partition ({units}), got "
                                 f"{len(holders)}")
        if runs is not None and sum(r * n for r, n in runs) > protocol.MAX_ROWS:
            raise ValueError(f"dataset {dataset_id!r} has more than {protocol.MAX_ROWS} rows")
        if session is not None:
            if protocol.text(session, "session") not in co.members:
                return SESSION_ENDED
            owner = ""
        else:
            co.closure_book.owner_box(protocol.text(owner, "owner"), protocol.text(token, "token"))
        co.leases.define_collection(dataset_id, units, runs, label, owner or "", seed,
                                    shuffle)
        co.ledgers.defined(dataset_id, co.leases)
        self._prune(name, co)
        if holders is not None and (name, dataset_id) not in self.indexes:
            keys = [_key(k) for k in holders]
            self.indexes[(name, dataset_id)] = (
                LocalityIndex(self._holders(keys), seed, shuffle), keys)
        return {}

    def _holders(self, keys: list) -> list[tuple[int, list[str]]]:
        """Where each partition's persisted key is now (one pass, at definition)."""
        tasks = self.plugin.scheduler.tasks
        out = []
        for unit, key in enumerate(keys):
            ts = tasks.get(key) if key is not None else None
            if ts is not None and ts.who_has:
                out.append((unit, [ws.address for ws in ts.who_has]))
        return out

    def _prune(self, name: str, co: Any) -> None:
        """Forget the indexes of datasets that are gone (their handle dropped, their
        coordinator closed): O(indexes), on a definition only."""
        states = self.plugin.coordinators
        for key in [k for k in self.indexes
                    if k[0] not in states or k[1] not in states[k[0]].leases.datasets]:
            del self.indexes[key]

    # -- leases ------------------------------------------------------------------------
    def acquire(self, name: str, session: str, dataset_id: str, epoch: int) -> dict:
        """Lease one partition's free rows to ``session``: one its worker holds if any
        (read from its own memory), else the next in the collection's order; none while
        it holds its share of the rows not yet acknowledged (the tail rule's hold-back:
        the last partitions go to the members holding less; a partition is never split).
        ``{"lease": intervals or None}``, ``SESSION_ENDED`` (also once the
        coordinator closed), ``{"failed": why}``."""
        co = self.plugin.coordinators.get(protocol.text(name, "name"))
        if co is None:
            return SESSION_ENDED
        session = protocol.text(session, "session")
        dataset_id = protocol.text(dataset_id, "dataset_id")
        epoch = protocol.integer(epoch, "epoch", 0, protocol.MAX_EPOCH)
        if not co.members.renew(session, time.monotonic()):
            return SESSION_ENDED
        table = co.leases
        parts = max(1, len(co.members))
        try:
            lease = None
            found = self.indexes.get((name, dataset_id))
            member = co.members.members.get(session)
            if table.holds_share(session, dataset_id, epoch, parts):
                return {"lease": None}  # the tail rule: the rows go to members holding less
            if found is not None and member is not None:
                index, keys = found
                scheduler = self.plugin.scheduler
                ws = scheduler.workers.get(member.address)

                def held_there(unit: int) -> bool:
                    ts = scheduler.tasks.get(keys[unit])
                    return ts is not None and ws is not None and ws in ts.who_has

                lease = index.take(member.address, epoch,
                                   lambda u: table.acquire_unit(session, dataset_id, epoch, u),
                                   held_there)
                if lease is not None:
                    self.local_leases += 1
            if lease is None:
                lease = table.acquire(session, dataset_id, epoch, 1, parts=parts, least=1,
                                      tail=True)  # whole partitions: never split
                if lease is not None and found is not None:
                    self.other_leases += 1
        except SessionExpired:
            return SESSION_ENDED
        except EpochFailed as e:
            return {"failed": str(e)}
        return {"lease": lease}

    def length(self, name: str, session: str, dataset_id: str, epoch: int, unit: int,
               length: int) -> dict:
        """``session`` computed partition ``unit``: ``length`` rows. ``{"failed": why}``
        when it differs from the length learned before (the epoch fails);
        ``SESSION_ENDED`` from an ended session or a closed coordinator."""
        co = self.plugin.coordinators.get(protocol.text(name, "name"))
        if co is None:
            return SESSION_ENDED
        session = protocol.text(session, "session")
        dataset_id = protocol.text(dataset_id, "dataset_id")
        epoch = protocol.integer(epoch, "epoch", 0, protocol.MAX_EPOCH)
        unit = protocol.integer(unit, "unit", 0, MAX_UNITS)
        length = protocol.integer(length, "length", 0, protocol.MAX_ROWS)
        if not co.members.renew(session, time.monotonic()):
            return SESSION_ENDED
        why = co.leases.set_length(session, dataset_id, epoch, unit, length)
        return {} if why is None else {"failed": why}

    # -- members and helpers (resources=, members=) ---------------------------------------
    def helpers_of(self, name: str, session: str) -> list[str]:
        """Workers that are not members of a coordinator restricted by ``resources=`` or
        ``members=`` (they compute partitions for the members): the ones whose plugin
        said so (the plugin keeps ``helpers``); ``[]`` without a restriction."""
        co = self.plugin._get(name)
        protocol.text(session, "session")
        return sorted(co.helpers)
