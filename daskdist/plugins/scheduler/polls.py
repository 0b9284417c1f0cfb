"""Long-polls on the scheduler: how each one waits, the owners' outboxes (a client's
long-poll for its outcomes) and the workers' long-polls for work (with the steals and
the routing at an epoch's tail that decide whom a closure wakes).

The closure book holds one :class:`Owners` and one :class:`WorkerPolls`; the group
book's commits and a coordinator's creation wait with :func:`wait_event` too. A
long-poll wakes only when there is something for it: a queued closure wakes one worker's,
an outcome its owner's. Runs on the scheduler's event loop; imports nothing from Dask.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from daskdist.core.lifetime.keepalive import KeptResults
from daskdist.core.membership import Membership
from daskdist.core.protocol import Outcome
from daskdist.core.queue import Closure, ClosureQueue


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; whether it is set.

    Long-poll wake-ups are on the closure round trip's path: ``asyncio.timeout`` wakes
    the waiter directly, where ``wait_for`` would add a task (and a loop iteration).
    """
    if event.is_set():
        return True
    try:
        if hasattr(asyncio, "timeout"):  # Python 3.11+
            async with asyncio.timeout(timeout):
                await event.wait()
        else:  # pragma: no cover - Python 3.10
            await asyncio.wait_for(event.wait(), timeout)
    except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
        return False
    return True


@dataclass
class Outbox:
    """Outcomes waiting for one client-side Coordinator (an *owner*); kept until it
    acknowledges them. ``token`` is the owner's secret: only the client it was given to
    can act as that owner (SPEC §2.5b). A keep-alive owner's outcomes are also
    ``kept`` until its client reads them (``core.lifetime.keepalive``; its keep book holds the
    same :class:`KeptResults`)."""

    client: str | None
    token: str = ""
    first_seq: int = 0
    items: list = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    kept: KeptResults | None = None

    def push(self, item: Outcome) -> None:
        self.items.append(item)
        self.event.set()
        if self.kept is not None:
            self.kept.add(item)

    def ack(self, seq: int) -> None:
        """Forget everything before ``seq`` (the client has it)."""
        drop = seq - self.first_seq
        if drop > 0:
            if self.kept is not None:
                self.kept.received(o.cid for o in self.items[:drop])
            del self.items[:drop]
            self.first_seq = seq
        if not self.items:
            self.event.clear()


class Owners:
    """One coordinator's owners (client-side Coordinators): each one's outbox of outcomes
    and secret token, by owner id."""

    def __init__(self, name: str) -> None:
        self.name = name  # the coordinator's, for messages
        self.boxes: dict[str, Outbox] = {}

    def add(self, owner: str, client: str | None, token: str,
            kept: KeptResults | None = None) -> None:
        """A new owner (``kept``: a keep-alive owner's outcomes, kept until read)."""
        self.boxes[owner] = Outbox(client, token, kept=kept)

    def hand_over(self, owner: str, client: str | None) -> str:
        """``client`` acts as ``owner`` from now on (``Coordinator.attach``): a new
        secret (the previous client acts for it no more; its long-poll returns, then is
        refused) and the outbox emptied (its outcomes go in the attach's reply). The
        new secret."""
        box = self.boxes[owner]
        box.client = client
        box.token = secrets.token_hex(16)
        box.ack(box.first_seq + len(box.items))
        box.event.set()
        return box.token

    def box(self, owner: str, token: str) -> Outbox:
        """The outbox of ``owner`` if ``token`` is its secret; ``PermissionError`` if not
        (a client acts only as the owner it attached as)."""
        box = self.boxes.get(owner)
        if box is None:
            raise PermissionError(f"coordinator {self.name!r} has no owner {owner!r} "
                                  "(it closed, or its client was cut off longer than "
                                  "daskdist.coordinator.client-grace)")
        if not secrets.compare_digest(box.token, token):
            raise PermissionError(f"the caller is not owner {owner!r} of coordinator "
                                  f"{self.name!r}")
        return box

    def push(self, outcome: Outcome) -> None:
        """``outcome`` to its owner's outbox (dropped if the owner is gone)."""
        box = self.boxes.get(outcome.owner)
        if box is not None:
            box.push(outcome)

    def of_client(self, client: str) -> list[str]:
        """The owners attached from ``client``."""
        return [owner for owner, box in self.boxes.items() if box.client == client]

    async def poll(self, owner: str, box: Outbox, ack: int, timeout: float) -> bool:
        """``owner``'s long-poll on its ``box``: forget what it acknowledged (before
        ``ack``), then wait at most ``timeout`` seconds while nothing is left for it;
        whether ``box`` is still its outbox (``False``: the owner was dropped meanwhile)."""
        box.ack(ack)
        if not box.items:
            await wait_event(box.event, timeout)
        return self.boxes.get(owner) is box


class PollCoordinator(Protocol):
    """What the workers' long-polls ask their coordinator (the scheduler's
    ``CoordinatorState``)."""

    name: str
    closed: bool
    members: Membership  # the shared membership: sessions, poll intervals
    send: Callable[[str, dict], None]  # a message on a worker's stream

    def takes(self, dataset: str, session: str) -> bool:
        """Whether ``session`` should run a closure reading ``dataset`` now."""

    def holders(self, dataset: str) -> Iterable[str]:
        """The sessions holding ``dataset``'s leased rows."""


class WorkerPolls:
    """The workers' long-polls waiting for work, by session: those that may take work,
    oldest first (a queued closure wakes one, never one already woken and not yet back),
    and those that take none now (draining, paused: only a change of state wakes them).
    Waking ``n`` of them is O(n) whatever the number of idle workers. An idle session
    steals from the busiest; at an epoch's tail, closures reading a dataset are set
    aside for the sessions holding its rows (the queue's router), and those are woken."""

    def __init__(self, co: PollCoordinator, queue: ClosureQueue) -> None:
        self.co = co
        self.queue = queue  # the closure book's
        queue.router = self.route
        self.routed: set[str] = set()  # datasets whose closures were just set aside
        self.waiters: OrderedDict[asyncio.Event, None] = OrderedDict()
        self.woken: set[asyncio.Event] = set()  # woken for a closure, not yet back
        self.idle_waiters: set[asyncio.Event] = set()
        self.parked: dict[str, asyncio.Event] = {}  # session -> its long-poll's event
        self.steals = 0  # requests to a busy worker to give back unstarted closures

    # -- waking ------------------------------------------------------------------------
    def wake(self, n: int | None = None) -> None:
        """``n`` closures became available: wake the ``n`` longest-waiting long-polls
        that may take them (``None``: wake every long-poll, each re-checks)."""
        if n is None:
            for event in self.waiters:
                event.set()
            for event in self.idle_waiters:
                event.set()
            return
        woken = self.woken
        for event in self.waiters:
            if n <= 0:
                break
            if event not in woken:
                event.set()
                woken.add(event)
                n -= 1

    def wake_sessions(self, sessions: Iterable[str]) -> None:
        """Wake the long-polls of ``sessions`` (work pinned or set aside for them)."""
        for session in sessions:
            event = self.parked.get(session)
            if event is not None:
                event.set()

    def wake_idle(self) -> None:
        """The long-polls that take no work re-check (a session's state changed)."""
        for event in self.idle_waiters:
            event.set()

    # -- the epoch's tail: closures reading a dataset go to the holders of its rows --------
    def route(self, dataset: str, session: str) -> bool:
        """The queue's router: whether ``session`` should run a closure reading
        ``dataset`` now (the lease table's word: not when the dataset's free rows are
        gone and other sessions hold its leased rows)."""
        if self.co.takes(dataset, session):
            return True
        self.routed.add(dataset)
        return False

    def wake_holders(self) -> bool:
        """Closures were set aside for the sessions holding their dataset's rows: wake
        those of them waiting in a long-poll (the first few holders looked at, O(1);
        a busy holder takes them at its next exchange). Whether any were."""
        if not self.routed:
            return False
        datasets, self.routed = self.routed, set()
        for dataset in datasets:
            self.wake_sessions(itertools.islice(self.co.holders(dataset), 4))
        return True

    def reopened(self, dataset: str) -> None:
        """``dataset``'s rows may go to any session again (rows came back to its pool,
        or its epoch completed): wake as many long-polls as closures were set aside for
        its holders, which any session may now take (O(1) when none were)."""
        n = self.queue.set_aside(dataset)
        if n:
            self.wake(n)

    def steal_for(self, thief: str) -> None:
        """An idle session found no work: ask the session holding the most prefetched,
        unstarted closures to give half of them back (they return as ``UNSTARTED``
        results, go to the head of the queue and wake the idle session's long-poll)."""
        victim = self.queue.steal_victim(thief)
        if victim is None:
            return
        session, n = victim
        member = self.co.members.members.get(session)
        if member is not None:
            self.steals += 1
            self.co.send(member.address, {"op": "daskdist-steal", "name": self.co.name,
                                          "n": n})

    # -- a session's long-poll ------------------------------------------------------------
    async def wait_for_work(self, comm: Any, session: str,
                            share: Callable[[], int]) -> list[Closure]:
        """``session``'s long-poll: the closures dispatched to it (up to ``share()``)
        once there are any, or none after ``daskdist.scheduler.poll-interval`` (or when
        its comm, its session or its coordinator closes)."""
        co, q = self.co, self.queue
        deadline = time.monotonic() + co.members.poll_interval()
        closures: list[Closure] = []
        event = self.parked[session] = asyncio.Event()
        try:
            while not (comm.closed() or co.closed or session not in co.members):
                closures = q.dispatch(session, share())
                self.wake_holders()
                left = deadline - time.monotonic()
                if closures or left <= 0:
                    break
                event.clear()
                self.woken.discard(event)
                if q.takes_work(session):
                    self.idle_waiters.discard(event)
                    self.waiters[event] = None
                else:
                    self.waiters.pop(event, None)
                    self.idle_waiters.add(event)
                if not await wait_event(event, left):
                    break
        finally:
            self.waiters.pop(event, None)
            self.idle_waiters.discard(event)
            self.woken.discard(event)
            if self.parked.get(session) is event:
                del self.parked[session]
        return closures
