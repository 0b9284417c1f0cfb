"""Membership: a coordinator's worker sessions, their dense indices and their leases.

Pure bookkeeping (no Dask imports). A session is one worker plugin's life on one
worker; a joining session takes the lowest free index, so a replacement reuses a lost
worker's index and indices stay dense in steady state (SPEC §2.2). ``version`` grows on
every join and leave so workers (and elastic state) can tell that membership changed.

Each session holds a lease (:class:`LivenessTable`): it renews it (every
``liveness.renew-interval`` from the worker's event loop, and with every message it
sends); a session silent for ``lease-timeout`` is *expired*: the scheduler plugin ends
it like a lost worker and fences it (SPEC §2.4). Time is passed in (a monotonic
clock's seconds), so every transition is unit-tested without sleeping.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class SessionMembership:
    """One worker session's membership: its worker, logical index and state."""

    session: str
    address: str
    index: int
    draining: bool = False  # retiring: leaves the group at its next commit
    paused: bool = False  # memory-paused: no new closures, keeps its place in the group
    device: str = "cpu"
    gpu: str = ""  # the GPU's UUID, for telling members that share a GPU apart
    # still building its per-worker resources: not in the group, the membership
    # counters not bumped yet (the group's members train on meanwhile)
    warming: bool = False


@dataclass
class LivenessTable:
    """Last renewal time per live session; ``expired(now)`` names the silent ones.

    Sessions are kept in the order of their last renewal (a renewal moves its session
    to the end), so :meth:`expire` looks only at the sessions it expires, plus one:
    the liveness loop's tick costs O(1) however many sessions are live.
    """

    timeout: float = 30.0
    _last: OrderedDict[str, float] = field(default_factory=OrderedDict)
    expiries: int = 0  # sessions expired so far (cumulative)
    _ordered: bool = True  # False after a renewal older than the newest (re-sorted lazily)

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"lease-timeout must be positive, got {self.timeout!r}")

    def _touch(self, session: str, now: float) -> None:
        last = self._last
        if last and self._ordered and now < next(reversed(last.values())):
            self._ordered = False  # clocks passed in out of order (tests): sort later
        last[session] = now
        last.move_to_end(session)

    def renew(self, session: str, now: float) -> bool:
        """Record that ``session`` is alive at ``now``; ``False`` for an unknown session
        (never added, expired or forgotten: it must not come back to life)."""
        t = self._last.get(session)
        if t is None:
            return False
        if now > t:
            self._touch(session, now)
        return True

    def add(self, session: str, now: float) -> None:
        """A new session starts with a fresh lease."""
        self._touch(session, now)

    def last(self, session: str) -> float | None:
        """When ``session`` last renewed (``None``: not live)."""
        return self._last.get(session)

    def forget(self, session: str) -> None:
        """The session ended for another reason (worker left, plugin torn down)."""
        self._last.pop(session, None)

    def expire(self, now: float) -> list[str]:
        """Remove and return the sessions whose last renewal is older than ``timeout``."""
        last = self._last
        if not self._ordered:
            self._last = last = OrderedDict(sorted(last.items(), key=lambda kv: kv[1]))
            self._ordered = True
        limit = now - self.timeout
        out = []
        while last:
            s, t = next(iter(last.items()))
            if t >= limit:
                break
            last.popitem(last=False)
            out.append(s)
        self.expiries += len(out)
        return out

    def extend(self, seconds: float) -> None:
        """The scheduler itself did not listen for ``seconds`` (its event loop stalled):
        renewals sent meanwhile may still be unread, so no session is blamed for it
        (O(n), once per stall)."""
        if seconds > 0:
            for s in self._last:
                self._last[s] += seconds

    def __contains__(self, session: str) -> bool:
        return session in self._last

    def __len__(self) -> int:
        return len(self._last)


@dataclass
class Membership:
    """Sessions by id, at most one per worker address.

    Every operation costs O(1) (amortized O(log n) for an index), whatever the number
    of members: sessions are indexed by address, and free indices are kept in a heap.
    """

    members: dict[str, SessionMembership] = field(default_factory=dict)
    version: int = 0
    joins: int = 0
    leaves: int = 0
    warming: int = 0  # members still building their per-worker resources
    _by_address: dict[str, str] = field(default_factory=dict)  # address -> session
    _free: list[int] = field(default_factory=list)  # a heap of indices below _next
    _next: int = 0  # indices 0 .. _next - 1 were handed out
    leases: LivenessTable = field(default_factory=LivenessTable)  # the sessions' leases
    poll_base: float = 0.0  # ``scheduler.poll-interval``: see :meth:`poll_interval`
    renew_base: float = 1.0  # ``liveness.renew-interval``: see :meth:`renew_interval`

    def join(self, session: str, address: str, device: str = "cpu", gpu: str = "",
             now: float | None = None, warming: bool = False
             ) -> tuple[SessionMembership, SessionMembership | None]:
        """Add ``session`` (with a fresh lease at ``now``, when given); returns it and the
        older session of the same address it replaces. ``warming``: it builds its
        per-worker resources first, and counts as a join once :meth:`ready`.

        The caller must end the replaced session (its closures are put back).
        """
        if session in self.members:
            return self.members[session], None
        old = self.session_of(address)
        replaced = self.leave(old) if old is not None else None
        if self._free:
            index = heapq.heappop(self._free)
        else:
            index, self._next = self._next, self._next + 1
        member = SessionMembership(session, address, index, device=device, gpu=gpu,
                                   warming=warming)
        self.members[session] = member
        self._by_address[address] = session
        if now is not None:
            self.leases.add(session, now)
        if warming:
            self.warming += 1
        else:
            self.version += 1
            self.joins += 1
        return member, replaced

    def ready(self, session: str) -> bool:
        """A warming session built its resources: its join counts now (whether it
        did)."""
        member = self.members.get(session)
        if member is None or not member.warming:
            return False
        member.warming = False
        self.warming -= 1
        self.version += 1
        self.joins += 1
        return True

    def leave(self, session: str, counted: bool = True) -> SessionMembership | None:
        """Remove ``session`` (no-op if unknown); frees its index and drops its lease.
        ``counted=False``: the leave does not change ``version`` (a retired worker the
        group already left: its retirement was the change)."""
        self.leases.forget(session)
        member = self.members.pop(session, None)
        if member is not None:
            if self._by_address.get(member.address) == session:
                del self._by_address[member.address]
            if self.members:
                heapq.heappush(self._free, member.index)
            else:  # none left: indices start from 0 again
                self._free.clear()
                self._next = 0
            self.version += counted and not member.warming  # a warming one never counted
            self.warming -= member.warming
            self.leaves += 1
        return member

    def session_of(self, address: str) -> str | None:
        return self._by_address.get(address)

    def drain(self, address: str, draining: bool = True) -> str | None:
        """Mark the address's session as retiring (or, with ``draining=False``, back in
        service: a retirement Dask gave up); returns the session, if any."""
        session = self.session_of(address)
        if session is not None:
            self.members[session].draining = draining
        return session

    def __contains__(self, session: str) -> bool:
        return session in self.members

    def __len__(self) -> int:
        return len(self.members)

    def by_index(self) -> list[SessionMembership]:
        """Members in index order (the rank order of collective groups; O(n log n): for
        a group's formation, not per event)."""
        return sorted(self.members.values(), key=lambda m: m.index)

    def renew(self, session: str, now: float) -> bool:
        """A message from ``session``: its lease runs on. ``False`` if it is not a member
        (ended or expired: the worker must register a new session)."""
        return session in self.members and self.leases.renew(session, now)

    def counters(self) -> dict[str, int]:
        """The membership counters a worker session keeps (``State.commit()`` compares
        them): ``version`` (every join, leave or retirement) and ``joins`` (joins only:
        a change without one is Horovod's ``skip_sync``)."""
        return {"version": self.version, "joins": self.joins}

    def poll_interval(self) -> float:
        """How long a worker's long-poll waits for work: ``scheduler.poll-interval``,
        longer on large clusters so idle workers poll at most ~200 times a second
        (Dask's heartbeats: ``n / 200``)."""
        return max(self.poll_base, len(self.members) / 200)

    def renew_interval(self) -> float:
        """How often a worker session renews its lease (the register and exchange
        replies say): ``liveness.renew-interval``, growing like Dask's heartbeats
        (``n / 200`` seconds: at most ~200 renewals a second), at most a quarter of
        ``lease-timeout``."""
        base = self.renew_base
        return min(max(base, len(self.members) / 200), max(base, self.leases.timeout / 4))
