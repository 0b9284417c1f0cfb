"""PreemptBook: the preemption deadlines of one coordinator's workers on the scheduler,
and their routes.

A worker that will be taken away tells each coordinator's scheduler side its deadline
(``daskdist_preemption``, from its session: whichever source spoke first on the worker,
see ``plugins/worker/deadlines.py``); ``coord.notify_preemption(worker, deadline)``
(``daskdist_notify_preemption``) sends that worker alone a deadline, which it reports
back the same way. Deadlines are shown by ``coord.status()`` and the dashboard. A
worker whose deadline is within ``daskdist.preemption.horizon`` is *leaving*: no group
formation takes it any more (its gang member leaves its group at its next commit, a
just-in-time checkpoint first: ``collective/state/deadline.py``). What it needs of its
coordinator is :class:`PreemptCoordinator`. Runs on the scheduler's event loop; imports
nothing from Dask.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from daskdist import config
from daskdist.core import checks, protocol
from daskdist.core.lifetime.deadlines import acting, earliest
from daskdist.core.membership import Membership
from daskdist.core.protocol import OWNER, SESSION, Preemption, Route

logger = logging.getLogger(__name__)


class PreemptCoordinator(Protocol):
    """What the preemption book asks its coordinator (the scheduler's
    ``CoordinatorState``)."""

    name: str
    members: Membership  # the shared membership: sessions and their workers
    send: Callable[[str, dict], None]  # a message on a worker's stream

    def membership_changed(self) -> None:
        """The group's members are told of a change (its next formation)."""

    def member_leaving(self, session: str) -> None:
        """``session``'s deadline came within the horizon: what it keeps for others (a
        model's standby copy) moves to a member staying."""


class PreemptBook:
    """The deadlines of a coordinator's worker sessions."""

    def __init__(self, co: PreemptCoordinator) -> None:
        self.co = co
        self.deadlines: dict[str, Preemption] = {}  # session -> its notice
        self.horizon = config.seconds("preemption.horizon")
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def leaving(self, session: str, now: float | None = None) -> bool:
        """Whether ``session``'s worker has a deadline within the horizon (no group
        formation takes it)."""
        notice = self.deadlines.get(session)
        return notice is not None and acting(notice.deadline, time.time() if now is None
                                             else now, self.horizon)

    def listing(self) -> list[dict[str, Any]]:
        """Every live member's deadline, soonest first: ``{worker, index, deadline,
        reason, seconds_left}`` (what ``status()`` and the dashboard show)."""
        members, now, out = self.co.members.members, time.time(), []
        for session in list(self.deadlines):
            m = members.get(session)
            if m is None:  # ended: forgotten
                self._forget(session)
                continue
            d = self.deadlines[session]
            out.append({"worker": m.address, "index": m.index, "deadline": d.deadline,
                        "reason": d.reason, "seconds_left": d.deadline - now})
        return sorted(out, key=lambda p: p["deadline"])

    def _forget(self, session: str) -> None:
        self.deadlines.pop(session, None)
        timer = self._timers.pop(session, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # -- routes ---------------------------------------------------------------------------
    def notice(self, session: str, deadline: float, reason: str) -> None:
        """A worker session's deadline (its worker's earliest, from any source). A
        deadline within the horizon takes it out of the next group formation now; a
        farther one does so when it comes within the horizon."""
        notice = earliest(self.deadlines.get(session),
                          protocol.preemption(deadline, reason, "daskdist_preemption"))
        if notice == self.deadlines.get(session):
            return
        self.deadlines[session] = notice
        m = self.co.members.members.get(session)
        logger.warning("daskdist[%s]: worker %s will be taken away in %.0f s (%s)",
                       self.co.name, m.address if m else session, notice.deadline - time.time(),
                       notice.reason)
        self._schedule(session, notice)
        self.co.membership_changed()  # the group's next formation leaves it out
        if self.leaving(session):
            self.co.member_leaving(session)

    def _schedule(self, session: str, notice: Preemption) -> None:
        """Re-check the group when the deadline comes within the horizon."""
        timer = self._timers.pop(session, None)
        if timer is not None:
            timer.cancel()
        wait = notice.deadline - self.horizon - time.time()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (the state driven directly): nothing to wake
            return
        if wait > 0:
            self._timers[session] = loop.call_later(wait, self._within_horizon, session)

    def _within_horizon(self, session: str) -> None:
        self._timers.pop(session, None)
        self.co.membership_changed()
        if self.leaving(session):
            self.co.member_leaving(session)

    def notify(self, owner: str, token: str, worker: str, deadline: float,
               reason: str = "notify_preemption") -> None:
        """``coord.notify_preemption``: worker ``worker`` alone gets the deadline
        (``ValueError`` naming it when it is not a member of this coordinator)."""
        op = "daskdist_notify_preemption"
        notice = protocol.preemption(deadline, reason, op)
        address = checks.text(worker, f"{op}: worker")
        if self.co.members.session_of(address) is None:
            raise ValueError(f"{op}: {address!r} is not a worker of coordinator "
                             f"{self.co.name!r} (coord.members() lists them)")
        self.co.send(address, {"op": "daskdist-preemption", "name": self.co.name,
                               "deadline": notice.deadline, "reason": notice.reason})


# The preemption book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler). A notice from an ended session changes nothing.
PREEMPT_ROUTES = {
    "daskdist_preemption": Route(PreemptBook.notice, caller=SESSION, ended=None),
    "daskdist_notify_preemption": Route(PreemptBook.notify, caller=OWNER),
}
