"""LivenessTable: which worker sessions renewed their lease in time, pure and synchronous.

A session renews its lease (every ``liveness.renew-interval`` from the worker's event
loop, and with every message it sends); a session silent for ``lease-timeout`` is
*expired*: the scheduler plugin ends it like a lost worker and fences it (SPEC §2.4).
Time is passed in (a monotonic clock's seconds), so every transition is unit-tested
without sleeping. Imports nothing from Dask or the rest of the package.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


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
