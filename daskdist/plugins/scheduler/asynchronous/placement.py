"""Which member takes an asynchronous model's role (its holder, its standby): the member
with the fewest model roles, then the longest a member, neither retiring nor with a
preemption deadline near. Pure: reads the models' ledgers and the membership.

A member with no role ends the search: it costs O(models + the members passed over,
which hold roles or are leaving), not a walk of every member, however many there are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from daskdist.core.asynchronous.ledger import ModelLedger
from daskdist.core.membership import Membership


def least_busy(models: Iterable[ModelLedger], members: Membership,
               leaving: Callable[[str], bool], exclude: tuple) -> str | None:
    """The session to give a role to (``None``: no member may take one); ``exclude``:
    sessions that may not (the model's holder, a standby being replaced)."""
    roles: dict[str, int] = {}
    for led in models:
        for s in (led.holder, led.standby, led.target):
            if s:
                roles[s] = roles.get(s, 0) + 1
    best = None  # (roles, session): the first member (in joining order) with the fewest
    for m in members.members.values():  # joining order
        if m.draining or m.session in exclude or leaving(m.session):
            continue
        busy = roles.get(m.session, 0)
        if best is None or busy < best[0]:
            best = (busy, m.session)
            if not busy:
                break
    return None if best is None else best[1]
