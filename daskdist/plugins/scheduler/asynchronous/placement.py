"""Which member takes an asynchronous model's role (its holder, its standby): the member
with the fewest model roles, then the lowest index, neither retiring nor with a
preemption deadline near. Pure: reads the models' ledgers and the membership.
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
    best = None
    for m in members.members.values():
        if m.draining or m.session in exclude or leaving(m.session):
            continue
        key = (roles.get(m.session, 0), m.index)
        if best is None or key < best[0]:
            best = (key, m.session)
    return None if best is None else best[1]
