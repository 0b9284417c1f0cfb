"""A batch-inference job's commits, pure (``core/inference.py``): the first committer wins,
a lost or refused attempt is never committed, every decided unit is published by its
attempt or by the finalization, a resumed job never commits a row again, and the job
queues closures only while they can make progress. Property tests drive random
sequences of commits, duplicates, session losses and closure ends."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daskdist.core.inference import (
    CANCELLED,
    COMPLETE,
    FAILED,
    FINALIZING,
    JobState,
    unit_file,
)
from daskdist.core.intervals import normalize, size_of

pytestmark = pytest.mark.timeout(120)

UNIT = 10  # rows a unit in these tests


def rows(u: int) -> list[tuple[int, int]]:
    return [(u * UNIT, (u + 1) * UNIT)]


def test_the_first_committer_wins_and_a_duplicate_is_refused():
    job = JobState("j")
    assert job.refusal("s1", rows(0)) is None
    unit = job.commit("s1", "c-1#1", rows(0), "staged-a", 7)
    assert (unit.first, unit.file, unit.out_rows) == (0, unit_file(0), 7)
    assert "committed already" in job.refusal("s2", rows(0))
    assert "committed already" in job.refusal("s2", [(5, 15)])  # any overlap
    with pytest.raises(ValueError, match="refused"):
        job.commit("s2", "c-1#2", rows(0), "staged-b", 7)
    assert (job.units, job.rows.size, job.out_rows) == (1, UNIT, 7)


def test_a_fenced_session_commits_nothing_and_its_won_units_are_orphaned():
    job = JobState("j")
    job.commit("s1", "c-1#1", rows(0), "a", 1)
    job.commit("s1", "c-2#1", rows(1), "b", 1)
    job.attempt_ended("c-1#1", ok=True)  # published by its attempt
    job.session_ended("s1")
    assert "ended" in job.refusal("s1", rows(2))
    assert [u.first for u in job.orphans()] == [UNIT]  # won, never published
    assert job.publishing() == 0
    job.attempt_ended("c-2#1", ok=True)  # a late word changes nothing: it is orphaned
    assert [u.first for u in job.orphans()] == [UNIT]


def test_an_attempt_that_fails_after_winning_leaves_its_unit_to_the_finalization():
    job = JobState("j")
    job.commit("s1", "c-1#1", rows(0), "a", 1)
    assert not job.ready_to_finalize(rows_complete=True)  # its attempt may still publish
    job.attempt_ended("c-1#1", ok=False)
    assert job.ready_to_finalize(rows_complete=True)
    job.begin_finalize()
    assert job.state == FINALIZING and [u.first for u in job.orphans()] == [0]
    assert "finalizing" in job.refusal("s1", rows(1))  # no commit once finalizing
    assert not job.finalized(True)
    assert job.state == COMPLETE and not job.orphans()


def test_a_finalization_is_tried_again_then_fails_the_job():
    job = JobState("j", max_failures=2)
    job.begin_finalize()
    assert job.finalized(False, "disk full")  # again
    assert not job.finalized(False, "disk full")
    assert job.state == FAILED and "disk full" in job.error and "2 times" in job.error


def test_a_resumed_job_never_commits_a_ledgers_row_again():
    job = JobState("j", committed=[(0, 20)], units=2, out_rows=20)
    assert (job.units, job.rows.size, job.resumed) == (2, 20, (2, 20, 20))
    assert "committed already" in job.refusal("s1", [(15, 25)])
    job.commit("s1", "c-1#1", [(20, 30)], "a", 10)
    assert job.rates()[0] >= 0 and (job.units, job.rows.size, job.out_rows) == (3, 30, 30)


def test_cancel_and_fail_end_the_job_once():
    job = JobState("j")
    job.cancel()
    job.fail("late")
    assert job.state == CANCELLED and job.error is None
    assert "cancelled" in job.refusal("s1", rows(0))
    assert job.top_up(8, leaseable=True) == 0


def test_closures_are_queued_while_rows_are_free_and_one_replaces_a_commit():
    job = JobState("j")
    assert job.top_up(4, leaseable=True) == 4
    job.outstanding = 4
    assert job.top_up(4, leaseable=True) == 0
    job.outstanding = 3  # an idle closure ended, no free row: no spin
    assert job.top_up(4, leaseable=False) == 0
    # a commit: one replacement, routed to a member holding a unit it read ahead
    assert job.top_up(4, leaseable=False, committed=True) == 1
    job.outstanding = 4
    assert job.top_up(4, leaseable=False, committed=True) == 0
    job.outstanding = 0  # the last one out: one goes on (a unit read ahead meets it)
    assert job.top_up(4, leaseable=False) == 1


def test_per_worker_counts():
    t = [0.0]
    job = JobState("j", clock=lambda: t[0])
    t[0] = 1.0
    job.commit("s1", "c-1#1", rows(0), "a", 10, address="tcp://w1")
    job.unit_failed("s2", "partition 3", "boom", address="tcp://w2")
    t[0] = 2.0
    by = {w["address"]: w for w in job.per_worker()}
    assert by["tcp://w1"]["units"] == 1 and by["tcp://w1"]["rows"] == UNIT
    assert by["tcp://w2"]["failures"] == 1 and list(job.errors) == [("partition 3", "boom")]
    assert job.rates() == (pytest.approx(UNIT / 2.0), pytest.approx(0.5))


# -- properties ------------------------------------------------------------------------------
SESSIONS = ("s0", "s1", "s2")
UNITS = 6

op = st.one_of(
    st.tuples(st.just("commit"), st.sampled_from(SESSIONS), st.integers(0, UNITS - 1),
              st.integers(0, 2)),
    st.tuples(st.just("end"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("closure"), st.integers(0, 40), st.booleans()),
)


@given(st.lists(op, max_size=60), st.sets(st.integers(0, UNITS - 1), max_size=3))
def test_every_row_is_committed_at_most_once_and_every_decided_unit_published(ops, resumed):
    """Random commits (duplicates and late ones among them: an attempt is a (unit, try)
    of a session), session losses and closure ends: committed units never overlap, a
    refused or fenced attempt never wins, no ledger row is committed again, and once
    every unit is in, the finalization publishes exactly the orphans."""
    ledger = normalize(r for u in resumed for r in rows(u))
    job = JobState("j", committed=ledger, units=len(resumed))
    ended: set[str] = set()
    attempts: list[str] = []
    for o in ops:
        if o[0] == "commit":
            _, session, u, k = o
            attempt = f"c-{u}#{k}-{session}"
            why = job.refusal(session, rows(u))
            expected_ok = session not in ended and u not in resumed and not any(
                d.first == u * UNIT for d in job.decided.values())
            assert (why is None) == expected_ok, (why, o)
            if why is None:
                job.commit(session, attempt, rows(u), f"staged-{attempt}", UNIT)
                attempts.append(attempt)
        elif o[0] == "end":
            job.session_ended(o[1])
            ended.add(o[1])
        elif attempts:
            job.attempt_ended(attempts[o[1] % len(attempts)], o[2])
        decided = [r for d in job.decided.values() for r in d.rows]
        assert size_of(normalize(decided)) == size_of(decided)  # pairwise disjoint
        assert not any(a < b2 and a2 < b for a, b in decided for a2, b2 in ledger)
        assert job.rows.size == size_of(ledger) + size_of(decided)
        for d in job.decided.values():
            assert d.session not in ended or d.state != "publishing"
    # every unit in: the last ones committed by a session that stays
    for u in range(UNITS):
        if job.refusal("s9", rows(u)) is None:
            job.commit("s9", f"last-{u}", rows(u), "s", UNIT)
            job.attempt_ended(f"last-{u}", True)
    for attempt in attempts:  # the remaining closures end (well or not)
        job.attempt_ended(attempt, ok=False)
    assert job.rows.size == UNITS * UNIT and job.units == UNITS
    assert job.ready_to_finalize(rows_complete=True)
    orphans = {d.first for d in job.orphans()}
    published = {d.first for d in job.decided.values() if d.state == "published"}
    assert not orphans & published
    assert orphans | published | {u * UNIT for u in resumed} == {u * UNIT
                                                                  for u in range(UNITS)}
    job.begin_finalize()
    job.finalized(True)
    assert job.state == COMPLETE and all(d.state == "published" for d in job.decided.values())


@given(st.integers(1, 16), st.integers(0, 20), st.booleans(), st.booleans())
def test_top_up_never_exceeds_its_target(target, outstanding, leaseable, committed):
    job = JobState("j", outstanding=outstanding)
    n = job.top_up(target, leaseable, committed)
    assert n >= 0
    if leaseable:
        assert outstanding + n == max(outstanding, target)
    else:
        assert n <= 1 and (n == 0 or ((committed or outstanding == 0)
                                      and outstanding < target))
        assert n == 1 or outstanding > 0  # never none left while rows are leased
