"""LivenessTable: which worker sessions renewed their lease in time, pure and synchronous.

A session renews its lease (every ``liveness.renew-interval`` from the worker's event
loop, and with every message it sends); a session silent for ``lease-timeout`` is
*expired*: the scheduler plugin ends it like a lost worker and fences it (SPEC §2.4).
Time is passed in (a monotonic clock's seconds), so every transition is unit-tested
without sleeping. Imports nothing from Dask or the rest of the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LivenessTable:
    """Last renewal time per live session; ``expired(now)`` names the silent ones."""

    timeout: float = 30.0
    _last: dict[str, float] = field(default_factory=dict)
    expiries: int = 0  # sessions expired so far (cumulative)

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"lease-timeout must be positive, got {self.timeout!r}")

    def renew(self, session: str, now: float) -> bool:
        """Record that ``session`` is alive at ``now``; ``False`` for an unknown session
        (never added, expired or forgotten: it must not come back to life)."""
        if session not in self._last:
            return False
        if now > self._last[session]:
            self._last[session] = now
        return True

    def add(self, session: str, now: float) -> None:
        """A new session starts with a fresh lease."""
        self._last[session] = now

    def forget(self, session: str) -> None:
        """The session ended for another reason (worker left, plugin torn down)."""
        self._last.pop(session, None)

    def expire(self, now: float) -> list[str]:
        """Remove and return the sessions whose last renewal is older than ``timeout``."""
        limit = now - self.timeout
        out = [s for s, t in self._last.items() if t < limit]
        for s in out:
            del self._last[s]
        self.expiries += len(out)
        return out

    def extend(self, seconds: float) -> None:
        """The scheduler itself did not listen for ``seconds`` (its event loop stalled):
        renewals sent meanwhile may still be unread, so no session is blamed for it."""
        if seconds > 0:
            for s in self._last:
                self._last[s] += seconds

    def __contains__(self, session: str) -> bool:
        return session in self._last

    def __len__(self) -> int:
        return len(self._last)
