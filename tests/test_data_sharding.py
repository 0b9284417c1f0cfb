"""Pure planning: static sharding policies partition rows exactly; epoch block plans."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daskdist.data import batching
from daskdist.data.sharding import assign


def _rows(pieces):
    out = []
    for p in pieces:
        out.extend(p.start + r for r in range(p.num_rows) if (p.start + r) % p.stride == p.offset)
    return out


layouts = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 9)), min_size=1, max_size=12)


@settings(max_examples=80, deadline=None)
@given(layout=layouts, n=st.integers(1, 6),
       policy=st.sampled_from(["auto", "file", "row_group", "data"]))
def test_static_policies_partition_rows_exactly(layout, n, policy):
    layout = sorted(layout)  # units of a file are consecutive
    files = [f for f, _ in layout]
    rows = [r for _, r in layout]
    total = sum(rows)
    if policy == "file" and len(set(files)) < n:
        with pytest.raises(ValueError, match=f"{len(set(files))} files for {n} pipelines"):
            assign(files, rows, n, 0, policy)
        return
    seen = Counter()
    for i in range(n):
        resolved, pieces = assign(files, rows, n, i, policy)
        assert sum(p.rows for p in pieces) == len(_rows(pieces))
        seen.update(_rows(pieces))
    assert sorted(seen) == list(range(total))
    assert all(c == 1 for c in seen.values())


def test_auto_resolution_and_off():
    files, rows = [0, 0, 1, 1], [5, 5, 5, 5]
    assert assign(files, rows, 2, 0, "auto")[0] == "file"
    assert assign(files, rows, 3, 0, "auto")[0] == "row_group"
    assert assign(files, rows, 5, 0, "auto")[0] == "data"
    assert assign(files, rows, 1, 0, "auto")[0] == "off"
    for i in range(3):
        policy, pieces = assign(files, rows, 3, i, "off")
        assert policy == "off" and _rows(pieces) == list(range(20))
    assert [p.unit for p in assign(files, rows, 2, 1, "file")[1]] == [2, 3]
    with pytest.raises(ValueError, match="unknown"):
        assign(files, rows, 2, 0, "dynamic")


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 50), min_size=0, max_size=10), shuffle=st.booleans(),
       seed=st.integers(0, 3), epoch=st.integers(0, 3), buf=st.integers(1, 120),
       pos=st.integers(0, 400))
def test_block_plan_covers_pieces_once_and_locates(rows, shuffle, seed, epoch, buf, pos):
    blocks = batching.plan_blocks(rows, shuffle, seed, epoch, buf)
    assert sorted(k for b in blocks for k in b.pieces) == list(range(len(rows)))
    assert blocks == batching.plan_blocks(rows, shuffle, seed, epoch, buf)
    start = 0
    for b in blocks:
        assert b.start == start and b.rows == sum(rows[k] for k in b.pieces)
        start += b.rows
        if shuffle and b is not blocks[-1]:
            assert b.rows >= buf
    bi, off = batching.locate(blocks, pos)
    if pos >= sum(rows):
        assert bi == len(blocks)
    else:
        assert blocks[bi].start + off == pos and 0 <= off < blocks[bi].rows


def test_shuffle_depends_on_seed_and_epoch():
    rows = [10] * 20
    a = batching.plan_blocks(rows, True, 0, 0, 30)
    assert a != batching.plan_blocks(rows, True, 0, 1, 30)
    assert a != batching.plan_blocks(rows, True, 1, 0, 30)
    p = batching.block_permutation(100, 0, 0, 0)
    assert sorted(p.tolist()) == list(range(100))
    assert not np.array_equal(p, batching.block_permutation(100, 0, 1, 0))


def test_ranges_of_ids_and_dynamic_order():
    assert batching.ranges_of_ids(np.array([5, 3, 4, 9, 0])) == [(0, 1), (3, 6), (9, 10)]
    assert batching.ranges_of_ids(np.array([], dtype=np.int64)) == []
    ids = batching.ids_of_ranges([(2, 5), (8, 10)])
    assert ids.tolist() == [2, 3, 4, 8, 9]
    tile = batching.dynamic_tile(128)
    order = batching.dynamic_order(1000, 0, 0, 3, tile)
    assert sorted(order.tolist()) == list(range(1000))
    assert not np.array_equal(order, np.arange(1000))
    # a batch holds few contiguous runs wherever it is cut, so its ack stays small
    runs = [len(batching.ranges_of_ids(order[a:a + 128])) for a in range(0, 1000, 50)]
    assert max(runs) <= 128 // tile + 2 and max(runs) > 4
