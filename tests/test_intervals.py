"""The interval-set helpers shared by the lease table and the loader (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from daskdist.core.intervals import (
    intersect,
    intervals_from_ids,
    normalize,
    size_of,
    subtract,
    union,
)


def test_interval_helpers():
    assert normalize([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert subtract([(0, 3), (5, 9)], [(0, 9)]) == []
    assert union([(0, 2)], [(2, 4), (8, 9)]) == [(0, 4), (8, 9)]
    assert intervals_from_ids([3, 1, 2, 7]) == [(1, 4), (7, 8)]
    assert intersect([(0, 5), (8, 12)], [(3, 9)]) == [(3, 5), (8, 9)]
    assert size_of([(0, 5), (8, 12)]) == 9


ids = st.sets(st.integers(0, 200), max_size=60)


@given(ids, ids)
def test_set_algebra_matches_python_sets(a, b):
    x, y = intervals_from_ids(a), intervals_from_ids(b)

    def members(iv):
        return {i for s, e in iv for i in range(s, e)}

    assert members(union(x, y)) == a | b and union(x, y) == intervals_from_ids(a | b)
    assert subtract(x, y) == intervals_from_ids(a - b)
    assert intersect(x, y) == intervals_from_ids(a & b)
    assert size_of(x) == len(a)
    assert all(p[1] < q[0] for p, q in zip(x, x[1:], strict=False))  # disjoint, apart


@given(st.lists(st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 60),
                          st.integers(1, 12)), max_size=40))
def test_rowset_matches_a_python_set(ops):
    from daskdist.core.intervals import RowSet

    rs, model = RowSet(), set()
    for op, a, n in ops:
        ids = set(range(a, a + n))
        if op == "add":
            if ids & model:
                try:
                    rs.add(a, a + n)
                except ValueError:
                    continue  # an overlap is refused, nothing changed
                raise AssertionError("an overlapping add was accepted")
            rs.add(a, a + n)
            model |= ids
        else:
            assert rs.remove(a, a + n) == (ids <= model)
            if ids <= model:
                model -= ids
        assert rs.items() == intervals_from_ids(model) and rs.size == len(model)
        assert rs.covers(a, a + n) == (ids <= model)
        assert rs.intersect(a, a + n) == intervals_from_ids(ids & model)
