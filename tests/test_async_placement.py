"""Where an asynchronous model's roles go (``placement.least_busy``, pure): the member with
the fewest roles of any model, then the longest a member, never one excluded, draining
or leaving; checked against a brute-force reference over random memberships (hypothesis),
and at 20,000 members its search stops at the first member without a role."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from daskdist.core.membership import Membership
from daskdist.plugins.scheduler.asynchronous.placement import least_busy


def _membership(n: int, left: list[int], draining: set[int]) -> Membership:
    members = Membership()
    for i in range(n):
        members.join(f"s{i}", f"w{i}")
    for i in left:  # a member left, a new one joined (indices reused, joining order not)
        if f"s{i}" in members.members:
            members.leave(f"s{i}")
            members.join(f"r{i}", f"v{i}")
    for i in draining:
        address = f"w{i}"
        if members.session_of(address) is not None:
            members.drain(address)
    return members


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 12), left=st.lists(st.integers(0, 11), max_size=4),
       draining=st.sets(st.integers(0, 11), max_size=3),
       roles=st.lists(st.tuples(*(st.one_of(st.none(), st.integers(0, 15)),) * 3),
                      max_size=4),
       leaving=st.sets(st.integers(0, 15), max_size=3),
       exclude=st.sets(st.integers(0, 15), max_size=2))
def test_the_fewest_roles_then_the_longest_a_member(n, left, draining, roles, leaving,
                                                    exclude):
    members = _membership(n, left, draining)
    sessions = list(members.members)  # joining order

    def name(i):
        return None if i is None or i >= len(sessions) else sessions[i]

    models = [SimpleNamespace(holder=name(h), standby=name(s), target=name(t))
              for h, s, t in roles]
    gone = {name(i) for i in leaving} - {None}
    excluded = tuple({name(i) for i in exclude} - {None})
    got = least_busy(models, members, gone.__contains__, excluded)

    def busy(s):
        return sum((m.holder == s) + (m.standby == s) + (m.target == s) for m in models)

    allowed = [s for s in sessions if not members.members[s].draining
               and s not in excluded and s not in gone]
    expected = min(allowed, key=lambda s: (busy(s), sessions.index(s)), default=None)
    assert got == expected


def test_a_member_without_a_role_ends_the_search_among_thousands():
    members = _membership(20_000, [], set())
    asked = []

    def leaving(session):
        asked.append(session)
        return False

    holder = SimpleNamespace(holder="s0", standby=None, target=None)
    assert least_busy([holder], members, leaving, ("s0",)) == "s1"
    assert len(asked) == 1  # s0 excluded before asking, s1 has no role: done
