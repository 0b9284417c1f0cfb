"""``synced(iterator)``: batches while every rank has one, for the end of an epoch (SPEC §4.2).

In synchronous training every rank must take the same number of steps. With a dynamic
dataset the ranks' iterators run dry at different steps, so each step's batch is
agreed on: one small allreduce (min and max of "I got a batch") per step.

- Every rank got a batch: yield it.
- No rank got one: stop (on every rank at the same step).
- Some ranks got one, others are exhausted (the tail of the epoch): the batches taken
  are pooled and split evenly over the ranks (one ``allgather_object``, at most once
  per call), that last step is yielded, and ``synced`` stops on every rank. Each row's
  lease token stays with the rank that leased it, so the next ``State.commit()``
  acknowledges it as usual. When fewer rows than ranks are left, some ranks get a
  batch of zero rows: keep the step's loss finite for them (e.g. a sum divided by
  ``max(1, n)``). Pooling rather than giving the taken batches back is what lets the
  tail finish: the rows left in one leased unit could otherwise never feed every rank.
- A batch taken but never trained (the loop body raised, or the generator was closed
  before the step) is given back: its lease tokens are taken out of the closure's list
  and released to the pool, never acknowledged. They are found by identity: a
  generator finalized late (by the garbage collector, in the thread of a later closure)
  gives back nothing of that closure's, and a wrapper that took the tokens out first
  (``integrations.common.TokenHold``) keeps the give-back to itself.

Batches are tensors or (nested) dicts, lists and tuples of tensors with the rows on
the first dimension; a list holding no tensor is a column of rows (a string or object
column of a batch dict: one Python value per row), pooled and split like a tensor.
The driver loops ``schedule_on_all`` until ``ds.progress()["complete"]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from daskdist.collective.group import get_group
from daskdist.collective.replicas import to_cpu
from daskdist.context import consumed_mark, consumed_since, session_services, take_tokens
from daskdist.core.nest import map_structure
from daskdist.observe import phases

T = TypeVar("T")

_END = object()


def synced(iterable: Iterable[T]) -> Iterator[T]:
    """Yield ``iterable``'s batches while every rank of the group got one; at the first
    step where only some did, yield their rows split evenly over the ranks, then stop
    (call it inside a gang closure; every rank the same way)."""
    it = iter(iterable)
    while True:
        phases.step(phases.SYNCED)  # a batch asked for: the previous step ended
        with phases.phase(phases.DATA) as waited:  # the batch and its agreement
            mark = consumed_mark()
            item: Any = next(it, _END)
            # this batch's tokens, given back by identity if it is not trained (a
            # position in the closure's list would be stale: see take_tokens)
            mine = consumed_since(mark)
            g = get_group()
            have = 0 if item is _END else 1
            flags = torch.tensor([have, -have], dtype=torch.int64, device=g._wire_device())
            g.allreduce(flags, op="min")
            every, anyone = int(flags[0]) == 1, int(flags[1]) == -1
            if not anyone:
                return
            if not every:
                pooled = g.allgather_object(None if item is _END else to_cpu(item))
                item = _share([b for b in pooled if b is not None], g.rank, g.world_size,
                              g.device)
            waited.rows(phases.batch_rows(item))
        trained = False
        try:
            yield item
            trained = True
        finally:
            if not trained:  # the loop stopped with this batch: its step ends here
                phases.step(phases.SYNCED)
            if not trained and mine:
                back = take_tokens(mine)  # taken, not trained: back to the pool
                if back:
                    session_services().release_tokens(back)
        if not every:
            phases.step(phases.SYNCED)  # the pooled last step ended
            return


def _is_column(x: Any) -> bool:
    """A list holding no tensor at any depth is a column of rows (a string or object
    column: one Python value per row), not nested fields."""
    return isinstance(x, list) and not _has_tensor(x)


def _has_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, dict):
        return any(_has_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_tensor(v) for v in x)
    return False


def _cat(batches: list) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if any(_is_column(b) for b in batches):  # a column: its rows, one after another
        return [row for b in batches for row in b]
    if isinstance(first, dict):
        return type(first)((k, _cat([b[k] for b in batches])) for k in first)
    if isinstance(first, (list, tuple)):
        return type(first)(_cat([b[i] for b in batches]) for i in range(len(first)))
    return first


def _rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if _is_column(batch):
        return len(batch)
    if isinstance(batch, dict):
        return _rows(next(iter(batch.values())))
    return _rows(batch[0])


def _share(batches: list, rank: int, world: int, device: torch.device) -> Any:
    """This rank's even share of the pooled rows (tensors on ``device``)."""
    whole = _cat(batches)
    n = _rows(whole)
    lo, hi = rank * n // world, (rank + 1) * n // world

    def part(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v[lo:hi].to(device)
        return v[lo:hi] if _is_column(v) else v

    return map_structure(part, whole, leaf=_is_column)
