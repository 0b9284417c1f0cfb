"""GroupBook: the gangs', the collective group's and the commits' book on the scheduler.

Gang closures (``schedule_on_all``) and the group generations they run on are the pure
:class:`~daskdist.core.gang.GangBook`; the commits that acknowledge gang members' rows
(SPEC §4.2) are the pure :class:`~daskdist.core.leases.commits.CommitBook`. This book routes
gang members' outcomes to the gang book, tells a broken group's members at once (and of
a membership change, in one message per interval), and serves the group and commit
routes (:data:`GROUP_ROUTES`). Formation itself is its
:class:`~daskdist.plugins.scheduler.groups.GroupDriver`'s (``driver``, made once the
coordinator knows its scheduler); what it needs of the other books it asks its
coordinator (:class:`GroupCoordinator`). Runs on the scheduler's event loop; imports
nothing from Dask.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from daskdist import config
from daskdist.core import checks, protocol
from daskdist.core.gang import INTERRUPTING, GangBook, relay_children, tell_targets
from daskdist.core.leases.commits import Acknowledger, CommitBook, unpack_parts
from daskdist.core.leases.table import group_tokens
from daskdist.core.protocol import CANCELLED, OWNER, READY, SESSION, CommitKey, Outcome, Route
from daskdist.plugins.scheduler.groups import DriverCoordinator, GroupDriver
from daskdist.plugins.scheduler.polls import wait_event


class GroupCoordinator(DriverCoordinator, Acknowledger, Protocol):
    """What the group book (and its driver) asks its coordinator (the scheduler's
    ``CoordinatorState``): the coordinator's own state, and what the other books hold.
    It is also the lease table a commit acknowledges its rows in (an
    :class:`~daskdist.core.leases.commits.Acknowledger`)."""

    closed: bool

    def note_trained(self, state: str, tokens: Iterable[object]) -> None:
        """State ``state`` trained on the datasets these lease tokens name (its ledger)."""

    def note_trained_tables(self, state: str, tables: Iterable[tuple[str, int]]) -> None:
        """State ``state`` trained on these (dataset, epoch) tables (its ledger)."""

    def dataset_of(self, key: int) -> str | None:
        """The dataset a packed part's dataset key names."""


class GroupBook:
    """Gangs, the group's generations, and the commits of elastic States."""

    def __init__(self, co: GroupCoordinator, max_worker_failures: int,
                 relay_fanout: int) -> None:
        self.co = co
        # a broken generation's word goes down a tree of this fanout (core.gang's
        # relay_children): each member's init names the members it passes it on to
        self.relay_fanout = relay_fanout
        self.gangs = GangBook(max_losses=max_worker_failures)
        self.commits = CommitBook()  # commits that acknowledged gang members' rows
        self.commit_events: dict[CommitKey, asyncio.Event] = {}  # open commits' waiters
        self.changed = asyncio.Event()  # the gang pump waits on it
        self.left = asyncio.Event()  # a session ended (a formation in progress checks)
        self.departing: set[str] = set()  # retired group members finishing their step
        self.told = -1  # the last generation whose members heard it broke (peer-lost)
        self.told_version = 0  # the membership version the group's members last heard
        self._flush: asyncio.TimerHandle | None = None  # the membership message held back
        self.driver: GroupDriver | None = None  # made by attach_driver

    def attach_driver(self, rpc: Callable[[str], Any],
                      next_generation: Callable[[], int]) -> GroupDriver:
        """Make the book's driver: it forms groups through ``rpc`` (Dask's RPC to a
        worker), numbering generations by ``next_generation``."""
        self.driver = GroupDriver(self.co, self, rpc, next_generation)
        return self.driver

    # -- what happened to the group -------------------------------------------------------
    def member_finished(self, o: Outcome) -> None:
        """A gang member's closure ended: the gang book judges it; a user error on a
        healthy group tells the peers at once."""
        gangs = self.gangs
        healthy = not gangs.group.broken
        g = gangs.member_finished(o.cid, o.state == READY, o.value, o.kind)
        if healthy and gangs.group.broken and o.kind not in INTERRUPTING:
            # a user error failed the gang: the peers stop waiting for that rank
            # (an interruption needs no word: every rank raises it, or the
            # scheduler told them of the loss)
            self.tell_members()
        if g is not None:
            self.co.deliver_gang(g)
        self.changed.set()

    def tell_members(self, lost_rank: int | None = None) -> None:
        """The group broke (a member left: ``lost_rank``, or a member's closure failed):
        its members' collective calls of this generation raise ``CollectiveError`` at
        once, saying why (``GroupRecord.why``), instead of waiting for the group's
        timeout. The word goes down a tree (:func:`~daskdist.core.gang.relay_children`;
        the scheduler alone tells a group of up to ``relay_fanout``): the generation's
        first word goes to the tree's top, and a lost rank's children are told in its
        place, then and at each later loss in the generation (a node's other workers),
        so a loss costs O(fanout) messages. The counters it changed reach the members
        with the word, and later ones with the next formation (its init carries them;
        :meth:`CoordinatorState.flush`)."""
        group = self.gangs.group
        co = self.co
        world, fanout = len(group.sessions), self.relay_fanout
        first = self.told != group.generation
        self.told = group.generation
        ranks = list(range(min(fanout, world))) if first else []
        if lost_rank is not None:
            ranks += relay_children(lost_rank, world, fanout)
        live, sessions = co.members.members, group.sessions
        targets = tell_targets(ranks, world, fanout, lambda r: sessions[r] not in live)
        if targets:
            co.broadcast({"op": "daskdist-peer-lost", "name": co.name,
                          "generation": group.generation, "reason": group.why,
                          **co.members.counters()}, [sessions[r] for r in targets],
                         addressed=True)
        if first:
            self.told_version = co.members.version  # they know it: no membership message

    def session_lost(self, session: str, expected: bool) -> None:
        """A session ended (``members`` no longer has it): a group member's loss breaks
        the group, refuses its generation's open commits and tells the surviving members
        (with the new membership version)."""
        self.departing.discard(session)
        self.left.set()
        rank = self.gangs.group.ranks.get(session)
        if self.gangs.session_lost(session, expected):
            # a member's part may never come: its generation's open commits are refused,
            # and the surviving members' collective calls fail at once
            self._commits_decided(self.commits.abort_open())
            self.tell_members(rank)

    def membership_changed(self) -> None:
        """A session joined or left, or a member's status changed: the running gang's
        run is not a repeat, the pump looks again, and the group's members hear the new
        membership version (what ``State.commit()`` compares) in one message per
        ``scheduler.membership-interval``, however many changes it holds; every other
        worker reads it from its next exchange's reply."""
        self.gangs.membership_changed()
        self.changed.set()
        if self._flush is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (the state driven directly): at once
            self.flush()
            return
        self._flush = loop.call_later(config.seconds("scheduler.membership-interval"),
                                      self.flush)

    def flush(self) -> None:
        """Send what :meth:`membership_changed` held back (the group's members only)."""
        handle, self._flush = self._flush, None
        if handle is not None:
            handle.cancel()
        co = self.co
        if co.closed or self.told_version == co.members.version:
            return  # the members heard it with a peer loss
        group = self.gangs.group
        if self.told == group.generation:
            # they heard that their generation broke: the next formation's init carries
            # the counters (a further loss in it costs no message to every member)
            self.told_version = co.members.version
            return
        co.broadcast({"op": "daskdist-membership", "name": co.name, **co.members.counters()},
                     group.sessions, addressed=True)
        self.told_version = co.members.version

    def cancel_gangs(self, owner: str) -> list[Outcome]:
        """Cancel ``owner``'s pending gangs: their outcomes."""
        return [Outcome(g.cid, CANCELLED, None, None, g.attempt, g.owner)
                for g in self.gangs.cancel_pending(owner)]

    def gangs_of(self, owner: str) -> list[str]:
        """The ids of ``owner``'s gangs not finished (running or pending)."""
        g = self.gangs
        return [x.cid for x in (g.running, *g.pending) if x is not None and x.owner == owner]

    def gang_owner(self) -> str | None:
        """The owner of the gang running now (``None``: none)."""
        running = self.gangs.running
        return None if running is None else running.owner

    def described(self) -> dict:
        """The group's description for the dashboard: the driver's, or, while a member
        is leaving (or before the driver is made), what the book knows of it."""
        group = self.gangs.group
        try:
            if self.driver is not None:
                return self.driver.info()
        except KeyError:  # a group session already left the membership
            pass
        return {"generation": group.generation, "world_size": len(group.sessions),
                "members": [], "backend": group.backend, "formed": False,
                "bootstrap_seconds": getattr(self.driver, "last_formation_seconds", 0.0)}

    def status(self) -> dict:
        """The group's part of the coordinator's status."""
        group = self.gangs.group
        return {"group_generation": group.generation, "group_size": len(group.sessions),
                "gangs_pending": len(self.gangs.pending)}

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self.changed.set()
        for event in self.commit_events.values():
            event.set()

    # -- commits (SPEC §4.2) -----------------------------------------------------------------
    async def gang_commit_part(self, session: str, key: Any, rank: int, world: int,
                               tokens: list, timeout: float = 60.0) -> bool:
        """Rank ``rank``'s part of a gang commit, sent by ``session``; the commit's outcome
        once every rank's part came (all or nothing: refused unless ``key``'s generation
        is the current group, ``session`` is its rank ``rank``, every member's session
        is live and every token is well formed). A commit whose parts did not all come
        within ``timeout`` seconds, at most the group's own timeout (a caller cannot
        keep a commit open longer), expires: refused, for good."""
        op = "daskdist_gang_commit_part"
        key = CommitKey.parse(key)
        rank = checks.integer(rank, f"{op}: rank", 0, checks.MAX_ITEMS)
        world = checks.integer(world, f"{op}: world", 1, checks.MAX_ITEMS)
        group = self.gangs.group
        timeout = min(checks.number(timeout, f"{op}: timeout", 0.0, 86400.0),
                      group.timeout)
        tokens = list(checks.items(tokens, f"{op}: tokens"))
        co = self.co
        sessions = group.sessions if key.generation == group.generation else None
        if sessions is not None and group.ranks.get(session) != rank:
            sessions = None  # a part from another rank's session: refused
        if sessions is not None:
            try:
                group_tokens(tokens)  # a malformed token refuses the commit
                co.note_trained(key.state, tokens)  # datasets trained under the State
            except ValueError:
                sessions = None
        ok = self.commits.add_part(co, key, rank, world, tokens, sessions,
                                   co.members.members)
        if ok is not None:
            self._commits_decided([key])
            return ok
        event = self.commit_events.get(key)
        if event is None:  # the first part of the key waits on a new event; later ones share it
            event = self.commit_events[key] = asyncio.Event()
        await wait_event(event, timeout)
        return self._outcome(key)

    def gang_commit(self, session: str, key: Any, world: int, parts: list) -> bool:
        """Every rank's part of a gang commit in one message, sent by the generation's
        rank 0 once the commit's allgather brought them (``parts``: one per rank, in rank
        order, each the rank's :func:`~daskdist.core.leases.commits.pack_tokens` ints): the
        commit's outcome, decided at once. One message per step instead of ``world``:
        O(parts) on the scheduler, with no waiter per part. Refused unless ``session``
        is rank 0 of ``key``'s generation, the current one, and every rank's part is
        there (each rank's rows are checked against the rows leased to that rank's
        session, as a part of its own would be)."""
        key, world = CommitKey.parse(key), int(world)
        co = self.co
        group = self.gangs.group
        sessions = group.sessions if key.generation == group.generation else None
        if sessions is not None and group.ranks.get(session) != 0:
            sessions = None  # only rank 0 speaks for the group
        tables: dict = {}
        if sessions is not None and key not in self.commits.recorded:
            try:
                tables = unpack_parts(checks.items(parts, "daskdist_gang_commit: parts"),
                                      sessions, co.dataset_of)
            except (TypeError, ValueError):
                sessions = None  # malformed: refused
        if sessions is not None:
            co.note_trained_tables(key.state, tables)  # datasets trained under the State
        ok = self.commits.add_all(co, key, world, tables, sessions, co.members.members)
        self._commits_decided([key])
        return ok

    def commit_outcome(self, session: str, key: Any) -> bool | dict:
        """Whether commit ``key`` was applied (a rank that missed the outcome asks). Not
        read-only by design: a commit still open is refused now, so every rank, and any
        part still on its way, gets the same definite answer."""
        return self._outcome(CommitKey.parse(key))

    def _outcome(self, key: CommitKey) -> bool:
        ok = self.commits.expire(key)
        self._commits_decided([key])
        return ok

    def state_commits(self, session: str, state: str, committed: bool = False) -> int | dict:
        """How many commits of State ``state`` happened (``committed``: one more, a plain
        commit its rank reports once), so ``sync()`` can tell a lost state from a fresh
        start."""
        state = checks.text(state, "daskdist_state_commits: state", 1024)
        if committed:
            self.commits.note_committed(state)
        return self.commits.committed(state)

    def _commits_decided(self, keys: list[CommitKey]) -> None:
        """Wake the parts still waiting for these commits' outcomes."""
        for key in keys:
            event = self.commit_events.pop(key, None)
            if event is not None:
                event.set()

    # -- the group and gang closures (client handlers) ---------------------------------------
    async def group_form(self, owner: str, token: str, backend: str = "auto",
                         timeout: float = 60.0, rejoin_grace: float | None = None) -> dict:
        """(Re-)form the collective group on the current workers; its description."""
        op = "daskdist_group_form"
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"{op}: backend must be 'auto', 'gloo' or 'nccl', got "
                             f"{backend!r}")
        timeout = checks.number(timeout, f"{op}: timeout", 0.0, 86400.0, lo_open=True)
        rejoin_grace = checks.optional(checks.number, rejoin_grace, f"{op}: rejoin_grace",
                                       0.0, 86400.0)
        self.gangs.configure(backend, timeout)
        driver = self.driver
        if rejoin_grace is not None:
            driver.rejoin_grace = rejoin_grace
        ok = await driver.form()
        info = driver.info()
        info["ok"] = ok
        return info

    def group_info(self) -> dict:
        return self.driver.info()

    async def schedule_gang(self, owner: str, token: str, cid: str, payload: list) -> dict:
        """Queue a gang closure; forms the group first if there is none yet."""
        op = "daskdist_schedule_gang"
        if not checks.text(cid, f"{op}: cid").startswith(f"{owner}-"):
            raise PermissionError(f"{op}: gang id {cid!r} is not one of owner {owner!r}'s")
        protocol.payload(payload, f"{op}: payload")
        driver = self.driver
        if not self.gangs.group.sessions:
            await driver.form()
        self.gangs.submit(cid, owner, payload)
        self.changed.set()
        driver.start()
        return driver.info()


# The group book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler). A commit from a session that ended is refused: ``False``.
GROUP_ROUTES = {
    "daskdist_group_form": Route(GroupBook.group_form, caller=OWNER),
    "daskdist_group_info": Route(GroupBook.group_info),
    "daskdist_schedule_gang": Route(GroupBook.schedule_gang, caller=OWNER),
    # elastic commits (SPEC §4.2)
    "daskdist_gang_commit_part": Route(GroupBook.gang_commit_part, caller=SESSION,
                                       ended=False),
    "daskdist_gang_commit": Route(GroupBook.gang_commit, caller=SESSION, ended=False),
    "daskdist_commit_outcome": Route(GroupBook.commit_outcome, caller=SESSION),
    "daskdist_state_commits": Route(GroupBook.state_commits, caller=SESSION),
}
