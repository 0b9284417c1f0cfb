"""LeaseBook: the dynamic datasets' book on the scheduler, and its routes.

The ``"dynamic"`` policy's leases (the pure :class:`~daskdist.core.leases.table.LeaseTable`)
and the checkpoint ledgers of the States that trained on them
(:class:`~daskdist.core.leases.ledgers.Ledgers`): the routes that define a dataset (files or a
Dask collection alike: :class:`~daskdist.core.protocol.DatasetDef`), lease, release and
report rows and learned unit lengths, start an epoch from a ledger, list an owner's
datasets, and export or restore a State's ledgers (:data:`LEASE_ROUTES`; their names
are the wire protocol). Where persisted partitions lie is the plugin's
:class:`~daskdist.plugins.scheduler.locality.Locality` (``locality``).
Acknowledgements ride closures' results (the closure book) and commits (the group
book), which reach the table through their coordinator; what this book needs of the
coordinator is :class:`LeaseCoordinator`. Runs on the scheduler's event loop; imports
nothing from Dask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from daskdist.core import checks
from daskdist.core.leases import resume
from daskdist.core.leases.ledgers import Ledgers
from daskdist.core.leases.partitions import MAX_UNITS
from daskdist.core.leases.table import EpochFailed, LeaseTable, SessionExpired
from daskdist.core.membership import Membership
from daskdist.core.protocol import (
    ANY,
    OWNER,
    OWNER_OR_SESSION,
    SESSION,
    SESSION_ENDED,
    DatasetDef,
    EpochLedger,
    Route,
)
from daskdist.plugins.scheduler.locality import Locality


class LeaseCoordinator(Protocol):
    """What the lease book asks its coordinator (the scheduler's ``CoordinatorState``)."""

    name: str
    members: Membership  # the shared membership: a session's worker, the member count
    helpers: set[str]  # workers that are not members (they compute partitions for them)

    def note_checkpoint(self, state: str, url: str, commits: int, seconds: float,
                        nbytes: int) -> None:
        """A State's writer completed a checkpoint (the dashboard's)."""


class LeaseBook:
    """Dynamic datasets: their lease tables and the ledgers checkpoints keep."""

    def __init__(self, co: LeaseCoordinator, max_worker_failures: int,
                 on_ack: Callable[[str, list[tuple[str, int]]], None] | None = None,
                 locality: Locality | None = None,
                 on_open: Callable[[str], None] | None = None) -> None:
        self.co = co
        # ``on_ack``: every acknowledgement, counted for the dashboard; ``on_open``: a
        # dataset's rows may go to any session again (closures set aside may run)
        self.leases = LeaseTable(on_ack=on_ack, max_failures=max_worker_failures,
                                 on_open=on_open)
        self.ledgers = Ledgers()  # the datasets each State trained (checkpoint ledgers)
        # where persisted partitions lie (the plugin's; None when the state is driven
        # without a scheduler)
        self.locality = locality

    # Arguments are checked first: a bad one is a TypeError / ValueError naming it,
    # raised to the caller, and changes nothing. The caller (a worker session, a client's
    # owner) is checked by the route (LEASE_ROUTES).

    def dataset_define(self, dataset: Any, owner: str | None = None, token: str | None = None,
                       session: str | None = None) -> dict:
        """Define a dynamic dataset's units once (:class:`DatasetDef`), from its owner's
        client (``distribute_dataset``; no units: registers a per-worker dataset) or a
        worker's loader (``session``); a differing definition is refused."""
        d = checks.named(dataset, "dataset", DatasetDef)
        dataset_id = checks.text(d.dataset_id, "dataset_id")
        label = checks.text(d.label, "label", empty=True)
        runs = checks.optional(checks.pairs, d.runs, "runs", checks.MAX_RUNS)
        seed = checks.integer(d.seed, "seed", -(1 << 63), (1 << 63) - 1)
        units = checks.optional(checks.integer, d.units, "units", 0, MAX_UNITS)
        shuffle = checks.flag(d.shuffle, "shuffle")
        whole = checks.flag(d.whole, "whole")
        holders = None
        if d.holders is not None:
            holders = list(checks.items(d.holders, "holders", MAX_UNITS))
            if len(holders) != units:
                raise ValueError(f"holders must name one key per unit ({units}), got "
                                 f"{len(holders)}")
        if runs is not None and sum(r * n for r, n in runs) > checks.MAX_ROWS:
            raise ValueError(f"dataset {dataset_id!r} has more than {checks.MAX_ROWS} rows")
        owner = "" if session is not None else owner
        if runs is None and units is None:
            self.leases.register(dataset_id, label, owner or "", seed)
            return {}
        self.leases.define(dataset_id, runs, label, owner or "", seed, units, shuffle, whole)
        self.ledgers.defined(dataset_id, self.leases)
        if holders is not None and self.locality is not None:
            self.locality.define(self.co.name, dataset_id, holders, seed, shuffle)
        return {}

    def lease_acquire(self, session: str, dataset_id: str, epoch: int, rows: int = 1,
                      least: int = 1, rate: float | None = None) -> dict:
        """Lease ``rows`` rows of an epoch to ``session`` (fewer, not under ``least``,
        near the epoch's end; a unit its worker holds first, for a persisted
        collection; ``rate``: the rows a second its loader consumes, which weighs its
        share): ``{"lease": intervals or None}``, ``SESSION_ENDED`` for an ended
        session, ``{"failed": why}`` when the epoch cannot complete."""
        dataset_id = checks.text(dataset_id, "dataset_id")
        epoch = checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH)
        rows = checks.integer(rows, "rows", 1, checks.MAX_ROWS)
        least = checks.integer(least, "least", 1, checks.MAX_ROWS)
        rate = checks.optional(checks.number, rate, "rate", 0.0, 1e15)
        co, table = self.co, self.leases
        parts = max(1, len(co.members))
        locality = self.locality
        try:
            if locality is not None and locality.indexed(co.name, dataset_id):
                # the tail rule comes before locality: the last partitions go to the
                # members holding less
                if table.holds_share(session, dataset_id, epoch, parts):
                    return {"lease": None}
                lease = locality.take(
                    co.name, dataset_id, co.members.members[session].address, epoch,
                    lambda u: table.acquire_unit(session, dataset_id, epoch, u))
                if lease is not None:
                    return {"lease": lease}
                locality.leased_elsewhere(co.name, dataset_id)
            lease = table.acquire(session, dataset_id, epoch, rows, parts=parts,
                                  least=least, tail=True, rate=rate)
        except SessionExpired:
            return SESSION_ENDED
        except EpochFailed as e:
            return {"failed": str(e)}
        return {"lease": lease}

    def lease_progress(self, dataset_id: str, epoch: int) -> dict:
        """An epoch's counts (read-only: never defines a table)."""
        return self.leases.progress(checks.text(dataset_id, "dataset_id"),
                                    checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH))

    def lease_release(self, session: str, dataset_id: str, epoch: int, ranges: Any,
                      failure: Any = None) -> int:
        """Rows a session gives back (``failure``: ``[source, message]`` of a failed
        read: deferred, the failure counted); rows freed."""
        dataset_id = checks.text(dataset_id, "dataset_id")
        epoch = checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH)
        ranges = checks.pairs(ranges, "ranges", checks.MAX_RANGES)
        if failure is not None:
            if not isinstance(failure, (list, tuple)) or len(failure) != 2:
                raise TypeError(f"failure must be [source, message], got {failure!r:.80}")
            failure = (checks.text(failure[0], "failure source", 4096),
                       checks.text(failure[1], "failure message", 16384))
        return self.leases.release(session, dataset_id, epoch, ranges, failure)

    def unit_length(self, session: str, dataset_id: str, epoch: int, unit: int,
                    length: int) -> dict:
        """``session`` read unit ``unit`` (a computed partition): ``length`` rows.
        ``{"failed": why}`` when it differs from the length learned before (the epoch
        fails)."""
        dataset_id = checks.text(dataset_id, "dataset_id")
        epoch = checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH)
        unit = checks.integer(unit, "unit", 0, MAX_UNITS)
        length = checks.integer(length, "length", 0, checks.MAX_ROWS)
        why = resume.set_length(self.leases, session, dataset_id, epoch, unit, length)
        return {} if why is None else {"failed": why}

    def dataset_helpers(self, session: str) -> list[str]:
        """Workers that are not members of a coordinator restricted by ``resources=`` or
        ``members=`` (they compute partitions for the members): those whose plugin said
        so; ``[]`` without a restriction."""
        return sorted(self.co.helpers)

    def dataset_state(self, dataset_id: str, epoch: int) -> tuple:
        """The epoch's acknowledged rows (an :class:`EpochLedger`), for resuming."""
        dataset_id = checks.text(dataset_id, "dataset_id")
        epoch = checks.integer(epoch, "epoch", 0, checks.MAX_EPOCH)
        p = self.leases.progress(dataset_id, epoch)
        return tuple(EpochLedger(dataset_id, epoch,
                                 self.leases.acknowledged(dataset_id, epoch),
                                 # its row ids (a collection's of unknown lengths: STRIDE
                                 # per partition)
                                 p.get("ids", p["total"]),
                                 self.leases.known_lengths(dataset_id)))

    def dataset_start(self, owner: str, token: str, ledger: Any) -> dict:
        """Start an epoch with the rows of ``ledger`` (an :class:`EpochLedger`) already
        acknowledged, a collection's lengths learned first (its partitions whose rows
        were all acknowledged are never computed again); refused once the epoch has
        started. Its progress."""
        fields = len(EpochLedger._fields)
        if not isinstance(ledger, (list, tuple)) or not fields - 1 <= len(ledger) <= fields:
            raise TypeError(f"ledger must be an EpochLedger {EpochLedger._fields}")
        led = EpochLedger(*ledger)  # without lengths: a ledger of files (or from before)
        dataset_id = checks.text(led.dataset_id, "dataset_id")
        epoch = checks.integer(led.epoch, "epoch", 0, checks.MAX_EPOCH)
        acked = checks.pairs(led.acknowledged, "acknowledged", checks.MAX_RANGES)
        lengths = checks.optional(checks.pairs, led.lengths, "lengths", checks.MAX_RUNS, -1)
        p = self.leases.progress(dataset_id, epoch)
        total = p.get("ids", p["total"])
        if checks.integer(led.total, "total", 0, checks.MAX_ROWS) != total:
            raise ValueError(f"the ledger is of {led.total} rows; dataset {dataset_id!r} "
                             f"has {total}")
        self.resume(dataset_id, epoch, acked, lengths)
        return self.leases.progress(dataset_id, epoch)

    def resume(self, dataset_id: str, epoch: int, acknowledged: list,
               lengths: list | None = None) -> None:
        """Start ``epoch`` with ``acknowledged`` rows (checked), a collection's
        ``lengths`` learned first; ``ValueError`` when they do not fit the dataset or
        the epoch has started."""
        if lengths:
            resume.learn_lengths(self.leases, dataset_id, lengths)
        resume.start_epoch(self.leases, dataset_id, epoch, acknowledged)

    # -- durable commits: checkpoint ledgers (SPEC §4.3) ----------------------------------
    def owner_datasets(self, owner: str, token: str) -> list[tuple[str, str, int]]:
        """The owner's datasets (``Coordinator.datasets()``, an attached client's too):
        ``(dataset id, label, newest epoch)`` each (a dataset's further loaders,
        ``<id>.<k>``, go with it)."""
        newest = self.leases.newest_epochs()
        return [(d, ds.label, newest.get(d, 0)) for d, ds in self.leases.datasets.items()
                if ds.owner == owner and "." not in d]

    def dataset_ledger(self, session: str, state: str) -> dict:
        """The ledger of State ``state``'s dynamic datasets now, by name (a checkpoint
        written at the State's current commit keeps it)."""
        return self.ledgers.export(checks.text(state, "state", 1024), self.leases)

    def restore_ledger(self, session: str, state: str, ledger: Any) -> list | dict:
        """State ``state`` resumed from a checkpoint: its datasets' epochs go on from
        ``ledger`` (a name not defined yet waits for its dataset). The ids restored."""
        if not isinstance(ledger, dict) or len(ledger) > 1024:
            raise TypeError(f"ledger must be a dict of at most 1024 datasets, got "
                            f"{type(ledger).__name__}")
        return self.ledgers.restore(checks.text(state, "state", 1024), ledger, self.leases)

    def checkpoint_written(self, session: str, state: str, url: str, commits: int,
                           seconds: float, nbytes: int) -> dict | None:
        """A State's writer reports a complete checkpoint (dashboard and metrics)."""
        self.co.note_checkpoint(checks.text(state, "state", 1024),
                                checks.text(url, "url", 4096),
                                checks.integer(commits, "commits", 0, checks.MAX_ROWS),
                                float(seconds),
                                checks.integer(nbytes, "nbytes", 0, checks.MAX_ROWS))
        return None

    def forget_datasets(self, dataset_ids: list[str]) -> list[str]:
        """Their handles were dropped: their lease tables, completed epochs and
        locality indexes go. The ids gone (those of their further loaders too)."""
        gone = [d for dataset_id in dataset_ids for d in self.leases.forget(dataset_id)]
        if self.locality is not None:
            self.locality.forget(self.co.name, gone)
        return gone

    def settle_tokens(self, session: str, tokens: list, ack: bool) -> bool:
        """A finished closure's lease tokens: acknowledged (``ack``: it completed) or
        released. ``False`` when the table refused the acknowledgement (rows the session
        does not hold): what it does hold is released rather than kept leased."""
        if ack and self.leases.ack_tokens(session, tokens):
            return True
        self.leases.release_tokens(session, tokens)
        return not ack


# The lease book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler): a message's name leads here, beside its method. A loader's
# call after its coordinator closed gets SESSION_ENDED: its session ended with it
# (nothing to lease, nothing to give back).
LEASE_ROUTES = {
    "daskdist_dataset_define": Route(LeaseBook.dataset_define, caller=OWNER_OR_SESSION),
    "daskdist_dataset_state": Route(LeaseBook.dataset_state, caller=ANY),
    "daskdist_dataset_start": Route(LeaseBook.dataset_start, caller=OWNER),
    "daskdist_datasets": Route(LeaseBook.owner_datasets, caller=OWNER),
    "daskdist_lease_acquire": Route(LeaseBook.lease_acquire, SESSION_ENDED, SESSION),
    "daskdist_lease_progress": Route(LeaseBook.lease_progress, caller=ANY),
    "daskdist_lease_release": Route(LeaseBook.lease_release, SESSION_ENDED, SESSION),
    "daskdist_unit_length": Route(LeaseBook.unit_length, SESSION_ENDED, SESSION),
    "daskdist_dataset_helpers": Route(LeaseBook.dataset_helpers, [], SESSION, []),
    "daskdist_dataset_ledger": Route(LeaseBook.dataset_ledger, caller=SESSION),
    "daskdist_restore_ledger": Route(LeaseBook.restore_ledger, caller=SESSION),
    "daskdist_checkpoint_written": Route(LeaseBook.checkpoint_written, caller=SESSION),
}
