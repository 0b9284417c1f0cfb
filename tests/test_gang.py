"""GangBook (pure): the loss budget is per rank's work, a retired member costs nothing,
a formation that cannot succeed fails the pending gangs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daskdist.core.gang import GangBook, member_cid
from daskdist.core.protocol import FAILED, READY
from daskdist.session.scope import origin_of


def _formed(book: GangBook, sessions: tuple[str, ...]) -> None:
    gen = book.begin_formation(sessions)
    book.formation_done(gen, True)


def _run_until_final(book, losses, sessions):
    """Dispatch the gang; lose the member of each rank in ``losses`` (one per attempt);
    then let every member succeed. Returns the outcome."""
    fresh = iter(range(1000))
    for rank in losses:
        gang, members = book.start_next()
        victim = members[rank][1]
        assert book.session_lost(victim)
        outcome = None
        for cid, session, _r in members:
            outcome = book.member_finished(cid, False, None,
                                           "worker-lost" if session == victim else "collective")
        if outcome is not None:
            return outcome
        sessions = tuple(s if s != victim else f"new{next(fresh)}" for s in sessions)
        _formed(book, sessions)
    gang, members = book.start_next()
    outcome = None
    for cid, _s, rank in members:
        outcome = book.member_finished(cid, True, rank, None)
    return outcome


def test_a_gang_of_8_survives_8_members_dying_once():
    sessions = tuple(f"s{i}" for i in range(8))
    book = GangBook(max_losses=3)
    _formed(book, sessions)
    book.submit("g", "owner", b"")
    out = _run_until_final(book, list(range(8)), sessions)
    assert out.state == READY and out.value == list(range(8)) and out.attempt == 9


def test_the_same_rank_lost_max_times_fails_the_gang():
    sessions = ("a", "b", "c")
    book = GangBook(max_losses=3)
    _formed(book, sessions)
    book.submit("g", "owner", b"")
    out = _run_until_final(book, [1, 1, 1], sessions)
    assert out.state == FAILED and out.kind == "worker-lost" and "rank 1" in out.value


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=12), st.integers(1, 4))
def test_fails_exactly_when_one_rank_reaches_the_budget(losses, budget):
    sessions = ("a", "b", "c", "d")
    book = GangBook(max_losses=budget)
    _formed(book, sessions)
    book.submit("g", "owner", b"")
    out = _run_until_final(book, losses, sessions)
    counts: dict[int, int] = {}
    first_fail = None
    for i, r in enumerate(losses):
        counts[r] = counts.get(r, 0) + 1
        if counts[r] >= budget:
            first_fail = i
            break
    if first_fail is None:
        assert out.state == READY and out.value == [0, 1, 2, 3]
    else:
        assert out.state == FAILED and out.attempt == first_fail + 1


def test_a_retired_member_costs_no_loss():
    sessions = ("a", "b", "c")
    book = GangBook(max_losses=1)
    _formed(book, sessions)
    book.submit("g", "owner", b"")
    gang, members = book.start_next()
    assert book.session_lost("c", expected=True)
    for cid, session, _r in members:
        assert book.member_finished(cid, False, None,
                                    "worker-lost" if session == "c" else "collective") is None
    _formed(book, ("a", "b"))
    gang, members = book.start_next()
    out = None
    for cid, _s, rank in members:
        out = book.member_finished(cid, True, rank, None)
    assert out.state == READY and out.value == [0, 1]  # the completing generation's ranks only


def test_fail_pending():
    book = GangBook()
    book.submit("g1", "o", b"")
    book.submit("g2", "o", b"")
    outs = book.fail_pending(b"err", "collective")
    assert [o.cid for o in outs] == ["g1", "g2"] and all(o.state == FAILED for o in outs)
    assert not book.pending


# -- a user error on one rank (SPEC §4.2) ------------------------------------------------


def _started(sessions=("a", "b", "c")):
    book = GangBook(max_losses=3)
    _formed(book, sessions)
    book.submit("g", "owner", b"")
    gang, members = book.start_next()
    return book, members


def test_a_user_error_on_a_healthy_group_fails_the_gang_once_every_member_ended():
    book, members = _started()
    (m0, _, _), (m1, _, _), (m2, _, _) = members
    assert book.member_finished(m1, False, b"KeyError", "user-error") is None
    assert book.group.broken and "rank 1" in book.group.why  # peers are told this
    # the peers' calls then raise: no interruption, no re-run
    assert book.member_finished(m0, False, b"peer", "collective") is None
    out = book.member_finished(m2, False, b"peer", "collective")
    assert out.state == FAILED and out.value == b"KeyError" and out.kind == "user-error"
    assert out.attempt == 1 and not book.pending and book.running is None
    # the next gang waits for a re-formed group, then runs
    book.submit("g2", "owner", b"")
    assert book.start_next() is None
    _formed(book, ("a", "b", "c"))
    assert book.start_next() is not None


def test_a_member_lost_meanwhile_turns_a_user_error_into_an_interruption():
    """A peer's death surfaces as whatever the transport raised (DDP: RuntimeError):
    the gang runs again rather than fail with it."""
    book, members = _started()
    (m0, _, _), (m1, s1, _), (m2, _, _) = members
    assert book.member_finished(m0, False, b"RuntimeError: gloo", "user-error") is None
    assert book.session_lost(s1)
    assert book.member_finished(m1, False, None, "worker-lost") is None
    assert book.member_finished(m2, False, b"peer", "collective") is None
    assert book.pending and book.pending[0].cid == "g"  # runs again
    assert book.pending[0].losses == {1: 1}


def test_a_user_error_on_a_group_already_broken_interrupts():
    book, members = _started()
    (m0, _, _), (m1, s1, _), (m2, _, _) = members
    assert book.session_lost(s1, expected=True)
    for cid, kind in ((m0, "user-error"), (m1, "worker-lost"), (m2, "collective")):
        assert book.member_finished(cid, False, b"x", kind) is None
    assert book.pending and book.pending[0].losses == {}  # retired: no loss charged


def test_every_rank_and_attempt_of_a_gang_has_the_same_origin():
    assert origin_of(member_cid("owner-g3", 7, 2)) == origin_of(member_cid("owner-g3", 8, 0))
    assert origin_of(member_cid("owner-g3", 7, 2)) == "owner-g3"
    assert origin_of("owner-12") == "owner-12"  # any other closure: its own id


# -- the repeat budget ---------------------------------------------


def _divergent_run(book: GangBook, failing: int = 0, kind: str = "collective"):
    """One run: rank ``failing``'s collective call fails (its peers returned); then the
    group re-forms over the same sessions. Returns the outcome (``None``: runs again)."""
    gang, members = book.start_next()
    outcome = None
    for cid, _s, rank in members:
        ok = rank != failing
        outcome = book.member_finished(cid, ok, rank if ok else f"boom@{gang.attempt}",
                                       None if ok else kind)
    if outcome is None:
        _formed(book, book.group.sessions)
    return outcome


@given(st.integers(1, 5), st.integers(0, 2))
def test_a_collective_failure_that_repeats_fails_after_the_budget(budget, failing):
    book = GangBook(max_losses=budget)
    _formed(book, ("a", "b", "c"))
    book.submit("g", "owner", b"")
    outcomes = [_divergent_run(book, failing) for _ in range(budget)]
    assert outcomes[:-1] == [None] * (budget - 1)
    out = outcomes[-1]
    assert out.state == FAILED and out.kind == "collective-repeated" and out.attempt == budget
    summary, first = out.value
    assert f"rank {failing} failed first" in summary and "repeats" in summary
    assert first == f"boom@{budget}"  # the last run's first failure, kept whole
    assert book.running is None and not book.pending


def test_membership_changes_do_not_use_up_the_repeat_budget():
    book = GangBook(max_losses=2)
    _formed(book, ("a", "b"))
    book.submit("g", "owner", b"")
    assert _divergent_run(book) is None  # 1 of 2
    # a worker joins during the next run: it does not count, nor does the one before
    gang, members = book.start_next()
    book.membership_changed()
    for cid, _s, rank in members:
        assert book.member_finished(cid, rank != 0, None, None if rank else "collective") is None
    _formed(book, ("a", "b"))
    assert _divergent_run(book) is None  # 1 of 2 again
    # a run over other members starts the count again
    _formed(book, ("a", "b", "c"))
    assert _divergent_run(book) is None
    # a hosts-updated interrupt is a membership change too
    assert _divergent_run(book, kind="hosts-updated") is None
    assert _divergent_run(book) is None
    # a member lost: not counted either (it is the loss budget's)
    gang, members = book.start_next()
    book.session_lost("c")
    for cid, _s, rank in members:
        book.member_finished(cid, False, None, "worker-lost" if rank == 2 else "collective")
    _formed(book, ("a", "b", "d"))
    assert _divergent_run(book) is None
    out = _divergent_run(book)
    assert out is not None and out.kind == "collective-repeated"


def test_a_repeated_failure_reaches_the_client_as_a_collective_error():
    from daskdist.errors import CollectiveError, dump_error, load_error

    first = dump_error(CollectiveError("allreduce timed out after 5 s on rank 0"))
    err = load_error(["gang g failed 3 runs in a row ...: rank 0 failed first", first],
                     "collective-repeated")
    assert isinstance(err, CollectiveError) and not err.transient
    assert "rank 0 failed first" in str(err) and "allreduce timed out" in str(err)
    assert isinstance(err.__cause__, CollectiveError)


# -- a broken generation's word down the tree -------------------------------------

def test_relay_children_tile_the_ranks_below_the_scheduler():
    """Every rank has one parent: the scheduler's children are ranks 0..fanout-1, and
    each rank's children follow in order; a group of at most ``fanout`` is flat."""
    from daskdist.core.gang import relay_children

    assert list(relay_children(0, 3, 32)) == [] and list(relay_children(2, 3, 32)) == []
    assert [list(relay_children(r, 7, 2)) for r in range(7)] == [
        [2, 3], [4, 5], [6], [], [], [], []]
    for world in (1, 5, 33, 100):
        for fanout in (1, 2, 3, 32):
            below = [c for r in range(world) for c in relay_children(r, world, fanout)]
            assert sorted(below) == list(range(min(fanout, world), world))


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 120), fanout=st.integers(1, 6), data=st.data())
def test_every_live_rank_hears_however_the_relays_die(world, fanout, data):
    """Losses come one at a time; the scheduler tells ``tell_targets`` at each (the
    tree's top at the first, the lost rank's children each time). In the worst case a
    rank lost later never passed the word on: every rank never lost still hears it,
    and the scheduler sent O(fanout) messages per loss, not O(world)."""
    from daskdist.core.gang import relay_children, tell_targets

    order = data.draw(st.permutations(range(world)))
    k = data.draw(st.integers(1, world))
    lost_in_order = order[:k]
    lost: set[int] = set()
    told: set[int] = set()
    for i, r in enumerate(lost_in_order):
        lost.add(r)
        ranks = list(range(min(fanout, world))) if i == 0 else []
        ranks += relay_children(r, world, fanout)
        targets = tell_targets(ranks, world, fanout, lambda x: x in lost)
        assert not (set(targets) & lost) and len(targets) == len(set(targets))
        assert len(targets) <= fanout * (2 + len(lost))
        told.update(targets)
    survivors = set(range(world)) - set(lost_in_order)
    heard, todo = set(), [r for r in told if r in survivors]
    while todo:  # only ranks never lost pass the word on
        r = todo.pop()
        if r in heard:
            continue
        heard.add(r)
        todo += [c for c in relay_children(r, world, fanout) if c in survivors]
    assert heard == survivors
    if world <= fanout:  # flat: the scheduler told every survivor itself, at once
        assert told == set(range(world)) - {lost_in_order[0]}
