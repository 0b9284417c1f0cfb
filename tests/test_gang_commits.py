"""Rows acknowledged at commit granularity (pure): the commit protocol of elastic State
(core/leases/commits.py) simulated over a real LeaseTable with random steps, commits, member
losses at every point of a commit, commits whose part came late (expired, then caught
and restored: Horovod's pattern), and restores. The committed "model" (a count per row)
must hold exactly the acknowledged rows, each once; after draining, every row once."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daskdist.core.intervals import normalize
from daskdist.core.leases.commits import (
    CommitBook,
    RankLedger,
    pack_tokens,
    unpack_part,
    unpack_parts,
)
from daskdist.core.leases.table import LeaseTable, group_tokens, unit_runs
from daskdist.core.protocol import CommitKey, LeaseToken, dataset_key
from tests.tables import check_leases

DS, EPOCH = "ds", 0
UNITS = [7, 5, 9, 4, 6, 8]  # rows per unit
TOTAL = sum(UNITS)


def rows(tokens):
    return [i for t in tokens for a, b in t[3] for i in range(a, b)]


class Sim:
    """A gang of ranks training on a dynamic dataset through the commit protocol."""

    def __init__(self, n_ranks: int = 3, one: bool = False):
        self.one = one  # rank 0 sends every part in one message (packed, as the allgather)
        self.table = LeaseTable()
        self.table.define(DS, unit_runs(UNITS))
        self.book = CommitBook()
        self.fresh = 0
        self.sessions = [self._new_session() for _ in range(n_ranks)]
        self.live = set(self.sessions)
        self.generation = 1
        self.commits = 0
        self.seq = 0  # the commit counter every rank agrees on: never reused
        self.committed: Counter = Counter()  # the committed model: rows trained on
        self.lists = [[] for _ in self.sessions]  # each rank's closure token list
        self.ledgers = [RankLedger() for _ in self.sessions]

    def _new_session(self) -> str:
        self.fresh += 1
        return f"s{self.fresh}"

    def step(self) -> None:
        """Every rank takes a batch (the free rows of one unit), if any is free."""
        for r, s in enumerate(self.sessions):
            lease = self.table.acquire(s, DS, EPOCH, 1)
            if lease is not None:
                self.lists[r].append(("lease", DS, EPOCH, lease))

    def working(self) -> Counter:
        """The model the ranks hold now: the commit plus every rank's rows since."""
        return self.committed + Counter(i for lst in self.lists for i in rows(lst))

    def commit(self, die: str | None = None, victim: int = 0) -> None:
        """One ``State.commit()``: every rank sends its part; the outcome is settled at
        once here (the next commit's allgather in State). With ``die``, rank ``victim``
        dies ``"before"`` sending its part or ``"after"`` the commit was applied but
        before the outcome reached the ranks; with ``"late"`` its part comes after the
        group timeout expired the commit, and every rank catches the error and
        ``restore()``s (Horovod's pattern) in the same generation."""
        self.seq += 1
        key = CommitKey("state", self.generation, self.seq)
        model = self.working()
        taken = [lst[:] for lst in self.lists]
        for r, lst in enumerate(self.lists):
            self.ledgers[r].begin(key, lst, model)
            lst.clear()
        sessions = tuple(self.sessions)
        ok = None
        if self.one:  # rank 0's one message: lost or late only with rank 0
            victim = 0 if die in ("before", "late") else victim
            if die not in ("before", "late"):
                ok = self._one(key, taken, sessions)
        else:
            for r in range(len(self.sessions)):
                if die in ("before", "late") and r == victim:
                    continue
                ok = self.book.add_part(self.table, key, r, len(self.sessions), taken[r],
                                        sessions, self.live)
        if die == "late":
            assert self.book.expire(key) is False  # the group timeout passed
            late = (self._one(key, taken, sessions) if self.one else self.book.add_part(
                self.table, key, victim, len(self.sessions), taken[victim], sessions,
                self.live))
            assert late is False
            for r, ledger in enumerate(self.ledgers):  # restore(): the rows go back
                _state, back = ledger.settle(self.book.expire(key))
                self.table.release_tokens(self.sessions[r], back)
            return
        if die is not None:
            self._lose(victim, taken)
            return
        for r, ledger in enumerate(self.ledgers):
            state, back = ledger.settle(ok)
            self.lists[r].extend(back)
        if ok:
            self.committed = model
            self.commits += 1

    def _one(self, key: CommitKey, taken: list, sessions: tuple) -> bool:
        """Rank 0 sends every rank's packed part (as the commit's allgather brought it)."""
        tables = unpack_parts([pack_tokens(t) for t in taken], sessions, self.table.dataset_of)
        return self.book.add_all(self.table, key, len(sessions), tables, sessions, self.live)

    def _lose(self, victim: int, taken: list) -> None:
        """A member dies mid-commit: survivors' calls fail, their closures end (tokens
        given back, then released), the group re-forms, ``sync()`` settles the commit."""
        dead = self.sessions[victim]
        self.table.drop_session(dead)
        self.live.discard(dead)
        self.book.abort_open()  # the scheduler's end_session
        for r, s in enumerate(self.sessions):
            if r == victim:
                continue
            back = taken[r]  # the commit's outcome is unknown: tokens back in the list
            self.table.release_tokens(s, back + self.lists[r])
            self.lists[r] = []
        # sync(): a survivor's in-flight commit counts if the scheduler recorded it
        newest = None
        for r, ledger in enumerate(self.ledgers):
            if r != victim and ledger.in_flight:
                state, _ = ledger.settle(self.book.expire(ledger.key))
                if state is not None:
                    newest = state
        if newest is not None:
            self.committed = newest
            self.commits += 1
        new = self._new_session()
        self.sessions[victim] = new
        self.live.add(new)
        self.lists[victim] = []
        self.ledgers[victim] = RankLedger()
        self.generation += 1

    def restore(self) -> None:
        for r, s in enumerate(self.sessions):
            self.table.release_tokens(s, self.lists[r])
            self.lists[r] = []

    def check(self) -> None:
        check_leases(self.table)
        assert all(n == 1 for n in self.committed.values()), "a row trained twice"
        acked = {i for a, b in self.table.acknowledged(DS, EPOCH) for i in range(a, b)}
        assert set(self.committed) == acked, "committed model and acknowledged rows differ"


OPS = st.one_of(
    st.just(("step",)),
    st.just(("commit",)),
    st.just(("restore",)),
    st.tuples(st.just("die"), st.sampled_from(["before", "after", "late"]), st.integers(0, 2)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=40), st.booleans())
def test_committed_model_holds_each_acknowledged_row_once(ops, one):
    """Parts one per rank, or all in rank 0's one message (``one``)."""
    sim = Sim(one=one)
    for op in ops:
        if op[0] == "step":
            sim.step()
        elif op[0] == "commit":
            sim.commit()
        elif op[0] == "restore":
            sim.restore()
        else:
            sim.commit(die=op[1], victim=op[2])
        sim.check()
    # drain: step and commit until every row is acknowledged
    for _ in range(4 * len(UNITS) + 4):
        if sim.table.progress(DS, EPOCH)["complete"]:
            break
        sim.step()
        sim.commit()
        sim.check()
    assert sim.table.progress(DS, EPOCH)["complete"]
    assert sim.committed == Counter(range(TOTAL))  # every row exactly once


def _parts(sim, key, ranks=None):
    """Every rank's (or ``ranks``') part of ``key``: the last one's outcome."""
    sessions = tuple(sim.sessions)
    out = None
    for r in (range(len(sim.sessions)) if ranks is None else ranks):
        out = sim.book.add_part(sim.table, key, r, len(sim.sessions), list(sim.lists[r]),
                                sessions, sim.live)
    return out


def test_a_commit_with_a_dead_member_is_refused_and_changes_nothing():
    sim = Sim()
    sim.step()
    sim.table.drop_session(sim.sessions[2])
    sim.live.discard(sim.sessions[2])
    before = sim.table.progress(DS, EPOCH)
    key = CommitKey("s", 1, 1)
    assert _parts(sim, key) is False and sim.book.expire(key) is False
    assert sim.table.progress(DS, EPOCH) == before


def test_parts_apply_once_all_came_and_a_loss_refuses_open_commits():
    sim = Sim()
    sim.step()
    k1, k2, k3 = (CommitKey("s", 1, n) for n in (1, 2, 3))
    assert _parts(sim, k1, [0, 1]) is None
    assert _parts(sim, k1, [2]) is True and sim.book.expire(k1) is True
    sim.step()
    assert _parts(sim, k2, [0]) is None
    assert sim.book.abort_open() == [k2]
    assert _parts(sim, k2, [1]) is False and sim.book.expire(k2) is False
    # a part of a generation that is no longer current is refused
    assert sim.book.add_part(sim.table, k3, 0, 3, [], None, sim.live) is False


def test_an_open_commit_expires_refused_and_a_late_part_changes_nothing():
    sim = Sim()
    sim.step()
    key = CommitKey("s", 1, 1)
    assert _parts(sim, key, [0, 1]) is None
    leased = sim.table.progress(DS, EPOCH)["leased"]
    assert sim.book.expire(key) is False  # the group timeout passed, or a rank asked
    assert _parts(sim, key, [2]) is False  # the late part: refused, nothing acknowledged
    assert sim.table.progress(DS, EPOCH)["acknowledged"] == 0
    assert sim.table.progress(DS, EPOCH)["leased"] == leased
    # a key no part ever reached is refused too, so a part on the way cannot apply it
    lost = CommitKey("s", 1, 2)
    assert sim.book.expire(lost) is False and _parts(sim, lost) is False


def test_two_states_commit_on_one_generation_under_their_own_keys():
    """A second State's first commit never meets the first State's recorded outcome."""
    sim = Sim()
    sim.step()
    assert _parts(sim, CommitKey("state-a", 1, 1)) is True
    for lst in sim.lists:
        lst.clear()  # acknowledged
    sim.step()
    assert _parts(sim, CommitKey("state-b", 1, 1)) is True
    acked = sim.table.progress(DS, EPOCH)["acknowledged"]
    assert acked == sum(len(rows(lst)) for lst in sim.lists) + UNITS[0] + UNITS[1] + UNITS[2]
    assert sim.book.committed("state-a") == sim.book.committed("state-b") == 1
    assert sim.book.committed("state-c") == 0
    sim.book.note_committed("state-c")  # a plain commit a rank reported
    assert sim.book.committed("state-c") == 1


def test_the_book_stays_bounded():
    book = CommitBook(keep=8)
    for n in range(50):
        book.expire(CommitKey("s", 1, n))
        book.note_committed(f"state-{n}")
    assert len(book.recorded) == 8 and len(book.states) == 8
    assert book.committed("state-49") == 1 and book.committed("state-0") == 0


def test_a_commit_acknowledges_every_session_or_none():
    table = LeaseTable()
    table.define(DS, unit_runs(UNITS))
    a = table.acquire("a", DS, EPOCH, 1)
    b = table.acquire("b", DS, EPOCH, 1)
    tok_a = [("lease", DS, EPOCH, a)]
    tok_b = [("lease", DS, EPOCH, b)]
    assert not table.ack_sessions({"a": tok_a, "b": tok_a})  # b does not hold a's rows
    assert table.progress(DS, EPOCH)["acknowledged"] == 0
    assert table.ack_sessions({"a": tok_a, "b": tok_b})
    assert table.progress(DS, EPOCH)["acknowledged"] == UNITS[0] + UNITS[1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ds", "ds.1", "other"]), st.integers(0, 3),
                          st.lists(st.tuples(st.integers(0, 10**12), st.integers(1, 50)),
                                   min_size=1, max_size=6)), max_size=6))
def test_packed_tokens_give_back_the_rows_of_each_epoch_table(spec):
    """pack_tokens / unpack_part (the one-message commit's parts) keep every row of
    every (dataset, epoch) table, merged; a key no dataset has, or a cut part, raises."""
    tokens = [LeaseToken.of(ds, ep, [(a, a + n) for a, n in ranges]) for ds, ep, ranges in spec]
    tokens.append(("other-kind", 1))  # ignored, as the scheduler ignores it
    names = {dataset_key(d): d for d in ("ds", "ds.1", "other")}
    packed = pack_tokens(tokens)
    assert all(type(v) is int and -(1 << 63) <= v < (1 << 63) for v in packed)
    got = unpack_part(packed, names.get)
    want = group_tokens(tokens)
    assert set(got) == set(want)
    for table, ranges in want.items():
        assert normalize(got[table]) == normalize(ranges)
    if packed:
        with pytest.raises(ValueError):
            unpack_part(packed[:-1], names.get)
        with pytest.raises(ValueError):
            unpack_part(packed, {}.get)
    assert pack_tokens([("lease", "ds", 0, "not ranges")]) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["ds", "other"]), st.integers(0, 2),
                                   st.lists(st.tuples(st.integers(0, 10**6),
                                                      st.integers(1, 50)),
                                            min_size=1, max_size=3)), max_size=3),
                min_size=1, max_size=8))
def test_every_ranks_packed_part_lands_in_its_tables_list_under_its_session(ranks):
    """unpack_parts (rank 0's one-message commit) gives, per epoch table, each rank's
    session and its rows, whether the rank's part is the usual one run of one table
    (read at once) or several; a part too few or too many, a cut part, a key no
    dataset has or a non-integer row raises."""
    names = {dataset_key(d): d for d in ("ds", "other")}
    sessions = [f"s{r}" for r in range(len(ranks))]
    tokens = [[LeaseToken.of(ds, ep, [(a, a + n) for a, n in rows]) for ds, ep, rows in spec]
              for spec in ranks]
    parts = [pack_tokens(t) for t in tokens]
    got = unpack_parts(parts, sessions, names.get)
    want: dict = {}
    for session, t in zip(sessions, tokens, strict=True):
        for table, rows in group_tokens(t).items():
            want.setdefault(table, []).append((session, normalize(rows)))
    assert {table: [(s, normalize(r)) for s, r in runs] for table, runs in got.items()} == want
    with pytest.raises(ValueError):
        unpack_parts(parts + [[]], sessions, names.get)
    usual = next((p for p in parts if len(p) == 5), None)
    if usual is not None:
        with pytest.raises(ValueError):
            unpack_parts([usual[:3] + [1.5, usual[4]]], ["s"], names.get)
        with pytest.raises(ValueError):
            unpack_parts([usual], ["s"], {}.get)
    longer = next((p for p in parts if len(p) > 5), None)
    if longer is not None:
        with pytest.raises(ValueError):
            unpack_parts([longer[:-1]], ["s"], names.get)
