"""The pure rules of sharded commits (``daskdist.core.resharding``),
property-tested: how rows are cut over ranks, the copy ring, who serves which shard
after losses, and the row routes and byte windows that reshard a commit to a new world size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daskdist.core.resharding import (
    ALIGN,
    Report,
    choose,
    holders,
    offsets,
    pieces,
    predecessors,
    ring,
    rounds,
    routes,
    span,
    stream_bytes,
    successors,
    window,
)

pytestmark = pytest.mark.timeout(120)

worlds = st.integers(1, 12)
rows = st.integers(0, 40)


@given(rows, worlds)
def test_span_cuts_the_rows_in_order_as_torch_chunk_does(n, world):
    c = -(-n // world)
    got = [span(n, world, i) for i in range(world)]
    assert got[0][0] == 0 and got[-1][1] == n
    assert all(a <= b and b - a <= c for a, b in got)
    assert all(got[i][1] == got[i + 1][0] for i in range(world - 1))
    chunks = [list(range(n))[i:i + c] for i in range(0, n, c)] if n else []
    assert [list(range(a, b)) for a, b in got if b > a] == chunks


def test_span_refuses_an_index_outside_the_world():
    with pytest.raises(ValueError, match="outside a world of 3"):
        span(10, 3, 3)


@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=12))
def test_the_ring_puts_every_copy_on_another_host_when_it_can(hosts):
    order = ring(hosts)
    assert sorted(order) == list(range(len(hosts)))
    if len(set(hosts)) == 1:
        assert order == list(range(len(hosts)))
    biggest = max(hosts.count(h) for h in set(hosts))
    succ = successors(order)
    if len(hosts) >= 2 and biggest <= len(hosts) // 2:
        assert all(hosts[r] != hosts[succ[r]] for r in range(len(hosts)))
    pred = predecessors(order)
    assert all(succ[pred[r]] == r for r in range(len(hosts)))


@st.composite
def losses(draw):
    hosts = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=10))
    lost = draw(st.sets(st.integers(0, len(hosts) - 1)))
    return hosts, lost


@given(losses(), st.integers(0, 3))
def test_memory_recovery_exactly_when_no_shard_lost_both_its_holders(case, commits):
    hosts, lost = case
    world = len(hosts)
    order = ring(hosts)
    pred, succ = predecessors(order), successors(order)
    survivors = [r for r in range(world) if r not in lost]
    # the survivors are the new group's ranks 0.. in order; a replacement holds nothing
    reports = [Report(commits + 1, 5, world, r, pred[r] if world > 1 else -1)
               for r in survivors] + [Report(0, 0, 0, -1, -1)]
    src = choose(reports, known=commits + 1)  # the scheduler's record
    covered = all(i not in lost or (world > 1 and succ[i] not in lost) for i in range(world))
    if covered and survivors:
        assert src.kind == "memory" and src.commits == commits + 1 and src.world == world
        assert sorted(src.serve) == list(range(world))
        for i, rank in src.serve.items():
            r = reports[rank]
            assert i in (r.own, r.peer)
            if i not in lost:  # a surviving owner serves its own shard
                assert r.own == i
    else:
        assert src.kind == "lost" and (src.missing or not survivors)
        assert choose(reports, checkpoint=commits + 1, known=commits + 1).kind == "checkpoint"
    if world >= 2 and len(lost) == 1:
        assert src.kind == "memory"  # any single loss


def test_choose_prefers_a_newer_checkpoint_and_never_starts_fresh_after_commits():
    held = [Report(4, 2, 2, 0, 1), Report(4, 2, 2, 1, 0)]
    assert choose(held).kind == "memory"
    assert choose(held, checkpoint=6).kind == "checkpoint"
    assert choose(held, checkpoint=6).commits == 6
    none = [Report(0, 0, 0, -1, -1)] * 3
    assert choose(none).kind == "fresh"
    assert choose(none, known=3).kind == "lost"
    assert choose(none, checkpoint=2, known=3).kind == "checkpoint"


def test_choose_takes_the_newest_layout_that_has_every_shard():
    # a sync re-cut commit 7 for generation 9 on one rank only (a member was lost while
    # the others took their new copies): generation 8's copies still have every shard
    mixed = [Report(7, 9, 3, 0, 2), Report(7, 8, 3, 1, 0), Report(7, 8, 3, 2, 1),
             Report(7, 8, 3, 0, 2)]
    src = choose(mixed)
    assert (src.kind, src.layout, src.world) == ("memory", 8, 3)


def test_holders_report_the_missing_indices():
    serve, missing = holders({0: [0, 3], 1: [1]}, 4)
    assert serve == {0: 0, 3: 0, 1: 1} and missing == [2]


@st.composite
def reshards(draw):
    sizes = draw(st.lists(st.integers(0, 30), min_size=1, max_size=5))
    old, new = draw(worlds), draw(worlds)
    serve = {i: draw(st.integers(0, new - 1)) for i in range(old)}
    return sizes, old, new, serve


@given(reshards())
@settings(max_examples=300)
def test_routes_deliver_every_row_of_the_new_shards_once_from_its_server(case):
    sizes, old, new, serve = case
    plan = routes(sizes, old, new, serve)
    got: dict[tuple[int, int], list[int]] = {}
    for (src, dst), parts in plan.items():
        for p in parts:
            assert serve[p.index] == src
            a, b = span(sizes[p.entry], old, p.index)
            assert a <= p.start < p.stop <= b  # cut from inside the old shard
            got.setdefault((dst, p.entry), []).extend(range(p.start, p.stop))
    for dst in range(new):
        for e, n in enumerate(sizes):
            a, b = span(n, new, dst)
            assert sorted(got.get((dst, e), [])) == list(range(a, b))
            # and in order from any one source: the receiver places them by stream order
    for dst in range(new):
        assert [p for p in pieces(sizes, old, new, dst)] == sorted(
            (p for (_, d), ps in plan.items() if d == dst for p in ps),
            key=lambda p: (p.entry, p.start))


@given(reshards(), st.integers(1, 50))
def test_windows_cut_each_stream_into_rounds_without_gap_or_overlap(case, bucket):
    sizes, old, new, serve = case
    row_bytes = [((e % 3) + 1) * 4 for e in range(len(sizes))]
    for parts in routes(sizes, old, new, serve).values():
        total = stream_bytes(parts, row_bytes)
        seen: dict[int, list[tuple[int, int]]] = {}
        for k in range(rounds(total, bucket)):
            cut = window(parts, row_bytes, k * bucket, (k + 1) * bucket)
            assert sum(b - a for _, a, b in cut) == min(bucket, total - k * bucket)
            for p, a, b in cut:
                seen.setdefault(id(p), []).append((a, b))
        for p in parts:
            got = seen[id(p)]
            n = (p.stop - p.start) * row_bytes[p.entry]
            assert got[0][0] == 0 and got[-1][1] == n
            assert all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1))


@given(st.lists(rows, min_size=1, max_size=6), worlds, st.data())
def test_offsets_align_every_tensor_and_never_overlap(sizes, world, data):
    index = data.draw(st.integers(0, world - 1))
    row_bytes = [data.draw(st.sampled_from([1, 2, 4, 8, 12])) for _ in sizes]
    offs, total = offsets(sizes, row_bytes, world, index)
    assert all(o % ALIGN == 0 for o in offs) and total % ALIGN == 0
    ends = [o + (span(n, world, index)[1] - span(n, world, index)[0]) * rb
            for o, n, rb in zip(offs, sizes, row_bytes, strict=True)]
    assert all(ends[i] <= offs[i + 1] for i in range(len(offs) - 1))
    assert not ends or ends[-1] <= total


def test_a_commit_cut_short_on_some_ranks_is_served_from_what_they_staged():
    # 3 ranks; rank 2 died inside commit 5's allgather: ranks 0 completed it, rank 1's
    # allgather failed (it holds commit 4, and staged 5 with rank 0's copy)
    reports = [Report(5, 3, 3, 0, 2), Report(4, 3, 3, 1, 0)]
    staged = {1: Report(5, 3, 3, 1, 0)}
    src = choose(reports, tentative=staged)
    assert (src.kind, src.commits) == ("memory", 5)
    assert src.serve == {0: 0, 2: 0, 1: 1}
    assert choose(reports).kind == "lost"  # without what rank 1 staged: shard 1 is gone
    # a commit that failed everywhere is never taken from what the ranks staged
    assert choose([Report(4, 3, 3, 0, 2), Report(4, 3, 3, 1, 0)],
                  tentative={0: Report(5, 3, 3, 0, 2), 1: Report(5, 3, 3, 1, 0)}).commits == 4
