"""GroupDriver: forms collective groups and runs gang closures, from the scheduler.

The scheduler-side half of SPEC §4. It asks the pure :class:`GangBook` what to do and
does it: formation is two worker RPCs (rank 0 opens a rendezvous store on a port it
holds; then every member joins at once, each in a worker thread), one when rank 0 was a
member before (every member's join reports the port of the socket it holds for its next
store: rank 0 opens the store there as it joins), gang members are
put in the closure queue pinned to their sessions and the member workers are told at
once on their streams (a worker whose threads are all busy still keeps a slot for
them). Never imports torch: the worker plugin does the torch side.

Membership changes (SPEC §4.1): a group that lost a member re-forms on the survivors
at once (``daskdist.collective.rejoin-grace``, default 0, may hold it for a Nanny's
replacement); a worker that joins later makes the running gang's ``State.commit()``
raise ``HostsUpdatedInterrupt`` and the gang runs again on a group that includes it.
A formation that keeps failing is retried after growing pauses
(``formation-retry`` doubling up to ``formation-retry-max``) and fails the pending
gangs with ``CollectiveError`` after ``formation-timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from distributed.comm.addressing import get_address_host

from daskdist import config
from daskdist.core.backends import (
    HOW_TO_SPLIT,
    BackendError,
    MemberDevice,
    choose_backend,
    describe_sharing,
    shared_gpus,
)
from daskdist.core.gang import GangBook, relay_children
from daskdist.core.membership import Membership
from daskdist.core.protocol import COLLECTIVE_ERROR, Outcome
from daskdist.errors import CollectiveError, dump_error

logger = logging.getLogger(__name__)


class Group(Protocol):
    """What the driver drives: its group book's pure machine and the events it waits on."""

    gangs: GangBook  # pending and running gangs, the group's generations
    changed: asyncio.Event  # set when the gang pump should look again
    left: asyncio.Event  # set when a session ended (a formation in progress checks)
    relay_fanout: int  # a broken generation's word goes down a tree of this fanout


class DriverCoordinator(Protocol):
    """What the driver asks its coordinator (the scheduler's ``CoordinatorState``)."""

    name: str
    members: Membership  # the shared membership: sessions, counters, leases

    def active_sessions(self) -> tuple[str, ...]:
        """Sessions that may be in the group, in rank order."""

    def fence_silent(self, sessions: Iterable[str], since: float) -> list[str]:
        """End those of ``sessions`` silent since ``since``; the ones ended."""

    def broadcast(self, msg: dict, sessions: Iterable[str] | None = None,
                  addressed: bool = False) -> None: ...

    def deliver_gang(self, outcome: Outcome) -> None:
        """A gang's outcome to its owner."""

    def put_gang(self, members: list[tuple[str, str, int]], payload: list) -> None:
        """A gang's member closures, each pinned to its session, to the closure queue."""

    def formation_noted(self, generation: int, ok: bool, seconds: float,
                        members: int) -> None:
        """A formation ended (the dashboard's events)."""


class FormationAborted(Exception):
    """A formation did not complete: a member ended meanwhile, or its deadline passed."""



class GroupDriver:
    """Drives one coordinator's group formations and gang dispatch: its group book's
    machine and events (:class:`Group`), the rest through its coordinator
    (:class:`DriverCoordinator`)."""

    def __init__(self, co: DriverCoordinator, book: Group, rpc: Callable[[str], Any],
                 next_generation: Callable[[], int] | None = None):
        self.co = co
        self.book = book
        self.rpc = rpc
        # generations are unique across coordinators: a worker process hosts one group
        # at a time, whichever coordinator formed it, and remembers lost generations
        self.next_generation = next_generation or (lambda: 0)
        self.lock = asyncio.Lock()  # one formation at a time
        self.task: asyncio.Task | None = None
        self.formations = 0
        self.last_formation_seconds = 0.0
        self.size = 0  # members of the last group formed: re-formation waits to regain it
        self.rejoin_grace = config.seconds("collective.rejoin-grace")
        self._short_since: float | None = None
        self._warned: set[frozenset] = set()  # GPU sharings already logged
        self.last_error = ""  # why the last formation failed ("" when it formed)
        self._failing_since: float | None = None  # first failure of the current streak
        self._hopeless = False  # the last formation cannot succeed by retrying (a backend)
        self._failures = 0
        self._member_gone = False  # the last formation was aborted: a member ended
        # session -> the port its next store listens on (its last join's reply); rank 0's
        # lets a formation skip the store call
        self.store_ports: dict[str, int] = {}
        self._port_failed = False  # the last formation named a port rank 0 no longer held

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._pump())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def candidates(self) -> tuple[str, ...]:
        """The sessions the next generation forms over, in rank (worker-index) order.

        The workers not retiring; but if none of them was a member of the current
        group (so none holds the committed state), the current group's retiring
        members still there are kept, so ``State.sync()`` hands their state over
        before they leave (they leave the group when their worker closes). With no
        worker to hand over to, none: a retiring last holder leaves (checkpointing, with
        ``checkpoint_to``) and the gang waits for workers.
        """
        co = self.co
        active = co.active_sessions()
        current = self.book.gangs.group.sessions
        if not current or not active or set(active) & set(current):
            return active
        keep = set(active) | {s for s in current if s in co.members}
        return tuple(m.session for m in co.members.by_index() if m.session in keep)

    def backend_for(self, sessions: tuple[str, ...]) -> str:
        """The backend for these members (``BackendError`` when the requested one cannot
        serve them, e.g. NCCL on GPUs that members share); logs once per sharing seen."""
        members = [MemberDevice(m.address, m.device, m.gpu)
                   for m in (self.co.members.members.get(s) for s in sessions) if m]
        requested = self.book.gangs.group.backend
        backend = choose_backend(members, requested)
        shared = shared_gpus(members)
        if shared and requested == "auto":
            seen = frozenset((g, tuple(a)) for g, a in shared.items())
            if seen not in self._warned:
                self._warned.add(seen)
                logger.warning("daskdist[%s]: %s, so backend='auto' uses gloo (NCCL needs a "
                               "GPU per rank): %s", self.co.name, describe_sharing(shared),
                               HOW_TO_SPLIT)
        return backend

    async def form(self, sessions: tuple[str, ...] | None = None) -> bool:
        """Form a new generation over ``sessions`` (default: the current workers, and
        again over the workers left when a member was fenced or left meanwhile, at most
        three times)."""
        for _ in range(3):
            ok = await self._form_once(sessions)
            # again: over the workers left, or with a store opened first (the port rank 0
            # reported was taken since: the ports it named are forgotten)
            if ok or not (self._port_failed or sessions is None and self._member_gone):
                return ok
        return ok

    async def _within(self, aw: Any, sessions: tuple[str, ...], deadline: float) -> Any:
        """``aw``'s result, unless a member of ``sessions`` ends first (fenced by its
        lease: a stopped worker answers no RPC, and Dask's own timeout is its 5-minute
        worker-ttl) or ``deadline`` passes: then ``FormationAborted``."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(aw)
        left = self.book.left
        try:
            while not task.done():
                gone = [s for s in sessions if s not in self.co.members]
                if gone:
                    self._member_gone = True
                    raise FormationAborted(f"{len(gone)} member(s) left or were fenced "
                                           "(silent for lease-timeout) while it formed")
                remaining = deadline - loop.time()
                if remaining <= 0:
                    # silent for the whole of lease-timeout since the formation began:
                    # fenced now, like an expired lease (the expiry tick may lag)
                    silent = self.co.fence_silent(
                        sessions, time.monotonic() - self.co.members.leases.timeout)
                    if silent:
                        continue
                    raise FormationAborted("no answer within lease-timeout "
                                           f"({self.co.members.leases.timeout:g} s)")
                left.clear()
                waiter = asyncio.ensure_future(left.wait())
                await asyncio.wait({task, waiter}, timeout=remaining,
                                   return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    async def _form_once(self, sessions: tuple[str, ...] | None) -> bool:
        self._member_gone = self._port_failed = False
        async with self.lock:
            co = self.co
            sessions = sessions or self.candidates()
            if not sessions:
                return False
            if any(s not in co.members for s in sessions):  # left while this waited
                self._member_gone = True
                return False
            book = self.book.gangs
            try:
                backend = self.backend_for(sessions)
            except BackendError as e:  # no formation can succeed: say why, start none
                self.last_error = str(e)
                self._hopeless = True
                logger.error("daskdist[%s]: %s", co.name, e)
                return False
            self._hopeless = False
            version = co.members.version  # what State.sync() records: later joins interrupt
            joins = co.members.joins  # a change later without a join: members only left
            generation = book.begin_formation(sessions, self.next_generation())
            group = book.group
            members = [co.members.members[s] for s in sessions]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            # a deadline of lease-timeout: a member that answers nothing
            # meanwhile is fenced by its lease, and the group forms without it
            deadline = t0 + co.members.leases.timeout
            ok = False
            reported = self.store_ports.get(sessions[0])
            try:
                if reported is None:
                    host, port = await self._within(
                        self.rpc(members[0].address).daskdist_collective(
                            action="store", name=co.name, generation=generation,
                            timeout=group.timeout,
                        ), sessions[:1], deadline)
                else:  # rank 0 opens it on this port as it joins
                    host, port = get_address_host(members[0].address), reported
                fanout = self.book.relay_fanout
                replies = await self._within(asyncio.gather(*[
                    self.rpc(m.address).daskdist_collective(
                        action="init", name=co.name, rank=rank, world_size=len(members),
                        host=host, port=port, backend=backend, generation=generation,
                        timeout=group.timeout, version=version, joins=joins,
                        relay=[members[c].address  # whom it tells if the group breaks
                               for c in relay_children(rank, len(members), fanout)],
                        open_store=rank == 0 and reported is not None,
                    )
                    for rank, m in enumerate(members)
                ]), sessions, deadline)
                ok = all(s in co.members for s in sessions)
                self.store_ports = {s: r["store_port"] for s, r in zip(sessions, replies,
                                                                        strict=True)}
            except Exception as e:
                # a port named may be taken (by another coordinator's group on that
                # worker): the next formation asks rank 0 for a store first
                self.store_ports.pop(sessions[0], None)
                self._port_failed = reported is not None and not self._member_gone
                self.last_error = f"forming generation {generation} failed: {e}"
                logger.info("daskdist[%s]: forming generation %d failed: %r",
                            co.name, generation, e)
                co.broadcast({"op": "daskdist-peer-lost", "name": co.name,
                              "generation": generation, "reason": self.last_error},
                             sessions)
            book.formation_done(generation, ok)
            if ok:
                self.last_error = ""
                self.size = len(sessions)
                self._short_since = None
            self.formations += ok
            self.last_formation_seconds = loop.time() - t0
            co.formation_noted(generation, ok, self.last_formation_seconds, len(sessions))
            self.book.changed.set()
            return ok

    def _rejoin_wait(self, n: int) -> float:
        """Seconds still to wait for the group to regain its size (0: form now)."""
        if n >= self.size:
            self._short_since = None
            return 0.0
        now = asyncio.get_running_loop().time()
        if self._short_since is None:
            self._short_since = now
        return max(0.0, self._short_since + self.rejoin_grace - now)

    async def _after_failure(self, final: bool = False) -> None:
        """Pause before the next formation attempt (doubling each time); past
        ``formation-timeout`` of failures, or at once when retrying cannot help
        (``final``: the backend cannot serve these members), fail the pending gangs."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._failing_since is None:
            self._failing_since = now
        self._failures += 1
        limit = config.seconds("collective.formation-timeout")
        if final or now - self._failing_since >= limit:
            err = CollectiveError(
                f"the collective group of coordinator {self.co.name!r} could not be formed "
                f"in {self._failures} attempts over {now - self._failing_since:.1f} s "
                f"(daskdist.collective.formation-timeout is {limit:g} s): {self.last_error}")
            for outcome in self.book.gangs.fail_pending(dump_error(err), COLLECTIVE_ERROR):
                self.co.deliver_gang(outcome)
            self._failing_since, self._failures = None, 0
            return
        pause = min(config.seconds("collective.formation-retry") * 2 ** (self._failures - 1),
                    config.seconds("collective.formation-retry-max"))
        await asyncio.sleep(pause)

    def info(self) -> dict:
        group = self.book.gangs.group
        try:
            backend = self.backend_for(group.sessions) if group.sessions else group.backend
        except BackendError:
            backend = group.backend
        return {
            "error": self.last_error,
            "generation": group.generation,
            "world_size": len(group.sessions),
            "members": [self.co.members.members[s].address
                        for s in group.sessions if s in self.co.members],
            "backend": backend,
            "formed": not group.broken,
            "bootstrap_seconds": self.last_formation_seconds,
        }

    async def _pump(self) -> None:
        """Run pending gangs one at a time, re-forming the group when it is broken."""
        co = self.co
        book, changed = self.book.gangs, self.book.changed
        while True:
            changed.clear()
            if book.running is None and book.pending:
                sessions = self.candidates()
                if sessions and book.needs_formation(sessions):
                    wait = self._rejoin_wait(len(sessions))
                    if wait > 0:  # a lost member's replacement (Nanny restart) is coming
                        try:
                            await asyncio.wait_for(changed.wait(), wait)
                        except asyncio.TimeoutError:
                            pass
                        continue
                    if await self.form(sessions):
                        self._failing_since, self._failures = None, 0
                    else:
                        await self._after_failure(final=self._hopeless)
                    continue
                started = book.start_next() if sessions else None
                if started is not None:
                    gang, members = started
                    co.put_gang(members, gang.payload)
                    co.broadcast({"op": "daskdist-wake", "name": co.name},
                                 [s for _, s, _ in members])
                    continue
            await changed.wait()
