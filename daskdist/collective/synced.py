"""``synced(iterator)``: batches while every rank has one, for the end of an epoch (SPEC §4.2).

In synchronous training every rank must take the same number of steps. With a dynamic
dataset the ranks' iterators run dry at different steps, so each step's batch is
agreed on: one small allreduce (min of "I got a batch") per step. As soon as any rank's
iterator is exhausted, every rank stops at the same step, and a rank that took a batch
it will not train gives it back: the batch's lease tokens are taken out of the closure's
list and released to the pool (never acknowledged), so another rank trains those rows
later. The driver loops ``schedule_on_all`` until ``ds.progress()["complete"]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from daskdist.collective import rows
from daskdist.collective.group import get_group
from daskdist.context import consumed_mark, take_consumed

T = TypeVar("T")

_END = object()


def synced(iterable: Iterable[T]) -> Iterator[T]:
    """Yield ``iterable``'s items while every rank of the group got one (call it inside a
    gang closure; every rank must call it the same way)."""
    it = iter(iterable)
    while True:
        mark = consumed_mark()
        item: Any = next(it, _END)
        g = get_group()
        flag = torch.tensor([0 if item is _END else 1], dtype=torch.int64,
                            device=g._wire_device())
        g.allreduce(flag, op="min")
        if int(flag.item()) == 0:
            if item is not _END:
                back = take_consumed(mark)  # taken, not trained: back to the pool
                if back:
                    rows.release(back)
            return
        yield item
