"""LeaseBook: the dynamic datasets' book on the scheduler, and its handlers.

The ``"dynamic"`` policy's leases (the pure :class:`~daskdist.core.leases.LeaseTable`)
and the checkpoint ledgers of the States that trained on them
(:class:`~daskdist.core.ledgers.Ledgers`): the handlers that define a dataset, lease,
release and report rows, start an epoch from a ledger, and export or restore a State's
ledgers (:data:`LEASE_HANDLERS`, registered by the plugin as they are; their names are
the wire protocol). Acknowledgements ride closures' results (the closure book) and
commits (the group book). Runs on the scheduler's event loop; imports nothing from Dask.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from daskdist.core import protocol
from daskdist.core.leases import EpochFailed, LeaseTable, SessionExpired
from daskdist.core.ledgers import Ledgers
from daskdist.core.protocol import SESSION_ENDED, DatasetDef, EpochLedger

if TYPE_CHECKING:
    from daskdist.plugins.scheduler.state import CoordinatorState


class LeaseBook:
    """Dynamic datasets: their lease tables and the ledgers checkpoints keep."""

    def __init__(self, co: CoordinatorState, max_worker_failures: int) -> None:
        self.co = co
        self.leases = LeaseTable(  # every acknowledgement is counted for the dashboard
            on_ack=co.stats.on_rows,
            max_failures=max_worker_failures)
        self.ledgers = Ledgers()  # the datasets each State trained (checkpoint ledgers)

    # -- dynamic datasets: the lease handlers (registered by the plugin as they are) -------
    # Worker calls name their session and are refused once it ended
    # (``SESSION_ENDED``); client calls name their owner. Arguments are checked first: a bad one is
    # a TypeError / ValueError naming it, raised to the caller, and changes nothing.

    def dataset_define(self, dataset: Any, owner: str | None = None, token: str | None = None,
                       session: str | None = None) -> dict:
        """Define a dynamic dataset's units once (:class:`DatasetDef`), from its owner's
        client (``distribute_dataset``; ``runs=None`` registers a per-worker dataset)
        or a worker's loader (``session``); a differing definition is refused."""
        d = protocol.named(dataset, "dataset", DatasetDef)
        dataset_id = protocol.text(d.dataset_id, "dataset_id")
        label = protocol.text(d.label, "label", empty=True)
        runs = protocol.optional(protocol.pairs, d.runs, "runs", protocol.MAX_RUNS)
        seed = protocol.integer(d.seed, "seed", -(1 << 63), (1 << 63) - 1)
        if runs is not None and sum(r * n for r, n in runs) > protocol.MAX_ROWS:
            raise ValueError(f"dataset {dataset_id!r} has more than {protocol.MAX_ROWS} rows")
        if session is not None:
            if not self.co.live_session(session):
                return SESSION_ENDED
            owner = ""
        else:
            self.co.closure_book.owner_box(protocol.text(owner, "owner"),
                                           protocol.text(token, "token"))
        if runs is None:
            self.leases.register(dataset_id, label, owner, seed)
        else:
            self.leases.define(dataset_id, runs, label, owner, seed)
            self.ledgers.defined(dataset_id, self.leases)
        return {}

    def lease_acquire(self, session: str, dataset_id: str, epoch: int, rows: int,
                      least: int = 1) -> dict:
        """Lease ``rows`` rows of an epoch to ``session`` (fewer, not under ``least``,
        near the epoch's end): ``{"lease": intervals or None}``, ``SESSION_ENDED``
        for an ended session, ``{"failed": why}`` when the epoch cannot complete."""
        session = protocol.text(session, "session")
        dataset_id = protocol.text(dataset_id, "dataset_id")
        epoch = protocol.integer(epoch, "epoch", 0, protocol.MAX_EPOCH)
        rows = protocol.integer(rows, "rows", 1, protocol.MAX_ROWS)
        least = protocol.integer(least, "least", 1, protocol.MAX_ROWS)
        if not self.co.members.renew(session, time.monotonic()):
            return SESSION_ENDED
        try:
            lease = self.leases.acquire(session, dataset_id, epoch, rows,
                                        parts=max(1, len(self.co.members)), least=least,
                                        tail=True)
        except SessionExpired:
            return SESSION_ENDED
        except EpochFailed as e:
            return {"failed": str(e)}
        return {"lease": lease}

    def lease_progress(self, dataset_id: str, epoch: int) -> dict:
        """An epoch's counts (read-only: never defines a table)."""
        return self.leases.progress(protocol.text(dataset_id, "dataset_id"),
                                    protocol.integer(epoch, "epoch", 0, protocol.MAX_EPOCH))

    def lease_release(self, session: str, dataset_id: str, epoch: int, ranges: Any,
                      failure: Any = None) -> int | dict:
        """Rows a session gives back (``failure``: ``[file, message]`` of a failed read):
        rows freed (``SESSION_ENDED`` from a session that ended)."""
        session = protocol.text(session, "session")
        dataset_id = protocol.text(dataset_id, "dataset_id")
        epoch = protocol.integer(epoch, "epoch", 0, protocol.MAX_EPOCH)
        ranges = protocol.pairs(ranges, "ranges", protocol.MAX_RANGES)
        if failure is not None:
            if not isinstance(failure, (list, tuple)) or len(failure) != 2:
                raise TypeError(f"failure must be [file, message], got {failure!r:.80}")
            failure = (protocol.text(failure[0], "failure file", 4096),
                       protocol.text(failure[1], "failure message", 16384))
        if session not in self.co.members:
            return SESSION_ENDED
        return self.leases.release(session, dataset_id, epoch, ranges, failure)

    def dataset_state(self, dataset_id: str, epoch: int) -> tuple:
        """The epoch's acknowledged rows (an :class:`EpochLedger`), for resuming."""
        dataset_id = protocol.text(dataset_id, "dataset_id")
        epoch = protocol.integer(epoch, "epoch", 0, protocol.MAX_EPOCH)
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
        self.co.closure_book.owner_box(protocol.text(owner, "owner"), protocol.text(token, "token"))
        fields = len(EpochLedger._fields)
        if not isinstance(ledger, (list, tuple)) or not fields - 1 <= len(ledger) <= fields:
            raise TypeError(f"ledger must be an EpochLedger {EpochLedger._fields}")
        led = EpochLedger(*ledger)  # without lengths: a ledger of files (or from before)
        dataset_id = protocol.text(led.dataset_id, "dataset_id")
        epoch = protocol.integer(led.epoch, "epoch", 0, protocol.MAX_EPOCH)
        acked = protocol.pairs(led.acknowledged, "acknowledged", protocol.MAX_RANGES)
        lengths = protocol.optional(protocol.pairs, led.lengths, "lengths", protocol.MAX_RUNS, -1)
        p = self.leases.progress(dataset_id, epoch)
        total = p.get("ids", p["total"])
        if protocol.integer(led.total, "total", 0, protocol.MAX_ROWS) != total:
            raise ValueError(f"the ledger is of {led.total} rows; dataset {dataset_id!r} "
                             f"has {total}")
        if lengths:
            self.leases.learn_lengths(dataset_id, lengths)
        self.leases.start_epoch(dataset_id, epoch, acked)
        return self.leases.progress(dataset_id, epoch)

    # -- durable commits: checkpoint ledgers (SPEC §4.3) ----------------------------------
    def dataset_ledger(self, session: str, state: str) -> dict:
        """The ledger of State ``state``'s dynamic datasets now, by name (a checkpoint
        written at the State's current commit keeps it)."""
        if not self.co.live_session(session):
            return SESSION_ENDED
        return self.ledgers.export(protocol.text(state, "state", 1024), self.leases)

    def restore_ledger(self, session: str, state: str, ledger: Any) -> list | dict:
        """State ``state`` resumed from a checkpoint: its datasets' epochs go on from
        ``ledger`` (a name not defined yet waits for its dataset). The ids restored."""
        if not self.co.live_session(session):
            return SESSION_ENDED
        if not isinstance(ledger, dict) or len(ledger) > 1024:
            raise TypeError(f"ledger must be a dict of at most 1024 datasets, got "
                            f"{type(ledger).__name__}")
        return self.ledgers.restore(protocol.text(state, "state", 1024), ledger, self.leases)

    def checkpoint_written(self, session: str, state: str, url: str, commits: int,
                           seconds: float, nbytes: int) -> dict | None:
        """A State's writer reports a complete checkpoint (dashboard and metrics)."""
        if not self.co.live_session(session):
            return SESSION_ENDED
        self.co.stats.on_checkpoint(protocol.text(state, "state", 1024),
                                    protocol.text(url, "url", 4096),
                                    protocol.integer(commits, "commits", 0, protocol.MAX_ROWS),
                                    float(seconds),
                                    protocol.integer(nbytes, "nbytes", 0, protocol.MAX_ROWS))
        return None

    def forget_datasets(self, dataset_ids: list[str]) -> None:
        """Their handles were dropped: their lease tables and completed epochs go."""
        for dataset_id in dataset_ids:
            self.leases.forget(dataset_id)


# The lease book's handlers (the plugin registers each as ``method(book, **kwargs)`` on
# the named coordinator's book): a message's name leads here, beside its method.
LEASE_HANDLERS = {
    "daskdist_dataset_define": (LeaseBook.dataset_define, protocol.CLOSED),
    "daskdist_dataset_state": (LeaseBook.dataset_state, protocol.CLOSED),
    "daskdist_dataset_start": (LeaseBook.dataset_start, protocol.CLOSED),
    # a loader's lease or give-back after its coordinator closed: its session ended with
    # it (nothing to lease, nothing to give back), as the collection handlers answer
    "daskdist_lease_acquire": (LeaseBook.lease_acquire, SESSION_ENDED),
    "daskdist_lease_progress": (LeaseBook.lease_progress, protocol.CLOSED),
    "daskdist_lease_release": (LeaseBook.lease_release, SESSION_ENDED),
    "daskdist_dataset_ledger": (LeaseBook.dataset_ledger, protocol.CLOSED),
    "daskdist_restore_ledger": (LeaseBook.restore_ledger, protocol.CLOSED),
    "daskdist_checkpoint_written": (LeaseBook.checkpoint_written, protocol.CLOSED),
}
