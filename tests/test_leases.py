"""The pure lease/ack state machine behind the dynamic policy (exactly-once bookkeeping)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from daskdist.core.intervals import intervals_from_ids, normalize, subtract, union
from daskdist.core.leases import LeaseTable, SessionExpired

DS = "ds"


def test_acquire_in_stable_order_then_none():
    t = LeaseTable()
    assert t.acquire("a", DS, 0, [3, 0, 2]) == (0, [(0, 3)])
    assert t.acquire("b", DS, 0, [3, 0, 2]) == (2, [(3, 5)])  # empty unit skipped
    assert t.acquire("a", DS, 0, [3, 0, 2]) is None
    p = t.progress(DS, 0)
    assert (p["total"], p["leased"], p["free"], p["acknowledged"], p["complete"]) == (
        5, 5, 0, 0, False)
    t.check()


def test_unit_rows_must_agree():
    t = LeaseTable()
    t.acquire("a", DS, 0, [4, 4])
    with pytest.raises(ValueError, match="differ"):
        t.acquire("a", DS, 0, [4, 5])
    t.acquire("a", DS, 1, [4, 5])  # another epoch is another table


def test_ack_is_fenced_and_exactly_once():
    t = LeaseTable()
    t.acquire("a", DS, 0, [10])
    assert not t.ack("b", DS, 0, [(0, 2)])  # not leased to b
    assert not t.ack("a", DS, 0, [(0, 11)])  # out of range
    assert not t.ack("a", DS, 7, [(0, 2)])  # unknown epoch
    assert t.ack("a", DS, 0, [(0, 2), (4, 5)])
    assert not t.ack("a", DS, 0, [(1, 3)])  # row 1 already acknowledged: all or nothing
    assert t.progress(DS, 0)["acknowledged"] == 3
    assert t.leased_to("a", DS, 0) == [(2, 4), (5, 10)]
    t.check()


def test_release_returns_rows_and_drop_session_fences():
    t = LeaseTable()
    assert t.acquire("a", DS, 0, [6, 6]) == (0, [(0, 6)])
    assert t.acquire("b", DS, 0, [6, 6]) == (1, [(6, 12)])
    assert t.release("a", DS, 0, [(1, 3), (7, 8)]) == 2  # (7, 8) is b's: ignored
    assert t.acquire("b", DS, 0, [6, 6]) == (0, [(1, 3)])
    assert t.ack("b", DS, 0, [(1, 3), (6, 9)])
    assert t.drop_session("b") == 3  # (9, 12) back to free
    assert not t.ack("b", DS, 0, [(9, 10)])  # late message from an expired session
    with pytest.raises(SessionExpired):
        t.acquire("b", DS, 0, [6, 6])
    assert t.acquire("c", DS, 0, [6, 6]) == (1, [(9, 12)])
    p = t.progress(DS, 0)
    assert (p["acknowledged"], p["leased"], p["free"]) == (5, 7, 0)
    t.check()


def test_ack_tokens_is_atomic_across_epochs():
    t = LeaseTable()
    t.acquire("a", DS, 0, [4])
    t.acquire("a", DS, 1, [4])
    good = ("lease", DS, 0, [(0, 2)])
    bad = ("lease", DS, 1, [(0, 5)])
    assert not t.ack_tokens("a", [good, bad, ("other", 1)])
    assert t.progress(DS, 0)["acknowledged"] == 0
    assert t.ack_tokens("a", [good, ("lease", DS, 1, [(0, 4)]), "not a token"])
    assert t.progress(DS, 1)["complete"]
    assert t.release_tokens("a", [("lease", DS, 0, [(2, 4)])]) == 2
    t.check()


def test_progress_of_unknown_table_is_not_complete():
    t = LeaseTable()
    assert t.progress(DS, 0) == {
        "dataset_id": DS, "epoch": 0, "known": False, "total": 0, "acknowledged": 0,
        "leased": 0, "free": 0, "units": 0, "complete": False}
    assert t.progress(DS, 0, [0, 0])["complete"]  # an empty epoch is complete at once
    t.forget(DS)
    assert not t.progress(DS, 0)["known"]


def test_memory_is_intervals_not_rows():
    t = LeaseTable()
    rows = [1_000_000] * 50
    for s in range(50):
        t.acquire(f"s{s}", DS, 0, rows)
    for s in range(49):
        assert t.ack(f"s{s}", DS, 0, [(s * 1_000_000, (s + 1) * 1_000_000)])
    ep = t._epochs[(DS, 0)]
    assert sum(len(u.acked) + len(u.free) for u in ep.units) == 49
    assert t.ack("s49", DS, 0, [(49_000_000, 50_000_000)])
    assert t.progress(DS, 0)["complete"]


def test_completed_epoch_table_is_dropped_and_stays_complete():
    t = LeaseTable()
    for epoch in range(3):
        t.acquire("a", DS, epoch, [4, 4])
        t.acquire("a", DS, epoch, [4, 4])
        assert t.ack_tokens("a", [("lease", DS, epoch, [(0, 8)])])
    assert t._epochs == {} and t.epochs_completed == 3
    assert t._completed == {DS: (8, [(0, 3)])}  # one interval, not one entry per epoch
    p = t.progress(DS, 1, [4, 4])
    assert (p["complete"], p["acknowledged"], p["total"], p["free"]) == (True, 8, 8, 0)
    assert t.progress(DS, 2)["complete"]
    assert t.acquire("b", DS, 1, [4, 4]) is None  # no table comes back to life
    assert t._epochs == {}
    assert t.acknowledged(DS, 0) == [(0, 8)]
    assert not t.ack("a", DS, 0, [(0, 1)])  # nothing is leased in a completed epoch
    assert not t.progress(DS, 3)["known"]
    t.forget(DS, 1)
    assert not t.progress(DS, 1)["complete"] and t.progress(DS, 2)["complete"]
    t.check()


def test_expired_sessions_kept_bounded():
    t = LeaseTable(max_expired=3)
    for i in range(10):
        t.acquire(f"s{i}", DS, 0, [1] * 10)
        t.drop_session(f"s{i}")
    assert t.sessions_dropped == 10 and len(t._expired) == 3
    assert t.is_expired("s9") and not t.is_expired("s0")
    assert t._session_keys == {}
    t.check()


def test_malformed_lease_token_is_refused_not_skipped():
    t = LeaseTable()
    t.acquire("a", DS, 0, [4])
    good = ("lease", DS, 0, [(0, 2)])
    for bad in [("lease", DS, 0), ("lease", DS, "x", [(0, 1)]), ("lease", DS, 0, [(0,)]),
                ("lease", DS, 0, 5)]:
        assert not t.ack_tokens("a", [good, bad])
        assert t.progress(DS, 0)["acknowledged"] == 0
        assert t.release_tokens("a", [good, bad]) == 0
    assert t.leased_to("a", DS, 0) == [(0, 4)]
    assert t.ack_tokens("a", [good, ("gang", 1)])  # tokens of other kinds are not leases
    t.check()


# -- stateful: random acquire / consume / ack / release / drop keep the invariant ------


class LeaseMachine(RuleBasedStateMachine):
    """Workers lease units, closures take slices of their leases and then complete
    (ack) or fail (release); workers are lost (drop). A model tracks which rows were
    acknowledged, to check exactly-once at the end."""

    tokens = Bundle("tokens")

    @initialize(unit_rows=st.lists(st.integers(0, 12), min_size=1, max_size=6))
    def setup(self, unit_rows):
        self.table = LeaseTable()
        self.unit_rows = unit_rows
        self.total = sum(unit_rows)
        self.live = ["w0", "w1", "w2"]
        self.next_worker = 3
        self.held: dict[str, list[tuple[int, int]]] = {w: [] for w in self.live}
        self.acked = Counter()
        self.done: set[int] = set()  # tokens already acknowledged (by identity)

    @rule(w=st.integers(0, 2))
    def acquire(self, w):
        s = self.live[w % len(self.live)]
        got = self.table.acquire(s, DS, 0, self.unit_rows)
        if got is not None:
            u, ranges = got
            assert ranges and ranges == normalize(ranges)
            self.held[s] = union(self.held[s], ranges)

    @rule(target=tokens, w=st.integers(0, 2), frac=st.floats(0, 1))
    def consume(self, w, frac):
        s = self.live[w % len(self.live)]
        ids = [i for a, b in self.held[s] for i in range(a, b)]
        take = ids[: max(1, int(len(ids) * frac))] if ids else []
        piece = intervals_from_ids(take)
        self.held[s] = subtract(self.held[s], piece)
        return (s, piece)

    @rule(tok=consumes(tokens))
    def ack(self, tok):
        s, piece = tok
        if not piece:
            return
        ok = self.table.ack(s, DS, 0, piece)
        assert ok == (not self.table.is_expired(s) and id(piece) not in self.done)
        if ok:
            for a, b in piece:
                self.acked.update(range(a, b))

    @rule(tok=consumes(tokens))
    def release(self, tok):
        s, piece = tok
        self.table.release(s, DS, 0, piece)

    @rule(tok=tokens)
    def duplicate_ack_is_refused(self, tok):
        s, piece = tok
        if piece and self.table.ack(s, DS, 0, piece):
            self.done.add(id(piece))
            for a, b in piece:  # first delivery of a still-open token: allowed once
                self.acked.update(range(a, b))
            assert not self.table.ack(s, DS, 0, piece)

    @precondition(lambda self: len(self.live) > 1)
    @rule(w=st.integers(0, 2))
    def drop(self, w):
        s = self.live.pop(w % len(self.live))
        self.table.drop_session(s)
        self.held.pop(s)
        new = f"w{self.next_worker}"
        self.next_worker += 1
        self.live.append(new)
        self.held[new] = []

    @invariant()
    def invariant(self):
        if hasattr(self, "table"):
            self.table.check()
            p = self.table.progress(DS, 0)
            if p["known"]:
                assert p["acknowledged"] + p["leased"] + p["free"] == self.total
                assert p["acknowledged"] == sum(self.acked.values())
            assert all(c == 1 for c in self.acked.values())

    def teardown(self):
        if not hasattr(self, "table"):
            return
        # Drain: every live worker's held rows and the pool are consumed and acked.
        for s in list(self.live):
            self.table.drop_session(s)
        s = "drainer"
        while (got := self.table.acquire(s, DS, 0, self.unit_rows)) is not None:
            _, ranges = got
            assert self.table.ack(s, DS, 0, ranges)
            for a, b in ranges:
                self.acked.update(range(a, b))
        self.table.check()
        assert self.table.progress(DS, 0)["complete"]
        assert sorted(self.acked) == list(range(self.total))
        assert all(c == 1 for c in self.acked.values())


LeaseMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30,
                                          deadline=None)
TestLeaseMachine = LeaseMachine.TestCase


def test_newest_epochs_include_completed_ones_whose_tables_are_dropped():
    t = LeaseTable()
    s = "s"
    for epoch in (0, 1):
        u, ranges = t.acquire(s, "ds", epoch, [4])
        assert t.ack(s, "ds", epoch, ranges)
    assert t.newest_epochs() == {"ds": 1}
    assert t.acquire(s, "other", 3, [2]) is not None  # live, not complete
    assert t.newest_epochs() == {"ds": 1, "other": 3}
    assert t.progress("ds", 1)["complete"] and not t.progress("other", 3)["complete"]


def test_acknowledging_several_sessions_at_once_completes_and_drops_the_epoch():
    """A gang commit acknowledges every rank's rows in one call; the epoch it completes
    drops its table like any other (memory stays bounded)."""
    told = []
    t = LeaseTable(on_ack=lambda *a: told.append(a))
    a = t.acquire("a", "ds", 0, [3, 4])
    b = t.acquire("b", "ds", 0, [3, 4])
    tok = {"a": [("lease", "ds", 0, a[1])], "b": [("lease", "ds", 0, b[1])]}
    assert not t.ack_sessions({"a": tok["b"], "b": tok["a"]})  # crossed: refused whole
    assert not t.is_complete("ds", 0) and t.progress("ds", 0)["acknowledged"] == 0
    assert not told  # a refused acknowledgement is not counted
    assert t.ack_sessions(tok)
    assert t.is_complete("ds", 0) and t.newest_epochs() == {"ds": 0}
    assert sorted(told) == [("a", "ds", 3), ("b", "ds", 4)]  # the dashboard's counters
