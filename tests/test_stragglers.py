"""The pure bookkeeping behind ``coord.report()`` (SPEC §5.1), without a cluster: step-time
histograms and windows, the straggler state machine, the per-rank table, the hang watch,
the odd ranks of a hang, and the checks of a member's window message."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daskdist.core import protocol
from daskdist.observe.hangs import HangWatch, odd_ranks
from daskdist.observe.steptimes import (
    BUCKETS,
    COLLECTIVE,
    COMMIT,
    COMPUTE,
    DATA,
    WindowSum,
    bucket,
    merge,
    quantile,
    value,
)
from daskdist.observe.stragglers import RankTable, Rule, Streak

pytestmark = pytest.mark.timeout(120)

seconds = st.floats(min_value=1e-5, max_value=1e4, allow_nan=False)


# -- step-time histograms -------------------------------------------------------------------
@given(seconds)
def test_a_bucket_stands_for_its_steps_within_five_percent(x):
    assert abs(value(bucket(x)) / x - 1) <= 0.045


@given(st.lists(seconds, min_size=1, max_size=200), st.sampled_from([0.5, 0.9, 1.0]))
def test_a_quantile_is_the_bucket_of_the_true_order_statistic(xs, q):
    hist: dict[int, int] = {}
    for x in xs:
        hist[bucket(x)] = hist.get(bucket(x), 0) + 1
    exact = sorted(xs)[max(1, math.ceil(q * len(xs))) - 1]
    assert quantile(hist, q) == value(bucket(exact))


@given(st.lists(st.dictionaries(st.integers(-160, 160), st.integers(1, 5), max_size=8),
                max_size=5))
def test_merged_histograms_count_every_step(hists):
    assert sum(merge(hists).values()) == sum(sum(h.values()) for h in hists)
    assert quantile({}, 0.5) is None


@given(st.lists(st.tuples(seconds, seconds, seconds, seconds, st.integers(0, 1000)),
                min_size=1, max_size=300))
def test_a_window_is_fixed_size_and_its_phases_sum_to_its_steps(steps):
    w = WindowSum(7)
    for total, data, coll, commit, rows in steps:
        w.add(total, data, coll, commit, rows)
    assert w.steps == len(steps) == sum(w.hist.values())
    assert len(w.hist) <= BUCKETS
    assert math.isclose(sum(w.phases), w.seconds, rel_tol=1e-9, abs_tol=1e-9)
    assert all(p >= 0 for p in w.phases)
    assert w.rows == sum(s[4] for s in steps)
    assert 0.0 <= w.data_share <= 1.0 + 1e-9
    assert math.isclose(w.own, w.step_mean - w.mean(COLLECTIVE), abs_tol=1e-12)


# -- the straggler state machine ---------------------------------------------------------
def _reference(slow: list[bool], need: int) -> list[str | None]:
    """What a rank's judged windows (consecutive) must yield, from first principles."""
    out, straggling = [], False
    for i in range(len(slow)):
        recent = slow[max(0, i - need + 1): i + 1]
        if not straggling and len(recent) == need and all(recent):
            straggling = True
            out.append("start")
        elif straggling and len(recent) == need and not any(recent):
            straggling = False
            out.append("end")
        else:
            out.append(None)
    return out


@settings(max_examples=300)
@given(st.lists(st.booleans(), max_size=40), st.integers(1, 4))
def test_episodes_start_after_n_slow_windows_and_end_after_n_fast_ones(slow, need):
    rule = Rule(ratio=1.5, windows=need, min_excess=0.0)
    s = Streak()
    got = []
    for i, is_slow in enumerate(slow):
        own = 2.0 if is_slow else 1.0
        got.append(s.judge(i, own, 1.0, {"compute": 1.0, "data": 0.0, "commit": 0.0}, rule))
    assert got == _reference(slow, need)
    kinds = [k for k in got if k]
    assert kinds == ["start", "end"] * (len(kinds) // 2) + ["start"] * (len(kinds) % 2)


@given(st.lists(st.integers(0, 3), min_size=3, max_size=30))
def test_a_gap_in_windows_starts_the_count_again(gaps):
    rule = Rule(windows=3, min_excess=0.0)
    s, index = Streak(), 0
    for gap in gaps:
        index += 1 + gap
        kind = s.judge(index, 3.0, 1.0, {"compute": 1.0}, rule)
        if kind == "start":  # only ever after three consecutive windows
            assert s.since == index - 2
    assert s.judge(index, 3.0, 1.0, {}, rule) is None  # a duplicate: not judged again


@given(st.dictionaries(st.sampled_from(["data", "compute", "commit"]),
                       st.floats(-1, 1, allow_nan=False), min_size=3))
def test_the_cause_is_the_phase_with_the_most_excess(excess):
    s = Streak()
    for i in range(3):
        s.judge(i, 3.0, 1.0, excess, Rule(min_excess=0.0))
    assert s.straggling and excess[s.cause] == max(excess.values())


def test_jitter_below_the_minimum_excess_is_no_straggler():
    s = Streak()
    for i in range(5):
        assert s.judge(i, 30e-6, 10e-6, {"compute": 20e-6}, Rule(min_excess=1e-3)) is None


# -- the table of ranks -------------------------------------------------------------------
def _window(index: int, steps: int, step: float, collective: float, data: float = 0.0,
            commit: float = 0.0, rows: int = 0) -> WindowSum:
    w = WindowSum(index)
    for _ in range(steps):
        w.add(step, data, collective, commit, rows)
    return w


def _feed(table: RankTable, world: int, windows: int, slow: dict[int, float],
          data: float = 0.0, first: int = 0) -> list:
    """``world`` ranks report ``windows`` windows: a step of 0.1 s, of which the ranks
    not in ``slow`` wait in collectives for the slow ones (their own time is 5 ms)."""
    episodes = []
    for i in range(first, first + windows):
        for r in range(world):
            own = slow.get(r, 0.005)
            w = _window(i, 10, 0.1, 0.1 - own - data, data=data, rows=32)
            ep = table.add(f"s{r}", f"tcp://w{r}", r, 1, "g", w, 10 * (i + 1))
            if ep is not None:
                episodes.append(ep)
    return episodes


def test_a_slow_rank_is_named_once_with_its_cause_and_the_episode_ends():
    table = RankTable(Rule(windows=3))
    eps = _feed(table, 8, 6, {3: 0.09})
    assert [(e.kind, e.rank, e.cause, e.since) for e in eps] == [("start", 3, "compute", 0)]
    assert eps[0].own_seconds == pytest.approx(0.09)
    assert eps[0].median_seconds == pytest.approx(0.005, rel=0.05)
    assert table.straggler(table.tracks["s3"], 3, 10.0)["since"] == 0.0
    assert table.straggler(table.tracks["s0"], 0, 10.0) is None
    eps = _feed(table, 8, 4, {}, first=6)  # fast again: three windows below end it
    assert [(e.kind, e.rank) for e in eps] == [("end", 3)]
    entry = table.entry(table.tracks["s3"], 3)
    assert entry["steps"] == 100 and entry["rows_per_second"] == pytest.approx(320.0)
    assert entry["step_seconds"]["median"] == pytest.approx(0.1, rel=0.05)
    assert sum(entry["phases"].values()) == pytest.approx(0.1)
    assert "data_source" not in entry


def test_every_rank_slow_alike_is_no_straggler_and_data_waits_are_a_bottleneck():
    table = RankTable()
    assert _feed(table, 4, 6, {r: 0.09 for r in range(4)}, data=0.06) == []
    assert table.bottleneck(4) == "data"
    table2 = RankTable()
    _feed(table2, 4, 2, {})
    assert table2.bottleneck(4) is None


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(1, 30), st.sets(st.integers(0, 39), max_size=5))
def test_the_table_stays_bounded_and_episodes_alternate(world, windows, slow):
    table = RankTable(Rule(windows=2))
    eps = _feed(table, world, windows, {r: 0.09 for r in slow if r < world})
    assert len(table.pools) <= table.keep_pools
    assert all(len(t.ring) <= table.rule.keep for t in table.tracks.values())
    by_rank: dict[int, list[str]] = {}
    for e in eps:
        by_rank.setdefault(e.rank, []).append(e.kind)
    for kinds in by_rank.values():
        assert kinds == ["start", "end"] * (len(kinds) // 2) + ["start"] * (len(kinds) % 2)


def test_a_new_run_starts_a_ranks_figures_and_a_new_rank_its_counters():
    table = RankTable()
    table.add("s0", "tcp://a", 0, 1, "g1", _window(0, 5, 0.1, 0.0, rows=4), 5)
    table.add("s0", "tcp://a", 0, 2, "g1", _window(1, 1, 0.2, 0.0, rows=4), 1)
    t = table.tracks["s0"]
    assert len(t.ring) == 1 and t.steps == 1 and t.totals[-1] == 24
    table.add("s0", "tcp://a", 1, 3, "g1", _window(2, 1, 0.2, 0.0, rows=4), 1)
    assert t.totals[-1] == 4  # a rank of its own now: its counters start again
    table.drop("s0")
    assert not table.tracks


# -- hangs ---------------------------------------------------------------------------------
def test_a_hang_fires_once_and_rearms_after_a_step():
    h = HangWatch(after=60.0)
    run = ("g", 1)
    assert h.report(run, 3, 0.5, now=100.0) is None
    assert h.report(run, 0, 30.5, now=130.0) is None
    assert h.report(run, 0, 60.5, now=160.0) == "hang"
    assert h.report(run, 0, 90.5, now=190.0) is None  # once per hang
    assert h.report(run, 1, 0.1, now=200.0) == "stepped"
    assert h.report(("g", 2), 0, 70.0, now=300.0) == "hang"  # a re-run counts from its start
    h.ended(("g", 2))
    assert h.report(("g", 3), 0, 1.0, now=301.0) is None


@given(st.dictionaries(st.integers(0, 50), st.sampled_from(["a", "b", "c"]), max_size=20))
def test_the_odd_ranks_are_those_away_from_the_most_common_place(wheres):
    odd, common = odd_ranks(wheres)
    if not wheres:
        assert (odd, common) == ([], "")
        return
    counts = {w: list(wheres.values()).count(w) for w in set(wheres.values())}
    assert counts[common] == max(counts.values())
    assert odd == sorted(r for r, w in wheres.items() if w != common)


def test_a_tie_goes_to_the_place_where_ranks_wait():
    assert odd_ranks({0: "blocked (t.py:3)", 1: "step (t.py:9)"},
                     {0: False, 1: True}) == ([0], "step (t.py:9)")
    assert odd_ranks({0: "x", 1: "x", 2: "y"}) == ([2], "x")


# -- the wire ------------------------------------------------------------------------------
def _wire(**change) -> list:
    w = protocol.RankWindow("s0", "g", 1, 0, 5, 2, 0.2, [0.05, 0.05, 0.0, 0.1], 64,
                            [(bucket(0.1), 2)], 12, 0.01, [0.0, 0.0])
    return list(w._replace(**change))


def test_a_window_message_is_checked_field_by_field():
    w = protocol.rank_window(tuple(_wire()), "op")
    assert w.hist == [(bucket(0.1), 2)] and w.phases == [0.05, 0.05, 0.0, 0.1]
    for change, what in [({"steps": -1}, "window.steps"), ({"phases": [0.1]}, "phases"),
                         ({"hist": [(1, -3)]}, "hist counts"), ({"seconds": math.inf},
                                                                 "window.seconds"),
                         ({"session": 3}, "window.session"), ({"ended": 1}, "window.ended")]:
        with pytest.raises((TypeError, ValueError), match=what):
            protocol.rank_window(_wire(**change), "op")
    with pytest.raises(TypeError, match="RankWindow"):
        protocol.rank_window(_wire()[:5], "op")


def test_phase_indices_are_the_wire_order():
    assert (DATA, COLLECTIVE, COMMIT, COMPUTE) == (0, 1, 2, 3)
