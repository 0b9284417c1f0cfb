"""KeepBook: the keep-alive owners of one coordinator on the scheduler, and their routes.

``Coordinator(client, name, keep_alive=True)`` makes an owner whose work outlives its
client (a restarted kernel, a laptop asleep, a dropped SSH tunnel):

- its outcomes are kept until its client *reads* them (its outbox's ``kept``, a
  :class:`~daskdist.core.lifetime.keepalive.KeptResults` this book holds; the client's ``fetch``
  sends a read receipt, ``daskdist_read``), bounded by
  ``daskdist.coordinator.keep-results``: past the bound, with no client attached its
  queued closures are held (none is dropped) until someone attaches; with one, what
  that client received goes, oldest first;
- when its client leaves, nothing is dropped after ``client-grace``: the owner waits
  ``daskdist.coordinator.keep-alive-timeout`` for its client to come back or for
  someone to attach, then it is dropped like a closed one;
- :meth:`KeepBook.attach` (``daskdist_attach``, from any client of the scheduler)
  hands the owner to a new client (a new secret token: the old one acts for it no
  more), with what it had not read and what is still running.

Its routes are in :data:`KEEP_ROUTES`; what it needs of the other books it asks its
coordinator (:class:`KeepCoordinator`). Runs on the scheduler's event loop; imports
nothing from Dask.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from daskdist import config
from daskdist.core import checks
from daskdist.core.lifetime.keepalive import KeptResults, next_seq, seq_of
from daskdist.core.membership import Membership
from daskdist.core.protocol import ANY, Route

logger = logging.getLogger(__name__)


class KeepCoordinator(Protocol):
    """What the keep book asks its coordinator (the scheduler's ``CoordinatorState``)."""

    name: str
    members: Membership  # the shared membership: the member count

    def hold_owner(self, owner: str, hold: bool) -> None:
        """Hold (or release) ``owner``'s queued closures (the closure book)."""

    def check_owner(self, owner: str, token: str) -> None:
        """``PermissionError`` unless ``token`` is the secret of ``owner``."""

    def owners_of(self, client: str) -> list[str]:
        """The owners attached from ``client``."""

    def hand_over(self, owner: str, client: str | None) -> tuple[str, list[str], list[str]]:
        """``client`` acts as ``owner`` from now on (its outbox emptied, the previous
        client's secret void): its new secret, and the ids of its closures and of its
        gangs not finished."""


class KeepBook:
    """The keep-alive owners of one coordinator: their kept outcomes, their clients'
    absences, and attaching a new client to one."""

    def __init__(self, co: KeepCoordinator, expire: Callable[[str], None]) -> None:
        self.co = co
        # drops an owner nobody attached to as if it closed (the plugin's: the name goes
        # with its last owner)
        self.expire = expire
        self.kept: dict[str, KeptResults] = {}  # keep-alive owners, oldest first
        self._timers: dict[str, asyncio.TimerHandle] = {}  # owners whose client left

    def keep(self, owner: str) -> KeptResults:
        """``owner`` (being added) is kept alive: what keeps its outcomes until read (its
        outbox fills it)."""
        kept = self.kept[owner] = KeptResults(config.nbytes("coordinator.keep-results"),
                                              on_full=functools.partial(self._full, owner))
        return kept

    def kept_alive(self, owner: str) -> bool:
        return owner in self.kept

    def _full(self, owner: str, full: bool) -> None:
        """With no client attached, its unread values passed ``keep-results`` (its
        queued closures wait), or not any more."""
        if full:
            logger.warning("daskdist[%s]: keep-alive owner %s holds more unread values "
                           "than daskdist.coordinator.keep-results and no client: its "
                           "queued closures wait until one attaches", self.co.name, owner)
        self.co.hold_owner(owner, full)

    def forget(self, owner: str) -> None:
        """``owner`` was dropped (closed, or expired)."""
        self.kept.pop(owner, None)
        timer = self._timers.pop(owner, None)
        if timer is not None:
            timer.cancel()

    # -- its client's absence -------------------------------------------------------------
    def client_away(self, client: str, away: bool) -> None:
        """A client's connection closed (``away``): its keep-alive owners wait
        ``keep-alive-timeout`` for it or for an attach. It reconnected: they wait no
        more."""
        timeout = config.seconds("coordinator.keep-alive-timeout")
        for owner in self.co.owners_of(client):
            kept = self.kept.get(owner)
            if kept is None or away == (owner in self._timers):  # not kept, or no change
                continue
            if away:
                self._timers[owner] = asyncio.get_running_loop().call_later(
                    timeout, self._expired, owner)
            else:
                self._timers.pop(owner).cancel()
            kept.set_attached(not away)

    def _expired(self, owner: str) -> None:
        self._timers.pop(owner, None)
        logger.info("daskdist[%s]: keep-alive owner %s: nobody attached within "
                    "daskdist.coordinator.keep-alive-timeout; closed", self.co.name, owner)
        self.expire(owner)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # -- routes -----------------------------------------------------------------------------
    def attach(self, client: str | None = None) -> dict[str, Any]:
        """``Coordinator.attach``: hand the newest keep-alive owner to ``client``: its
        id, a new secret token, the ids of its unfinished closures and gangs (in
        schedule order), its outcomes not yet read, and the first schedule number its
        new client may use. ``LookupError`` naming the coordinator when it has no
        keep-alive owner."""
        co = self.co
        client = checks.optional(checks.text, client, "daskdist_attach: client")
        if not self.kept:
            raise LookupError(f"coordinator {co.name!r} has no keep_alive owner to attach "
                              f"to (Coordinator(client, name={co.name!r}, keep_alive=True) "
                              f"makes one)")
        owner = next(reversed(self.kept))
        kept = self.kept[owner]
        timer = self._timers.pop(owner, None)
        if timer is not None:
            timer.cancel()
        unread = kept.unread()
        # every unread outcome is in the reply
        token, *unfinished = co.hand_over(owner, client)
        closures, gangs = (sorted(ids, key=lambda cid: seq_of(cid) or 0)
                           for ids in unfinished)
        kept.set_attached(True)  # its queue goes on, if it was held
        logger.info("daskdist[%s]: client %s attached to keep-alive owner %s (%d unfinished, "
                    "%d unread)", co.name, client, owner, len(closures) + len(gangs),
                    len(unread))
        return {"owner": owner, "token": token, "workers": len(co.members),
                "closures": closures, "gangs": gangs, "kept": [tuple(o) for o in unread],
                "seq": next_seq([*closures, *gangs, *(o.cid for o in unread)], kept.high)}

    def read(self, owner: str, token: str, cids: list) -> None:
        """Read receipts (one-way): the owner's client fetched these values, which are
        kept no longer."""
        op = "daskdist_read"
        kept = self.kept.get(checks.text(owner, f"{op}: owner"))
        if kept is None:  # closed meanwhile, or not kept alive
            return
        self.co.check_owner(owner, checks.text(token, f"{op}: token"))
        kept.read(checks.texts(cids, f"{op}: cids"))


# The keep book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler). ``daskdist_read`` is one-way and answers a gone owner itself;
# an attach to a name that is gone is told so (the client's error names it).
KEEP_ROUTES = {
    "daskdist_attach": Route(KeepBook.attach, {"closed": True}),
    "daskdist_read": Route(KeepBook.read, None, ANY),
}
