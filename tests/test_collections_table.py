"""The lease table's units for Dask collections (pure): partitions of unknown length
(strided ids, lengths learned as they are computed), a seeded partition order, leasing
a given partition (locality), and a recomputed partition whose length differs."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from daskdist.core.intervals import normalize, size_of
from daskdist.core.leases import resume
from daskdist.core.leases.partitions import STRIDE, Permutation
from daskdist.core.leases.table import EpochFailed, LeaseTable
from daskdist.core.leases.units import DenseUnits, StridedUnits
from tests.tables import check_leases, define_collection, leased_to

DS = "frame"
S = STRIDE


def collection(n: int, **kw) -> LeaseTable:
    t = LeaseTable()
    define_collection(t, DS, n, label="train", seed=kw.pop("seed", 0), **kw)
    return t


def test_a_partition_of_unknown_length_is_leased_whole_and_its_tail_dropped_when_learned():
    t = collection(3)
    p = t.progress(DS, 0)
    assert (p["known"], p["total"], p["units"], p["units_known"]) == (False, 0, 3, 0)
    assert t.acquire("a", DS, 0, 1) == [(0, S)]  # partition 0, every id it may have
    assert t.acquire("b", DS, 0, 1) == [(S, 2 * S)]
    assert resume.set_length(t, "a", DS, 0, 0, 7) is None
    assert leased_to(t, "a", DS, 0) == [(0, 7)]
    p = t.progress(DS, 0)
    assert (p["known"], p["total"], p["leased"], p["free"]) == (False, 7, 7, 0)
    check_leases(t)
    assert t.ack("a", DS, 0, [(0, 7)])
    assert resume.set_length(t, "b", DS, 0, 1, 0) is None  # an empty partition: no row at all
    assert leased_to(t, "b", DS, 0) == []
    assert t.acquire("a", DS, 0, 1) == [(2 * S, 3 * S)]
    assert resume.set_length(t, "a", DS, 0, 2, 5) is None
    p = t.progress(DS, 0)
    assert (p["known"], p["total"], p["acknowledged"], p["leased"], p["complete"]) == (
        True, 12, 7, 5, False)
    assert t.ack("a", DS, 0, [(2 * S, 2 * S + 5)])
    p = t.progress(DS, 0)
    assert p["complete"] and p["acknowledged"] == 12
    # the next epoch starts with what was learned: only rows that exist are leased
    assert t.acquire("a", DS, 1, 1) == [(0, 7)]
    assert t.acquire("a", DS, 1, 1) == [(2 * S, 2 * S + 5)]
    assert t.acquire("a", DS, 1, 1) is None
    check_leases(t)


def test_a_recomputed_partition_whose_length_differs_fails_the_epoch_naming_it():
    t = collection(4)
    t.acquire("a", DS, 0, 1)
    assert resume.set_length(t, "a", DS, 0, 0, 10) is None
    assert resume.set_length(t, "a", DS, 0, 0, 10) is None  # the same again: fine
    why = resume.set_length(t, "b", DS, 0, 0, 11)
    assert "partition 0" in why and "11 rows now and had 10" in why and "'train'" in why
    with pytest.raises(EpochFailed, match="partition 0"):
        t.acquire("b", DS, 0, 1)
    assert t.progress(DS, 0)["failed"] == why
    with pytest.raises(ValueError, match="partition 9"):
        resume.set_length(t, "a", DS, 0, 9, 1)
    with pytest.raises(ValueError, match="at most"):
        resume.set_length(t, "a", DS, 0, 1, S)


def test_known_lengths_use_dense_ids_and_a_differing_computed_length_fails():
    t = LeaseTable()
    define_collection(t, DS, 3, runs=[(4, 2), (2, 1)])
    assert t.acquire("a", DS, 0, 1) == [(0, 4)]
    assert resume.set_length(t, "a", DS, 0, 0, 4) is None
    assert "has 3 rows now and had 4" in resume.set_length(t, "a", DS, 0, 1, 3)
    with pytest.raises(ValueError, match="runs hold 3 units, not 5"):
        define_collection(t, "x", 5, runs=[(4, 2), (2, 1)])


def test_a_shuffled_collection_leases_its_partitions_in_a_seeded_order():
    def order(seed: int, epoch: int, n: int = 50) -> list[int]:
        t = collection(n, seed=seed, shuffle=True)
        out = []
        while (lease := t.acquire("a", DS, epoch, 1)) is not None:
            out.append(lease[0][0] // S)
        return out

    first = order(0, 0)
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert order(0, 0) == first  # deterministic for (seed, epoch)
    assert order(0, 1) != first and order(1, 0) != first
    # rows given back after the order went past them are served too
    t = collection(3, shuffle=True)
    leases = [t.acquire("a", DS, 0, 1) for _ in range(3)]
    t.release("a", DS, 0, leases[0])
    assert t.acquire("b", DS, 0, 1) == leases[0]


@given(st.integers(1, 3000), st.integers(0, 2**40), st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_permutation_is_a_permutation(n, seed, epoch):
    p = Permutation(n, seed, epoch)
    seen = [p[k] for k in range(n)]
    assert sorted(seen) == list(range(n))


def test_a_given_partition_can_be_leased_where_it_is_held():
    t = collection(4)
    assert t.acquire_unit("a", DS, 0, 2) == [(2 * S, 3 * S)]
    assert t.acquire_unit("b", DS, 0, 2) is None  # leased already
    resume.set_length(t, "a", DS, 0, 2, 3)
    t.ack("a", DS, 0, [(2 * S, 2 * S + 3)])
    assert t.acquire_unit("a", DS, 0, 2) is None
    assert t.acquire("b", DS, 0, 1) == [(0, S)]  # the lowest free partition
    check_leases(t)


def test_a_lost_session_gives_back_a_partition_of_unknown_length_whole():
    t = collection(2)
    t.acquire("a", DS, 0, 1)
    t.acquire("a", DS, 0, 1)
    resume.set_length(t, "a", DS, 0, 0, 4)
    assert t.drop_session("a") == 4 + S
    p = t.progress(DS, 0)
    assert (p["free"], p["leased"], p["total"]) == (4, 0, 4)
    assert t.acquire("b", DS, 0, 1) == [(0, 4)]
    assert t.acquire("b", DS, 0, 1) == [(S, 2 * S)]
    check_leases(t)


def test_strided_units_refuse_sizes_out_of_range():
    with pytest.raises(ValueError, match="partitions"):
        StridedUnits(-1)
    u = StridedUnits(3)
    assert u.runs == [(-S, 3)] and u.bounds(1) == (S, 2 * S)
    assert u.learn(1, 5) is None and u.bounds(1) == (S, S + 5) and u.learn(1, 6) == 5
    t = collection(3)
    with pytest.raises(ValueError, match="differ from its definition"):
        define_collection(t, DS, 4)


def half_trained(lengths=(5, 0, 4, 6)) -> LeaseTable:
    """A table whose epoch 0 trained partitions 0..2 of ``lengths`` whole (1 empty),
    partition 3 computed and two of its rows trained, nothing else learned."""
    t = collection(len(lengths) + 2)
    for u in range(len(lengths)):
        assert t.acquire_unit("a", DS, 0, u) == [(u * S, (u + 1) * S)]
        assert resume.set_length(t, "a", DS, 0, u, lengths[u]) is None
    for u in range(len(lengths) - 1):
        if lengths[u]:
            assert t.ack("a", DS, 0, [(u * S, u * S + lengths[u])])
    last = len(lengths) - 1
    assert t.ack("a", DS, 0, [(last * S, last * S + 2)])
    return t


def leased_units(t: LeaseTable, epoch: int) -> list[int]:
    """Lease until none is free: the partitions leased (each would be computed)."""
    units = []
    while (lease := t.acquire("b", DS, epoch, 1)) is not None:
        units += sorted({a // S for a, _ in lease})
    return units


def test_learned_lengths_are_run_length_encoded_and_unknown_ones_marked():
    t = half_trained()
    assert t.known_lengths(DS) == [(5, 1), (0, 1), (4, 1), (6, 1), (-1, 2)]
    u = StridedUnits(5)
    assert u.length_runs() == [(-1, 5)]
    for unit in (0, 1, 2):
        u.learn(unit, 7)
    assert u.length_runs() == [(7, 3), (-1, 2)]  # rebuilt after a length is learned
    dense = LeaseTable()
    define_collection(dense, DS, 2, [(10, 2)])
    assert dense.known_lengths(DS) is None  # known lengths: nothing to carry


def test_a_resumed_epoch_with_the_ledgers_lengths_leases_only_the_partitions_left():
    t = half_trained()
    acked, lengths = t.acknowledged(DS, 0), t.known_lengths(DS)
    fresh = collection(6)  # a new dataset over the same collection
    assert resume.learn_lengths(fresh, DS, lengths) == 4
    resume.start_epoch(fresh, DS, 0, acked)
    p = fresh.progress(DS, 0)
    assert (p["units_known"], p["total"], p["acknowledged"]) == (4, 15, 11)
    # only partition 3 (4 rows left: computed again) and the two never computed
    assert leased_units(fresh, 0) == [3, 4, 5]
    check_leases(fresh)
    # without the lengths every trained partition's ids past its rows look free: each
    # would be leased, and computed, just to learn that nothing of it is left
    blind = collection(6)
    resume.start_epoch(blind, DS, 0, acked)
    assert leased_units(blind, 0) == [0, 1, 2, 3, 4, 5]


def test_a_checkpoint_ledger_carries_the_learned_lengths():
    from daskdist.core.leases.ledgers import Ledgers

    t = half_trained()
    led = Ledgers()
    led.note_tables("state", [(DS, 0)])
    ledger = led.export("state", t)
    assert ledger["train"]["lengths"] == [[5, 1], [0, 1], [4, 1], [6, 1], [-1, 2]]
    fresh = collection(6)  # a new cluster: the dataset of that name resumes
    Ledgers().restore("state", ledger, fresh)
    assert leased_units(fresh, 0) == [3, 4, 5]
    check_leases(fresh)
    del ledger["train"]["lengths"]  # a checkpoint written before lengths were kept
    older = collection(6)
    Ledgers().restore("state", ledger, older)
    assert leased_units(older, 0) == [0, 1, 2, 3, 4, 5]


def test_lengths_that_differ_or_do_not_fit_are_refused_naming_the_partition():
    t = half_trained()
    with pytest.raises(ValueError, match="partition 2 .* 4 rows here and 9"):
        resume.learn_lengths(t, DS, [(5, 1), (0, 1), (9, 1)])
    assert t.known_lengths(DS)[:3] == [(5, 1), (0, 1), (4, 1)]  # nothing changed
    with pytest.raises(ValueError, match="do not fit"):
        resume.learn_lengths(t, DS, [(5, 7)])
    with pytest.raises(ValueError, match="do not fit"):
        resume.learn_lengths(t, DS, [(S, 1)])
    assert resume.learn_lengths(t, DS, [(5, 1), (-1, 4), (3, 1)]) == 1  # agrees; learns one
    # a live epoch's pools lose the ids past a length learned from a ledger
    assert t.acquire_unit("b", DS, 0, 5) == [(5 * S, 5 * S + 3)]
    assert t.progress(DS, 0)["units_known"] == 5
    check_leases(t)


class CollectionMachine(RuleBasedStateMachine):
    """Sessions lease partitions of unknown length, compute them (learning their true
    length), take rows, complete or fail closures, give leases back, get lost; several
    epochs at once. After every step the table's invariant holds and progress adds up;
    at the end every row of every epoch was acknowledged exactly once."""

    @initialize(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8),
                shuffle=st.booleans())
    def setup(self, lengths, shuffle):
        self.lengths = lengths
        self.t = collection(len(lengths), shuffle=shuffle, seed=3)
        self.sessions = ["s0", "s1", "s2"]
        self.next_session = 3
        self.acked: dict[int, Counter] = {0: Counter(), 1: Counter()}
        self.computed: dict[tuple[str, int], set[int]] = {}  # partitions a session knows

    def _held(self, session, epoch):
        return leased_to(self.t, session, DS, epoch)

    @rule(i=st.integers(0, 2), epoch=st.integers(0, 1), local=st.booleans(),
          unit=st.integers(0, 7))
    def lease(self, i, epoch, local, unit):
        s = self.sessions[i]
        if local and unit < len(self.lengths):
            self.t.acquire_unit(s, DS, epoch, unit)
        else:
            self.t.acquire(s, DS, epoch, 1)

    @rule(i=st.integers(0, 2), epoch=st.integers(0, 1))
    def compute(self, i, epoch):
        """The session computes every partition it holds rows of and reports lengths."""
        s = self.sessions[i]
        for a, b in self._held(s, epoch):
            for u in range(a // S, (b - 1) // S + 1):
                assert resume.set_length(self.t, s, DS, epoch, u, self.lengths[u]) is None
                self.computed.setdefault((s, epoch), set()).add(u)

    @rule(i=st.integers(0, 2), epoch=st.integers(0, 1), ok=st.booleans(),
          take=st.integers(1, 4))
    def consume(self, i, epoch, ok, take):
        """A closure takes up to ``take`` existing rows of a computed partition."""
        s = self.sessions[i]
        rows = []
        for a, b in self._held(s, epoch):
            u = a // S
            if u not in self.computed.get((s, epoch), ()):
                continue
            hi = min(b, u * S + self.lengths[u])
            rows += list(range(a, hi))[: take - len(rows)]
            if len(rows) >= take:
                break
        if not rows:
            return
        ranges = normalize((r, r + 1) for r in rows)
        if ok:
            assert self.t.ack(s, DS, epoch, ranges)
            self.acked[epoch].update(rows)
        else:
            self.t.release(s, DS, epoch, ranges)

    @rule(i=st.integers(0, 2), epoch=st.integers(0, 1))
    def give_back(self, i, epoch):
        s = self.sessions[i]
        self.t.release(s, DS, epoch, self._held(s, epoch))

    @rule(i=st.integers(0, 2))
    def lose(self, i):
        self.t.drop_session(self.sessions[i])
        self.sessions[i] = f"s{self.next_session}"
        self.next_session += 1

    @invariant()
    def consistent(self):
        check_leases(self.t)
        for epoch in (0, 1):
            p = self.t.progress(DS, epoch)
            assert p["acknowledged"] + p["leased"] + p["free"] == p["total"], p
            assert p["leased"] >= 0 and p["free"] >= 0, p
            assert all(n == 1 for n in self.acked[epoch].values())

    @rule()
    def finish(self):
        """Drive both epochs to completion with a fresh session: every row once."""
        s = f"s{self.next_session}"
        self.next_session += 1
        for epoch in (0, 1):
            for other in self.sessions:  # their closures failed: rows back to the pool
                self.t.release(other, DS, epoch, self._held(other, epoch))
            while (lease := self.t.acquire(s, DS, epoch, 1)) is not None:
                for a, b in lease:
                    for u in range(a // S, (b - 1) // S + 1):
                        resume.set_length(self.t, s, DS, epoch, u, self.lengths[u])
                held = self._held(s, epoch)
                if held:
                    assert self.t.ack(s, DS, epoch, held)
                    self.acked[epoch].update(r for a, b in held for r in range(a, b))
            p = self.t.progress(DS, epoch)
            assert p["complete"], p
            want = {u * S + k for u, n in enumerate(self.lengths) for k in range(n)}
            assert set(self.acked[epoch]) == want
            assert p["known"] and p["total"] == sum(self.lengths)


TestCollectionMachine = CollectionMachine.TestCase
TestCollectionMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)


def test_universe_sizes():
    t = collection(2)
    t.acquire("a", DS, 0, 1)
    resume.set_length(t, "a", DS, 0, 0, 3)
    assert size_of(t.datasets[DS].defined.universe()) == 3 + S


# -- the tail rule for collections: whole partitions, the hold-back ----------------------
def lease_tail(t: LeaseTable, session: str, parts: int, epoch: int = 0):
    """A lease as the scheduler's collection handler asks it."""
    return t.acquire(session, DS, epoch, 1, parts=parts, least=1, tail=True)


def test_a_collections_partition_is_never_split_at_the_tail_where_a_files_unit_is():
    files = LeaseTable()
    files.define(DS, [(100, 2)], "train")
    assert lease_tail(files, "a", 4) == [(0, 1)]  # a file's unit: split toward ``least``
    t = LeaseTable()
    define_collection(t, DS, 2, runs=[(100, 2)], label="train")
    assert lease_tail(t, "a", 4) == [(0, 100)]  # a partition: read (computed) whole
    assert lease_tail(t, "b", 4) == [(100, 200)]
    s = collection(2)
    assert lease_tail(s, "a", 4) == [(0, S)]  # unknown length: every id it may have
    check_leases(t)
    check_leases(s)


def test_a_member_holding_two_partitions_waits_at_the_tail_for_one_holding_none():
    t = LeaseTable()
    define_collection(t, DS, 10, runs=[(100, 10)], label="train")
    for _ in range(3):  # ten partitions free for three members: not the tail yet
        assert lease_tail(t, "b", 3) is not None
    assert lease_tail(t, "a", 3) == [(300, 400)]
    assert lease_tail(t, "a", 3) == [(400, 500)]  # six free: two per member, still
    # five free now, under two per member: ``a`` holds two (it reads one, one ahead)
    assert t.holds_share("a", DS, 0, 3) and not t.holds_share("c", DS, 0, 3)
    assert lease_tail(t, "a", 3) is None
    assert lease_tail(t, "c", 3) == [(500, 600)]  # the member that would idle
    assert lease_tail(t, "c", 3) == [(600, 700)]
    assert lease_tail(t, "c", 3) is None
    assert t.ack("a", DS, 0, [(300, 400)])  # ``a`` read one: it holds one, may ask
    assert lease_tail(t, "a", 3) == [(700, 800)]
    assert not t.holds_share("x", DS, 1, 3)  # an epoch not started: nothing held
    check_leases(t)


def test_the_hold_back_counts_partitions_of_unknown_length_by_their_ids():

    units = StridedUnits(10)
    assert units.units_in(3 * S) == 3  # no length learned: STRIDE ids each
    units.learn(0, 10)
    units.learn(1, 30)
    assert units.units_in(3 * S + 40) == 5  # and learned ones by their mean (20)
    assert DenseUnits([(100, 4)]).units_in(250) == 2.5
    assert DenseUnits([(0, 2)]).units_in(0) == 0


@given(st.integers(1, 12), st.integers(1, 4), st.integers(1, 4),
       st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=80))
@settings(max_examples=150, deadline=None)
def test_collection_leases_at_the_tail_are_whole_and_every_row_is_read_once(
        n, rows, parts, ops):
    """Members lease (as the scheduler asks) and acknowledge in any order: a lease is
    always one whole partition; a member holding none gets one while any is free; at
    the tail (under two free per member) no member is leased a third; the epoch ends
    with every row acknowledged once."""
    t = LeaseTable()
    define_collection(t, DS, n, runs=[(rows, n)], label="train")
    held: dict[str, list[tuple[int, int]]] = {}
    acked: Counter = Counter()

    def ask(m: str) -> None:
        free = t.progress(DS, 0)["free"] // rows
        before = len(held.get(m, []))
        lease = lease_tail(t, m, parts)
        if lease is None:
            assert before or not free  # a member holding none is never held back
            return
        assert len(lease) == 1 and lease[0][0] % rows == 0 and lease[0][1] - lease[0][0] == rows
        if free < 2 * parts:
            assert before <= 1  # the tail: the last partitions go to members holding less
        held.setdefault(m, []).append(lease[0])

    def ack(m: str) -> None:
        if held.get(m):
            a, b = held[m].pop(0)
            assert t.ack(m, DS, 0, [(a, b)])
            acked.update(range(a, b))

    for is_ask, m in ops:
        (ask if is_ask else ack)(f"m{m % parts}")
        check_leases(t)
    for _ in range(4 * n + 4):  # then every member reads what it holds and asks again
        for i in range(parts):
            ack(f"m{i}")
            ask(f"m{i}")
    assert t.progress(DS, 0)["complete"]
    assert acked == Counter(range(rows * n))
