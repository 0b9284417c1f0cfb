"""Rows acknowledged at commit granularity (pure): the commit protocol of elastic State
(plugins/commits.py) simulated over a real LeaseTable with random steps, commits, member
losses at every point of a commit, and restores. The committed "model" (a count per row)
must hold exactly the acknowledged rows, each once; after draining, every row once."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from daskdist.core.commits import CommitBook, RankLedger, commit_key
from daskdist.core.leases import LeaseTable, unit_runs

DS, EPOCH = "ds", 0
UNITS = [7, 5, 9, 4, 6, 8]  # rows per unit
TOTAL = sum(UNITS)


def rows(tokens):
    return [i for t in tokens for a, b in t[3] for i in range(a, b)]


class Sim:
    """A gang of ranks training on a dynamic dataset through the commit protocol."""

    def __init__(self, n_ranks: int = 3):
        self.table = LeaseTable()
        self.table.define(DS, unit_runs(UNITS))
        self.book = CommitBook()
        self.fresh = 0
        self.sessions = [self._new_session() for _ in range(n_ranks)]
        self.live = set(self.sessions)
        self.generation = 1
        self.commits = 0
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
        before the outcome reached the ranks."""
        key = commit_key(self.generation, self.commits + 1)
        model = self.working()
        taken = [lst[:] for lst in self.lists]
        for r, lst in enumerate(self.lists):
            self.ledgers[r].begin(key, lst, model)
            lst.clear()
        sessions = dict(enumerate(self.sessions))
        ok = None
        for r in range(len(self.sessions)):
            if die == "before" and r == victim:
                continue
            ok = self.book.add_part(self.table, key, r, len(self.sessions), taken[r],
                                    sessions, self.live)
        if die is not None:
            self._lose(victim, taken)
            return
        for r, ledger in enumerate(self.ledgers):
            state, back = ledger.settle(ok)
            self.lists[r].extend(back)
        if ok:
            self.committed = model
            self.commits += 1

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
                state, _ = ledger.settle(self.book.outcome(ledger.key))
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
        self.table.check()
        assert all(n == 1 for n in self.committed.values()), "a row trained twice"
        acked = {i for a, b in self.table.acknowledged(DS, EPOCH) for i in range(a, b)}
        assert set(self.committed) == acked, "committed model and acknowledged rows differ"


OPS = st.one_of(
    st.just(("step",)),
    st.just(("commit",)),
    st.just(("restore",)),
    st.tuples(st.just("die"), st.sampled_from(["before", "after"]), st.integers(0, 2)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=40))
def test_committed_model_holds_each_acknowledged_row_once(ops):
    sim = Sim()
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


def test_a_commit_with_a_dead_member_is_refused_and_changes_nothing():
    sim = Sim()
    sim.step()
    sim.table.drop_session(sim.sessions[2])
    sim.live.discard(sim.sessions[2])
    before = sim.table.progress(DS, EPOCH)
    key = commit_key(1, 1)
    ok = sim.book.apply(sim.table, key, dict(enumerate(sim.sessions)),
                        dict(enumerate(sim.lists)), sim.live)
    assert not ok and not sim.book.outcome(key)
    assert sim.table.progress(DS, EPOCH) == before


def test_parts_apply_once_all_came_and_a_loss_refuses_open_commits():
    sim = Sim()
    sim.step()
    sessions = dict(enumerate(sim.sessions))
    parts = [list(lst) for lst in sim.lists]
    assert sim.book.add_part(sim.table, "1:1", 0, 3, parts[0], sessions, sim.live) is None
    assert sim.book.add_part(sim.table, "1:1", 1, 3, parts[1], sessions, sim.live) is None
    assert sim.book.add_part(sim.table, "1:1", 2, 3, parts[2], sessions, sim.live) is True
    assert sim.book.outcome("1:1")
    sim.step()
    parts = [list(lst) for lst in sim.lists]
    assert sim.book.add_part(sim.table, "1:2", 0, 3, parts[0], sessions, sim.live) is None
    assert sim.book.abort_open() == ["1:2"]
    assert sim.book.add_part(sim.table, "1:2", 1, 3, parts[1], sessions, sim.live) is False
    assert not sim.book.outcome("1:2")
    # a part of a generation that is no longer current is refused
    assert sim.book.add_part(sim.table, "1:3", 0, 3, [], None, sim.live) is False


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
