"""Membership: which worker sessions belong to a coordinator and their dense indices.

Pure bookkeeping (no Dask imports). A session is one worker plugin's life on one
worker; a joining session takes the lowest free index, so a replacement reuses a lost
worker's index and indices stay dense in steady state (SPEC §2.2). ``version`` grows on
every join and leave so workers (and elastic state) can tell that membership changed.
"""

from __future__ import annotations

import heapq
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
    _by_address: dict[str, str] = field(default_factory=dict)  # address -> session
    _free: list[int] = field(default_factory=list)  # a heap of indices below _next
    _next: int = 0  # indices 0 .. _next - 1 were handed out

    def join(self, session: str, address: str, device: str = "cpu",
             gpu: str = "") -> tuple[SessionMembership, SessionMembership | None]:
        """Add ``session``; returns it and the older session of the same address it replaces.

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
        member = SessionMembership(session, address, index, device=device, gpu=gpu)
        self.members[session] = member
        self._by_address[address] = session
        self.version += 1
        self.joins += 1
        return member, replaced

    def leave(self, session: str, counted: bool = True) -> SessionMembership | None:
        """Remove ``session`` (no-op if unknown); frees its index. ``counted=False``: the
        leave does not change ``version`` (a retired worker the group already left: its
        retirement was the change)."""
        member = self.members.pop(session, None)
        if member is not None:
            if self._by_address.get(member.address) == session:
                del self._by_address[member.address]
            if self.members:
                heapq.heappush(self._free, member.index)
            else:  # none left: indices start from 0 again
                self._free.clear()
                self._next = 0
            self.version += counted
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
