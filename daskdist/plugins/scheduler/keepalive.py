"""KeepBook: the keep-alive owners of one coordinator on the scheduler, and their routes.

``Coordinator(client, name, keep_alive=True)`` makes an owner whose work outlives its
client (a restarted kernel, a laptop asleep, a dropped SSH tunnel):

- its outcomes are kept until its client *reads* them (``Outbox.kept``, a
  :class:`~daskdist.core.keepalive.KeptResults`; the client's ``fetch`` sends a read
  receipt, ``daskdist_read``), bounded by ``daskdist.coordinator.keep-results``: past
  the bound, with no client attached its queued closures are held (none is dropped)
  until someone attaches; with one, what that client received goes, oldest first;
- when its client leaves, nothing is dropped after ``client-grace``: the owner waits
  ``daskdist.coordinator.keep-alive-timeout`` for its client to come back or for
  someone to attach, then it is dropped like a closed one;
- :meth:`KeepBook.attach` hands the owner to a new client (a new secret token: the old
  one acts for it no more), with what it had not read and what is still running.

Its routes are in :data:`KEEP_ROUTES`. Runs on the scheduler's event loop; imports
nothing from Dask.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from daskdist import config
from daskdist.core import protocol
from daskdist.core.keepalive import KeptResults, next_seq, seq_of
from daskdist.core.protocol import ANY, OWNER, Route

if TYPE_CHECKING:
    from daskdist.plugins.scheduler.state import CoordinatorState

logger = logging.getLogger(__name__)


class KeepBook:
    """The keep-alive owners of one coordinator: their kept outcomes, their clients'
    absences, and attaching a new client to one."""

    def __init__(self, co: CoordinatorState) -> None:
        self.co = co
        self.owners: dict[str, None] = {}  # keep-alive owners, oldest first
        self._timers: dict[str, asyncio.TimerHandle] = {}  # owners whose client left
        # drops an owner as if it closed (names.py sets it: the name goes with its last)
        self.drop: Callable[[str], None] | None = None

    def keep(self, owner: str) -> None:
        """``owner`` (just added) is kept alive."""
        box = self.co.outboxes[owner]
        box.kept = KeptResults(config.nbytes("coordinator.keep-results"),
                               on_full=functools.partial(self._full, owner))
        self.owners[owner] = None

    def kept(self, owner: str) -> bool:
        return owner in self.owners

    def _full(self, owner: str, full: bool) -> None:
        """With no client attached, its unread values passed ``keep-results`` (its
        queued closures wait), or not any more."""
        if full:
            logger.warning("daskdist[%s]: keep-alive owner %s holds more unread values "
                           "than daskdist.coordinator.keep-results and no client: its "
                           "queued closures wait until one attaches", self.co.name, owner)
        self.co.closure_book.hold_owner(owner, full)

    def forget(self, owner: str) -> None:
        """``owner`` was dropped (closed, or expired)."""
        self.owners.pop(owner, None)
        timer = self._timers.pop(owner, None)
        if timer is not None:
            timer.cancel()

    # -- its client's absence -------------------------------------------------------------
    def client_left(self, client: str) -> None:
        """A client's connection closed: its keep-alive owners wait
        ``keep-alive-timeout`` for it or for an attach."""
        timeout = config.seconds("coordinator.keep-alive-timeout")
        loop = asyncio.get_running_loop()
        for owner in self.owners:
            box = self.co.outboxes.get(owner)
            if box is not None and box.client == client and owner not in self._timers:
                self._timers[owner] = loop.call_later(timeout, self._expired, owner)
                box.kept.set_attached(False)

    def client_back(self, client: str) -> None:
        """A client reconnected: its owners wait no more."""
        for owner in list(self._timers):
            box = self.co.outboxes.get(owner)
            if box is not None and box.client == client:
                self._timers.pop(owner).cancel()
                box.kept.set_attached(True)

    def _expired(self, owner: str) -> None:
        self._timers.pop(owner, None)
        logger.info("daskdist[%s]: keep-alive owner %s: nobody attached within "
                    "daskdist.coordinator.keep-alive-timeout; closed", self.co.name, owner)
        if self.drop is not None:
            self.drop(owner)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # -- attaching --------------------------------------------------------------------------
    def attach(self, client: str | None) -> dict[str, Any]:
        """Hand the newest keep-alive owner to ``client``: its id, a new secret token,
        the ids of its unfinished closures and gangs (in schedule order), its outcomes
        not yet read, and the first schedule number its new client may use.
        ``LookupError`` naming the coordinator when it has no keep-alive owner."""
        co = self.co
        if not self.owners:
            raise LookupError(f"coordinator {co.name!r} has no keep_alive owner to attach "
                              f"to (Coordinator(client, name={co.name!r}, keep_alive=True) "
                              f"makes one)")
        owner = next(reversed(self.owners))
        box = co.outboxes[owner]
        timer = self._timers.pop(owner, None)
        if timer is not None:
            timer.cancel()
        box.client = client
        box.token = secrets.token_hex(16)  # the previous client acts for it no more
        kept = box.kept.unread() if box.kept is not None else []
        box.ack(box.first_seq + len(box.items))  # every one of them is in the reply
        box.event.set()  # a long-poll of the previous client returns (then is refused)
        closures = sorted((c.cid for c in co.queue.closures.values() if c.owner == owner),
                          key=lambda cid: seq_of(cid) or 0)
        running = co.gangs.running
        gangs = [g.cid for g in ([running] if running is not None else [])
                 + list(co.gangs.pending) if g.owner == owner]
        if box.kept is not None:
            box.kept.set_attached(True)  # its queue goes on, if it was held
        logger.info("daskdist[%s]: client %s attached to keep-alive owner %s (%d unfinished, "
                    "%d unread)", co.name, client, owner, len(closures) + len(gangs),
                    len(kept))
        return {"owner": owner, "token": box.token, "workers": len(co.members),
                "closures": closures, "gangs": gangs, "kept": [tuple(o) for o in kept],
                "seq": next_seq([*closures, *gangs, *(o.cid for o in kept)],
                                box.kept.high if box.kept is not None else -1)}

    # -- routes -----------------------------------------------------------------------------
    def read(self, owner: str, token: str, cids: list) -> None:
        """Read receipts (one-way): the owner's client fetched these values, which are
        kept no longer."""
        op = "daskdist_read"
        box = self.co.outboxes.get(protocol.text(owner, f"{op}: owner"))
        if box is None or box.kept is None:  # closed meanwhile, or not kept alive
            return
        self.co.closure_book.owner_box(owner, protocol.text(token, f"{op}: token"))
        box.kept.read(protocol.texts(cids, f"{op}: cids"))

    def datasets(self, owner: str, token: str) -> list[tuple[str, str, int]]:
        """The owner's datasets: ``(dataset id, label, newest epoch)`` each (a dataset's
        further loaders, ``<id>.<k>``, go with it)."""
        out = []
        for dataset_id, ds in self.co.leases.datasets.items():
            if ds.owner == owner and "." not in dataset_id:
                epochs = [*ds.epochs, *(stop - 1 for _, stop in ds.completed)]
                out.append((dataset_id, ds.label, max(epochs, default=0)))
        return out


# The keep book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler). ``daskdist_read`` is one-way and answers a gone owner itself.
KEEP_ROUTES = {
    "daskdist_read": Route(KeepBook.read, None, ANY),
    "daskdist_datasets": Route(KeepBook.datasets, caller=OWNER),
}
