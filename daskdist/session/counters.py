"""The membership counters of each worker session, as the scheduler last told them,
and the counters each group generation was formed at: what an elastic State compares at
a commit to tell that workers joined or left. The worker plugin sets them (one thread:
its event loop); collective code reads them."""

from __future__ import annotations

from daskdist.session.scope import closure_scope_now

# Membership as this worker last heard it from the scheduler plugin, per worker *session*
# (one registration of one coordinator's plugin on this worker): a coordinator's
# counters are its own, so a new coordinator of the same name on the same workers (or a
# session registered anew after fencing) starts from the scheduler's count, never from
# an older coordinator's. The worker plugin updates it and forgets a session when it
# ends; collective code (elastic State.commit) reads the entry of its closure's session.
# ``(version, joins)``: ``version`` grows on every join, leave or retirement, ``joins``
# on joins only (a change without a join is "members only left": Horovod's skip_sync).
_membership: dict[str, tuple[int, int]] = {}


def _session_key(session: str | None = None) -> str:
    """``session``, else the session of the closure running in this thread ("" outside
    one: a group used without a coordinator)."""
    if session is not None:
        return session
    scope = closure_scope_now()
    services = scope.services if scope is not None else None
    return getattr(services, "session", "") or ""


def membership_version(session: str | None = None) -> int:
    """A counter the scheduler plugin bumps whenever a worker joins or leaves the
    coordinator of worker session ``session`` (default: the session of the closure
    running in this thread)."""
    return _membership.get(_session_key(session), (0, 0))[0]


def membership_joins(session: str | None = None) -> int:
    """How many workers ever joined that coordinator (the part of
    :func:`membership_version` that counts joins)."""
    return _membership.get(_session_key(session), (0, 0))[1]


def set_membership(version: int, joins: int | None = None,
                    session: str | None = None) -> None:
    """Record the scheduler's counters for ``session``; they never go back (a late
    message with older counts changes nothing)."""
    key = _session_key(session)
    old_version, old_joins = _membership.get(key, (0, 0))
    _membership[key] = (max(old_version, int(version)),
                        old_joins if joins is None else max(old_joins, int(joins)))


def forget_membership(session: str) -> None:
    """``session`` ended: its counters go (a worker lives through many sessions)."""
    _membership.pop(session, None)


# group generation -> the membership (version, joins) the scheduler formed it at;
# generations are unique across coordinators (the scheduler numbers them above any a
# worker has seen), so one table serves every session of this process
_formations: dict[int, tuple[int, int]] = {}


def formation_version(generation: int) -> int | None:
    """The membership version the scheduler formed ``generation`` at (``None``: unknown)."""
    counts = _formations.get(generation)
    return None if counts is None else counts[0]


def formation_joins(generation: int) -> int | None:
    """The joins count the scheduler formed ``generation`` at (``None``: unknown)."""
    counts = _formations.get(generation)
    return None if counts is None or counts[1] < 0 else counts[1]


def set_formation_version(generation: int, version: int | None,
                           joins: int | None = None) -> None:
    if version is not None:
        _formations[int(generation)] = (int(version), -1 if joins is None else int(joins))
        for g in [g for g in _formations if g < generation - 8]:
            del _formations[g]
