"""The pure lease/ack state machine behind the dynamic policy (exactly-once bookkeeping)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
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
from daskdist.core.leases import resume
from daskdist.core.leases.table import (
    EpochFailed,
    LeaseTable,
    SessionExpired,
    UnknownDataset,
    unit_runs,
)
from daskdist.core.leases.units import DenseUnits
from tests.tables import check_leases, leased_to

DS = "ds"


def table(unit_rows, **kw) -> LeaseTable:
    t = LeaseTable(**kw)
    t.define(DS, unit_runs(unit_rows))
    return t


def test_units_are_defined_once_as_runs():
    assert unit_runs([3, 3, 3, 0, 2, 2]) == [(3, 3), (0, 1), (2, 2)]
    units = DenseUnits(unit_runs([1000] * 999 + [7]))
    assert (units.units, units.total, units.nbytes()) == (1000, 999_007, 8 + 2 * 16)
    assert units.stop_of(0) == 1000 and units.stop_of(1999) == 2000
    assert units.stop_of(999_000) == 999_007
    t = table([4, 4])
    t.define(DS, [(4, 2)])  # the same definition again: fine
    with pytest.raises(ValueError, match="'ds'.*differ.*2 units / 9 rows given"):
        t.define(DS, unit_runs([4, 5]))
    with pytest.raises(ValueError, match="rows >= 0"):
        t.define("other", [(-1, 2)])
    with pytest.raises(UnknownDataset, match="not defined"):
        t.acquire("a", "nope", 0, 1)


def test_a_lease_covers_the_rows_asked_for_in_whole_consecutive_units():
    t = table([100] * 1000)
    assert t.acquire("a", DS, 0, 250, parts=1) == [(0, 300)]  # up to a unit's end
    assert t.acquire("b", DS, 0, 1, parts=1) == [(300, 400)]
    # at most a share of what is left: free / (2 * parts), in whole units
    assert t.acquire("c", DS, 0, 10**9, parts=4) == [(400, 12_900)]
    # ... but never less than ``least`` (2 batches: a lease worth its round trip)
    assert t.acquire("d", DS, 0, 10**9, parts=10**6, least=1000) == [(12_900, 13_900)]
    assert t.acquire("d", DS, 0, 500, parts=10**6, least=1000) == [(13_900, 14_400)]
    assert leased_to(t, "a", DS, 0) == [(0, 300)]
    check_leases(t)


def test_the_end_of_an_epoch_is_shared_and_empty_units_skipped():
    t = table([3, 0, 2])
    assert t.acquire("a", DS, 0, 1) == [(0, 3)]
    assert t.acquire("b", DS, 0, 1) == [(3, 5)]
    assert t.acquire("a", DS, 0, 1) is None
    p = t.progress(DS, 0)
    assert (p["total"], p["leased"], p["free"], p["acknowledged"], p["units"]) == (5, 5, 0, 0, 3)
    check_leases(t)


def test_ack_is_fenced_and_exactly_once():
    t = table([10])
    t.acquire("a", DS, 0, 1)
    assert not t.ack("b", DS, 0, [(0, 2)])  # not leased to b
    assert not t.ack("a", DS, 0, [(0, 11)])  # out of range
    assert not t.ack("a", DS, 7, [(0, 2)])  # unknown epoch
    assert t.ack("a", DS, 0, [(0, 2), (4, 5)])
    assert not t.ack("a", DS, 0, [(1, 3)])  # row 1 already acknowledged: all or nothing
    assert t.progress(DS, 0)["acknowledged"] == 3
    assert leased_to(t, "a", DS, 0) == [(2, 4), (5, 10)]
    check_leases(t)


def test_release_returns_rows_and_drop_session_fences():
    t = table([6, 6])
    assert t.acquire("a", DS, 0, 1) == [(0, 6)]
    assert t.acquire("b", DS, 0, 1) == [(6, 12)]
    assert t.release("a", DS, 0, [(1, 3), (7, 8)]) == 2  # (7, 8) is b's: ignored
    assert t.acquire("b", DS, 0, 1) == [(1, 3)]
    assert t.ack("b", DS, 0, [(1, 3), (6, 9)])
    assert t.drop_session("b") == 3  # (9, 12) back to free
    assert not t.ack("b", DS, 0, [(9, 10)])  # late message from an expired session
    with pytest.raises(SessionExpired):
        t.acquire("b", DS, 0, 1)
    assert t.acquire("c", DS, 0, 1) == [(9, 12)]
    p = t.progress(DS, 0)
    assert (p["acknowledged"], p["leased"], p["free"]) == (5, 7, 0)
    check_leases(t)


def test_ack_tokens_is_atomic_across_epochs():
    t = table([4])
    t.acquire("a", DS, 0, 1)
    t.acquire("a", DS, 1, 1)
    good = ("lease", DS, 0, [(0, 2)])
    bad = ("lease", DS, 1, [(0, 5)])
    assert not t.ack_tokens("a", [good, bad, ("other", 1)])
    assert t.progress(DS, 0)["acknowledged"] == 0
    assert t.ack_tokens("a", [good, ("lease", DS, 1, [(0, 4)]), "not a token"])
    assert t.progress(DS, 1)["complete"]
    assert t.release_tokens("a", [("lease", DS, 0, [(2, 4)])]) == 2
    check_leases(t)


def test_only_with_says_when_an_epochs_last_rows_are_one_sessions():
    """An asynchronous model's staged rows are its own session's: once every row not
    acknowledged is with it (none free, none with a reader), its holder copies at once."""
    t = table([4, 4])
    a = t.acquire("a", DS, 0, 4)
    b = t.acquire("b", DS, 0, 4)
    tok_a, tok_b = ("lease", DS, 0, a), ("lease", DS, 0, b)
    assert t.transfer_tokens("a", "async:m", [tok_a])
    epoch = [(DS, 0)]
    assert not t.only_with("async:m", epoch)  # b still reads its rows
    assert t.release_tokens("b", [tok_b]) == 4
    assert not t.only_with("async:m", epoch)  # b's rows are free again
    b = t.acquire("b", DS, 0, 4)
    assert t.transfer_tokens("b", "async:m", [("lease", DS, 0, b)])
    assert t.only_with("async:m", epoch) and not t.only_with("b", epoch)
    assert not t.only_with("async:m", []) and not t.only_with("async:m", [(DS, 1)])
    assert t.ack_tokens("async:m", [tok_a])
    assert t.only_with("async:m", epoch)  # acknowledged rows count as done
    assert t.ack_tokens("async:m", [("lease", DS, 0, b)])
    assert not t.only_with("async:m", epoch)  # the epoch completed: nothing open
    check_leases(t)


def test_progress_is_read_only():
    t = LeaseTable()
    assert t.progress(DS, 0) == {
        "dataset_id": DS, "name": "", "epoch": 0, "known": False, "total": 0,
        "acknowledged": 0, "leased": 0, "free": 0, "units": 0, "complete": False,
        "failed": None}
    assert t.datasets == {}  # asking about a dataset never creates one
    t.define(DS, [(5, 2)], label="train")
    p = t.progress(DS, 3)
    assert (p["known"], p["name"], p["total"], p["free"], p["complete"]) == (
        True, "train", 10, 10, False)
    assert t.datasets[DS].epochs == {}  # nor an epoch's table
    t.define("empty", [(0, 2)])
    assert t.progress("empty", 0)["complete"]  # an empty dataset is complete at once
    assert t.forget(DS) and not t.progress(DS, 0)["known"]


def test_memory_is_intervals_not_rows_or_units():
    units = 10**6
    t = table([1000] * units)
    assert t.datasets[DS].units.nbytes() == 24  # the definition: one run
    for s in range(50):  # 50 sessions, one lease each, acknowledged in 250-row batches
        (a, b), = t.acquire(f"s{s}", DS, 0, 100_000, parts=1)
        for x in range(a, b, 250):
            assert t.ack(f"s{s}", DS, 0, [(x, min(b, x + 250))])
    ep = t.datasets[DS].epochs[0]
    assert len(ep.acked) == 1 and len(ep.free) == 1 and not ep.leased
    assert t.progress(DS, 0)["acknowledged"] == 50 * 100_000


def test_completed_epoch_table_is_dropped_and_stays_complete():
    t = table([4, 4])
    for epoch in range(3):
        lease = t.acquire("a", DS, epoch, 8, parts=1) + (t.acquire("a", DS, epoch, 8) or [])
        assert t.ack_tokens("a", [("lease", DS, epoch, lease)])
    assert t.datasets[DS].epochs == {}
    assert t.datasets[DS].completed == [(0, 3)]  # one interval, not one entry per epoch
    assert t._session_keys == {}
    p = t.progress(DS, 1)
    assert (p["complete"], p["acknowledged"], p["total"], p["free"]) == (True, 8, 8, 0)
    assert t.acquire("b", DS, 1, 1) is None  # no table comes back to life
    assert t.datasets[DS].epochs == {}
    assert t.acknowledged(DS, 0) == [(0, 8)]
    assert not t.ack("a", DS, 0, [(0, 1)])  # nothing is leased in a completed epoch
    assert not t.progress(DS, 3)["complete"] and t.newest_epochs() == {DS: 2}
    check_leases(t)


def test_expired_sessions_kept_bounded():
    t = table([1] * 10, max_expired=3)
    for i in range(10):
        t.acquire(f"s{i}", DS, 0, 1)
        t.drop_session(f"s{i}")
    assert len(t._expired) == 3 and t._session_keys == {}
    with pytest.raises(SessionExpired):  # the newest stay refused
        t.acquire("s9", DS, 0, 1)
    assert t.acquire("s0", DS, 0, 1)  # the oldest forgotten
    check_leases(t)


def test_malformed_lease_token_is_refused_not_skipped():
    t = table([4])
    t.acquire("a", DS, 0, 1)
    good = ("lease", DS, 0, [(0, 2)])
    for bad in [("lease", DS, 0), ("lease", DS, "x", [(0, 1)]), ("lease", DS, 0, [(0,)]),
                ("lease", DS, 0, 5)]:
        assert not t.ack_tokens("a", [good, bad])
        assert t.progress(DS, 0)["acknowledged"] == 0
        assert t.release_tokens("a", [good, bad]) == 0
    assert leased_to(t, "a", DS, 0) == [(0, 4)]
    assert t.ack_tokens("a", [good, ("gang", 1)])  # tokens of other kinds are not leases
    check_leases(t)


def test_failed_reads_defer_their_rows_then_fail_the_epoch():
    t = table([10, 10, 10], max_failures=2)
    assert t.acquire("a", DS, 0, 1) == [(0, 10)]
    assert t.release("a", DS, 0, [(0, 10)], failure=("bad.parquet", "bad.parquet: eof")) == 10
    # its rows are served after every other free row: the rest of the epoch goes on
    assert t.acquire("b", DS, 0, 1) == [(10, 20)]
    assert t.acquire("b", DS, 0, 1) == [(20, 30)]
    assert t.progress(DS, 0)["free"] == 10 and t.progress(DS, 0)["failed"] is None
    assert t.acquire("a", DS, 0, 1) == [(0, 10)]
    assert t.release("a", DS, 0, [(0, 10)], failure=("bad.parquet", "bad.parquet: eof")) == 10
    p = t.progress(DS, 0)
    assert "bad.parquet: eof" in p["failed"] and "failed 2 times" in p["failed"]
    with pytest.raises(EpochFailed, match="bad.parquet"):
        t.acquire("b", DS, 0, 1)
    assert t.ack("b", DS, 0, [(10, 30)])  # rows read before the failure still count
    check_leases(t)
    # a failure reported under nothing held counts nothing (a fenced or stale report)
    t2 = table([10], max_failures=1)
    assert t2.release("a", DS, 0, [(0, 10)], failure=("f", "m")) == 0
    assert t2.acquire("a", DS, 0, 1) == [(0, 10)]


def test_an_epoch_starts_from_an_exported_ledger():
    t = table([10] * 10)
    assert t.acquire("a", DS, 4, 30, parts=1) == [(0, 30)]
    assert t.ack("a", DS, 4, [(0, 7), (12, 20)])
    ledger = t.acknowledged(DS, 4)
    assert ledger == [(0, 7), (12, 20)]
    assert t.acknowledged(DS, 5) == []  # not started
    # a new dataset over the same units (a new coordinator) continues the epoch
    t2 = table([10] * 10)
    resume.start_epoch(t2, DS, 4, ledger)
    p = t2.progress(DS, 4)
    assert (p["acknowledged"], p["free"], p["complete"]) == (15, 85, False)
    got = []
    while (lease := t2.acquire("b", DS, 4, 20)) is not None:
        assert t2.ack("b", DS, 4, lease)
        got += lease
    assert union(normalize(got), ledger) == [(0, 100)]  # every row once:
    assert subtract(ledger, normalize(got)) == ledger  # none of the ledger's again
    assert t2.progress(DS, 4)["complete"]
    with pytest.raises(ValueError, match="started already"):
        resume.start_epoch(t2, DS, 4, [])
    with pytest.raises(ValueError, match="outside"):
        resume.start_epoch(t2, DS, 6, [(90, 101)])
    t3 = table([10] * 10)
    resume.start_epoch(t3, DS, 0, [(0, 100)])  # a complete ledger completes the epoch at once
    assert t3.is_complete(DS, 0) and t3.datasets[DS].epochs == {}


def test_datasets_go_with_their_handle_or_owner():
    t = LeaseTable()
    t.register("rid1", "train", "owner-a")
    t.define("rid1", [(5, 2)])
    t.define("rid1.1", [(3, 1)])  # a second loader of the same per-worker dataset
    t.define("rid2", [(5, 2)], "eval", "owner-b")
    assert t.datasets["rid1.1"].owner == "owner-a"
    t.acquire("s", "rid1", 0, 1)
    t.acquire("s", "rid1.1", 0, 1)
    t.acquire("s", "rid2", 0, 1)
    assert t.drop_owner("owner-a") == ["rid1", "rid1.1"]
    assert sorted(t.datasets) == ["rid2"] and t._session_keys == {"s": {("rid2", 0)}}
    assert t.forget("rid2") and t.datasets == {} and t._session_keys == {}
    assert not t.forget("rid2")
    assert t.drop_session("s") == 0


# -- stateful: random leases / consume / ack / release / failed reads / drops -----------


class LeaseMachine(RuleBasedStateMachine):
    """Workers lease rows (random sizes), closures take slices of their leases and then
    complete (ack) or fail (release); reads fail (release with a failure: deferred);
    workers are lost (drop). A model tracks which rows were acknowledged, to check
    exactly-once at the end, also across an export and a resume on a new table."""

    tokens = Bundle("tokens")

    @initialize(unit_rows=st.lists(st.integers(0, 12), min_size=1, max_size=6))
    def setup(self, unit_rows):
        self.table = table(unit_rows, max_failures=10**6)
        self.unit_rows = unit_rows
        self.total = sum(unit_rows)
        self.live = ["w0", "w1", "w2"]
        self.next_worker = 3
        self.held: dict[str, list[tuple[int, int]]] = {w: [] for w in self.live}
        self.acked = Counter()
        self.done: set[int] = set()  # tokens already acknowledged (by identity)

    @rule(w=st.integers(0, 2), rows=st.integers(1, 30), parts=st.none() | st.integers(1, 4))
    def acquire(self, w, rows, parts):
        s = self.live[w % len(self.live)]
        got = self.table.acquire(s, DS, 0, rows, parts=parts)
        if got is not None:
            assert got and got == normalize(got)
            self.held[s] = union(self.held[s], got)

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
        assert ok == (s not in self.table._expired and id(piece) not in self.done)
        if ok:
            for a, b in piece:
                self.acked.update(range(a, b))

    @rule(tok=consumes(tokens), failed=st.booleans())
    def release(self, tok, failed):
        s, piece = tok
        self.table.release(s, DS, 0, piece, failure=("f", "m") if failed else None)

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
            check_leases(self.table)
            p = self.table.progress(DS, 0)
            assert p["acknowledged"] + p["leased"] + p["free"] == self.total
            assert p["acknowledged"] == sum(self.acked.values())
            assert all(c == 1 for c in self.acked.values())

    def teardown(self):
        if not hasattr(self, "table"):
            return
        # Export the ledger; resume the epoch on a new table (a new coordinator): it
        # serves exactly the rows the ledger lacks. Then every row was acked once.
        ledger = self.table.acknowledged(DS, 0)
        assert ledger == intervals_from_ids(self.acked)
        resumed = table(self.unit_rows)
        resume.start_epoch(resumed, DS, 0, ledger)
        s = "drainer"
        while (got := resumed.acquire(s, DS, 0, 7)) is not None:
            assert resumed.ack(s, DS, 0, got)
            for a, b in got:
                self.acked.update(range(a, b))
        check_leases(resumed)
        assert resumed.progress(DS, 0)["complete"]
        assert sorted(self.acked) == list(range(self.total))
        assert all(c == 1 for c in self.acked.values())


LeaseMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30,
                                          deadline=None)
TestLeaseMachine = LeaseMachine.TestCase


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(1, 200),
       st.integers(1, 5))
def test_leases_partition_the_epoch_in_whole_units(unit_rows, rows, parts):
    """Whatever the unit sizes, lease size and readers: each lease is one run of rows
    ending at a unit's end, at least the rows asked for (or the share of what is left:
    free / (2 * parts)), less than one unit more; together they are every row once."""
    t = table(unit_rows)
    ends, pos = set(), 0
    for r in unit_rows:
        pos += r
        ends.add(pos)
    biggest = max(unit_rows)
    seen: list = []
    while True:
        free = t.progress(DS, 0)["free"]
        lease = t.acquire(f"s{len(seen) % parts}", DS, 0, rows, parts=parts)
        if lease is None:
            assert free == 0
            break
        (a, b), = lease  # nothing was given back: the free rows are one run
        need = min(rows, max(1, -(-free // (2 * parts))))
        assert b in ends and need <= b - a < need + biggest
        seen.append((a, b))
    assert normalize(seen) == ([(0, pos)] if pos else [])
    assert sum(b - a for a, b in seen) == pos


def test_newest_epochs_include_completed_ones_whose_tables_are_dropped():
    t = table([4])
    t.define("other", [(2, 1)])
    for epoch in (0, 1):
        ranges = t.acquire("s", DS, epoch, 4)
        assert t.ack("s", DS, epoch, ranges)
    assert t.newest_epochs() == {DS: 1}
    assert t.acquire("s", "other", 3, 2) is not None  # live, not complete
    assert t.newest_epochs() == {DS: 1, "other": 3}
    assert t.progress(DS, 1)["complete"] and not t.progress("other", 3)["complete"]


def test_acknowledging_several_sessions_at_once_completes_and_drops_the_epoch():
    """A gang commit acknowledges every rank's rows in one call; the epoch it completes
    drops its table like any other (memory stays bounded)."""
    told = []
    t = LeaseTable(on_ack=lambda ds, counts: told.extend((s, ds, n) for s, n in counts))
    t.define(DS, unit_runs([3, 4]))
    a = t.acquire("a", DS, 0, 1)
    b = t.acquire("b", DS, 0, 1)
    tok = {"a": [("lease", DS, 0, a)], "b": [("lease", DS, 0, b)]}
    assert not t.ack_sessions({"a": tok["b"], "b": tok["a"]})  # crossed: refused whole
    assert not t.is_complete(DS, 0) and t.progress(DS, 0)["acknowledged"] == 0
    assert not told  # a refused acknowledgement is not counted
    assert t.ack_sessions(tok)
    assert t.is_complete(DS, 0) and t.newest_epochs() == {DS: 0}
    assert sorted(told) == [("a", DS, 3), ("b", DS, 4)]  # the dashboard's counters


def test_a_closures_tokens_are_merged_one_per_epoch_table():
    from daskdist.core.leases.table import merge_tokens

    toks = [("lease", DS, 0, [(0, 4)]), ("gang", 1), ("lease", DS, 0, [(4, 8), (10, 12)]),
            ("lease", DS, 1, [(0, 2)])]
    merged = merge_tokens(toks)
    assert ("gang", 1) in merged and len(merged) == 3
    assert ("lease", DS, 0, [(0, 8), (10, 12)]) in merged
    assert ("lease", DS, 1, [(0, 2)]) in merged
    bad = [("lease", DS, 0, [(0,)]), ("lease", DS, 0, [(1, 2)])]
    assert merge_tokens(bad) is bad  # malformed: left for the scheduler to refuse
    one = [("lease", DS, 0, [(0, 4)])]
    assert merge_tokens(one) is one
    t = table([4, 4])
    t.acquire("a", DS, 0, 1)
    t.acquire("a", DS, 0, 1)  # two leases, adjacent: acknowledged as one run
    assert t.ack_tokens("a", merge_tokens([("lease", DS, 0, [(0, 4)]),
                                           ("lease", DS, 0, [(4, 8)])]))
    assert t.is_complete(DS, 0)


@settings(max_examples=60, deadline=None)
@given(unit_rows=st.lists(st.integers(1, 50), min_size=1, max_size=12),
       rows=st.integers(1, 80), least=st.integers(1, 20), parts=st.integers(1, 6))
def test_the_tail_rule_shrinks_leases_toward_least(unit_rows, rows, least, parts):
    """Under the tail rule a lease ends at a unit's end unless that would more than
    double it past its share (free / (2 * parts)); then it is exactly what was asked
    for, not under ``least``: leases shrink as the pool runs low, every row once."""
    t = table(unit_rows)
    ends, pos = set(), 0
    for r in unit_rows:
        pos += r
        ends.add(pos)
    seen: list = []
    fresh = 0
    while True:
        free = t.progress(DS, 0)["free"]
        session = f"s{len(seen) % parts}"
        lease = t.acquire(session, DS, 0, rows, parts=parts, least=least, tail=True)
        share = -(-free // (2 * parts))
        need = min(rows, max(least, share))
        if lease is None and free:
            # a reader holding its share of what is not acknowledged waits: the rows go
            # to readers holding less
            held = sum(b - a for a, b in leased_to(t, session, DS, 0))
            leased = t.progress(DS, 0)["leased"]
            assert held * parts >= free + leased and (held >= need or free < parts * need)
            fresh += 1
            session = f"fresh{fresh}"
            lease = t.acquire(session, DS, 0, rows, parts=parts, least=least, tail=True)
        if lease is None:
            assert free == 0
            break
        (a, b), = lease
        assert b - a >= min(need, free)
        if b - a > need:  # rounded up to a unit's end, at most twice the share
            assert b in ends and b - a <= 2 * max(need, share)
        else:  # what was asked for (or the rest of the pool)
            assert b - a == min(need, free)
        seen.append((a, b))
    assert normalize(seen) == ([(0, pos)] if pos else [])
    check_leases(t)


def test_the_tail_rule_gives_every_reader_rows_of_the_last_unit():
    """One 1,000-row unit left and 8 readers asking for 65,536 rows, at least 64: each
    takes a piece of it, none takes it whole."""
    t = table([1000])
    got = [t.acquire(f"s{i}", DS, 0, 65536, parts=8, least=64, tail=True) for i in range(8)]
    assert all(got) and all(b - a < 1000 for (a, b), in got)
    assert sum(b - a for (a, b), in got) <= 1000


def test_takes_sends_a_tail_closure_to_a_holder_of_the_rows():
    """Once a dataset's free rows are gone, a closure reading it goes to a session still
    holding its leased rows (takes: True there, False elsewhere); with free rows left,
    or none held, anywhere; holders() names them."""
    t = LeaseTable()
    t.define("ds", unit_runs([10, 10]))
    assert t.takes("ds", "s1") and t.takes("unknown", "s1")
    t.acquire("s2", "ds", 0, 10)
    assert t.takes("ds", "s1")  # 10 rows still free
    lease = t.acquire("s2", "ds", 0, 10)
    assert not t.takes("ds", "s1") and t.takes("ds", "s2")
    assert list(t.holders("ds")) == ["s2"] and list(t.holders("unknown")) == []
    t.release("s2", "ds", 0, lease)  # free again: anyone
    assert t.takes("ds", "s1")
    t.acquire("s3", "ds", 0, 10)
    assert not t.takes("ds", "s1") and t.takes("ds", "s3")
    t.ack("s2", "ds", 0, [(0, 10)])
    t.ack("s3", "ds", 0, lease)  # every row acknowledged: nothing held, anyone
    assert t.takes("ds", "s1") and list(t.holders("ds")) == []


def _finish_ticks(rated: bool, shuffle: bool) -> dict[str, int]:
    """Three readers of one epoch of 120 units of 100 rows, two taking 30 rows a tick
    and one 10, each asking for a lease every tick (at least 32 rows) and acknowledging
    what it took: the tick each took its last rows. ``rated``: each says its pace."""
    t = LeaseTable()
    t.define(DS, unit_runs([100] * 120), seed=3, shuffle=shuffle)
    speed = {"fast1": 30, "fast2": 30, "slow": 10}
    held: dict[str, list] = {s: [] for s in speed}
    last = dict.fromkeys(speed, 0)
    for tick in range(1, 10_000):
        if t.is_complete(DS, 0):
            break
        for s, v in speed.items():
            got = t.acquire(s, DS, 0, 65536, parts=3, least=32, tail=True,
                            rate=float(v) if rated else None)
            held[s] += got or []
            taken, left = [], v
            while held[s] and left:
                a, b = held[s].pop(0)
                c = min(b, a + left)
                taken.append((a, c))
                left -= c - a
                if c < b:
                    held[s].insert(0, (c, b))
            if taken:
                assert t.ack(s, DS, 0, taken)
                last[s] = tick
        check_leases(t)
    assert t.is_complete(DS, 0)
    return last


@pytest.mark.parametrize("shuffle", [False, True])
def test_readers_that_say_their_pace_run_out_together(shuffle):
    """Weighed by the rates the loaders measure, a reader three times slower holds a
    third as many rows: the epoch's last rows are not left with it while the others
    idle (equal shares leave it a long tail)."""
    rated = _finish_ticks(True, shuffle)
    equal = _finish_ticks(False, shuffle)
    ideal = 12_000 / 70  # every reader busy to the end
    assert max(rated.values()) <= 1.08 * ideal, rated
    assert max(rated.values()) - min(rated.values()) <= 12, rated
    assert equal["slow"] - max(equal["fast1"], equal["fast2"]) > 60, equal


def test_a_lost_readers_rate_goes_with_it():
    """A dropped session's rate weighs no one's share any more."""
    t = table([100] * 10)
    t.acquire("a", DS, 0, 10, rate=5.0)
    t.acquire("b", DS, 0, 10, rate=15.0)
    rates = t.datasets[DS].rates
    assert rates.weight("a", 2) == pytest.approx(0.25)
    t.drop_session("b")
    assert rates.of == {"a": 5.0} and rates.weight("a", 2) == pytest.approx(0.5)
    assert rates.weight("c", 2) is None  # never said: an equal share
