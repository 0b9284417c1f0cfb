"""``collective.step.riders``: every rank's ints ride the gradient allreduce's first
bucket, in its own slots, and come back exact whatever the bucket's float dtype (the sum
of one rank's chunks and the others' zeros is the chunks); the closure's ``Step`` hands
them to one call in key order. Pure: the allreduce is the sum of the segments the ranks
encode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daskdist.collective.step.riders import Riding
from daskdist.collective.step.step import this_step
from daskdist.session.scope import ClosureScope, closure_scope

pytestmark = pytest.mark.timeout(120)

INT64 = st.integers(-2**63, 2**63 - 1)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class _Rider:
    def __init__(self, key: str, ints: list[int]) -> None:
        self.key, self.values = key, ints
        self.table: list | None = None
        self.generation: int | None = None
        self.fail = 0

    def ints(self) -> list[int]:
        return self.values

    def arrived(self, table, generation) -> None:
        self.table, self.generation = table, generation

    def failed(self) -> None:
        self.fail += 1


def _allreduce(rows: list[list[list[int]]], dtype: torch.dtype) -> list[list[_Rider]]:
    """Each rank encodes its riders' ints; the summed segment is decoded on each rank."""
    world = len(rows)
    ranks = [[_Rider(f"r{i}", ints) for i, ints in enumerate(r)] for r in rows]
    ridings = [Riding(riders, 7) for riders in ranks]
    segments = [rd.encode(rank, world, dtype, torch.device("cpu"))
                for rank, rd in enumerate(ridings)]
    total = torch.stack(segments).sum(0)
    assert total.dtype == dtype
    for rd in ridings:
        rd.decode(total.clone(), world)
    return ranks


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 5), st.lists(st.integers(0, 6), min_size=1,
                                                              max_size=3), st.data())
def test_every_ranks_ints_come_back_exact_in_every_dtype(dtype, world, widths, data):
    rows = [[data.draw(st.lists(INT64, min_size=w, max_size=w)) for w in widths]
            for _ in range(world)]
    for rank_riders in _allreduce(rows, dtype):
        for i, r in enumerate(rank_riders):
            assert r.table == [rows[rank][i] for rank in range(world)]
            assert r.generation == 7


def test_riders_ride_once_in_key_order_and_only_inside_a_closure():
    a, b = _Rider("b-state", [1, 2]), _Rider("a-synced", [3])
    assert this_step() is None  # outside a closure: no step, nothing rides
    scope = ClosureScope()
    with closure_scope(scope):
        assert this_step(create=False) is None  # made when first used
        step = this_step()
        assert step is scope.step and this_step() is step  # one per closure
        step.ride(a)
        step.ride(b)
        taken = step.riding(3)
        assert [r.key for r in taken.riders] == ["a-synced", "b-state"]
        assert step.riding(3) is None  # taken: the next call carries nothing unless registered
        step.ride(a)
        step.ride(_Rider("b-state", [9]))  # the same key: the later one rides
        assert [r.values for r in step.riding(3).riders] == [[9]]
        step.ride(a)
        step.unride(_Rider("b-state", [9]))  # not the one riding: it stays
        step.unride(a)
        assert step.riding(3) is None


def test_a_rider_that_fails_to_give_its_ints_fails_them_all():
    class Broken(_Rider):
        def ints(self):
            raise ValueError("no head")

    good = _Rider("a", [1])
    with pytest.raises(ValueError, match="no head"):
        Riding([good, Broken("b", [])], 0).encode(0, 2, torch.float32, torch.device("cpu"))
    assert good.fail == 1 and good.table is None
