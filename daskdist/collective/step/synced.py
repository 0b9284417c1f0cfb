"""``synced(iterator)``: the same steps on every rank, to the end of an epoch (SPEC §4.2).

In synchronous training every rank must take the same number of steps. With a dynamic
dataset the ranks' iterators run dry at different steps, so each step's batch is
agreed on: every rank's "I got a batch". The next batch is fetched, and the agreement
carried, inside the step's ``allreduce_gradients`` (the closure's
:class:`~daskdist.collective.step.step.Step`: :class:`~daskdist.collective.step.step.Ahead`
rides that call); a loop with no such call (DDP) gets one small allreduce a step. A
commit's message to the scheduler goes out when the loop is next asked for a batch
(:meth:`~daskdist.collective.step.step.Step.defer`).

- Every rank got a batch: yield it.
- Some ranks got one, others found no free rows (the tail of the epoch): the batches
  taken are pooled, the ranks that got one take as many more as the dry ranks lack
  (so the step keeps its global batch while rows last), and the rows are split evenly
  over the ranks (two ``allgather_object`` calls); the step is yielded, and the loop
  goes on: a rank that ran dry asks its iterator again at
  every step (rows given back meanwhile, by a failed or lost rank, are served to it).
  Each row's lease token stays with the rank that leased it, so the next
  ``State.commit()`` acknowledges it as usual. When fewer rows than ranks are left,
  some ranks get a batch of zero rows: keep the step's loss finite for them (e.g. a
  sum divided by ``max(1, n)``). Pooling rather than giving the taken batches back is
  what lets the tail finish in the same gang run: the rows left in one rank's lease
  feed every rank.
- No rank got one: the epoch's rows are all acknowledged or with the gang (consumed,
  to be committed), unless some are leased elsewhere (a closure outside the gang, a
  loader giving them back): then the ranks wait for them, asking again, at most
  ``daskdist.collective.tail-wait``. Then ``synced`` stops on every rank at the same
  step, so a fault-free dynamic epoch takes one gang run.
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

import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from daskdist import config
from daskdist.collective.group import get_group
from daskdist.collective.replicas import to_cpu
from daskdist.collective.step.step import END, Ahead
from daskdist.core.nest import map_structure
from daskdist.core.protocol import LeaseToken
from daskdist.observe import phases
from daskdist.session.scope import session_services
from daskdist.session.tokens import (
    consumed_mark,
    consumed_since,
    held_tokens,
    put_aside,
    take_tokens,
)

T = TypeVar("T")


def synced(iterable: Iterable[T]) -> Iterator[T]:
    """Yield ``iterable``'s batches while any rank of the group has rows: a step where
    every rank got a batch yields it; at the epoch's tail, a step where only some did
    yields their rows split evenly over the ranks and goes on; the loop ends on every
    rank at the same step once no rank got one and no rows of the epoch are left with
    anyone else (call it inside a gang closure; every rank the same way)."""
    it = iter(iterable)
    tail = _Tail(it)
    ahead = Ahead(it)  # its place in the closure's Step: a commit's message waits for it
    g = None
    try:
        while True:
            phases.step(phases.SYNCED)  # a batch asked for: the previous step ended
            ahead.flush()  # the last commit's message, now that the commit is over
            with phases.phase(phases.DATA) as waited:  # the batch and its agreement
                while True:
                    g = get_group()
                    got = ahead.take()  # fetched and agreed inside the step's allreduce
                    if got is not None:
                        item, mine, every, anyone = got
                    else:
                        mark = consumed_mark()
                        item = next(it, END)
                        # this batch's tokens, given back by identity if it is not
                        # trained (a position in the closure's list would be stale)
                        mine = consumed_since(mark)
                        every, anyone = _agree(g, item is not END)
                    # no rank got one: rows still out elsewhere? ask again after a while
                    if anyone or not tail.wait(g):
                        break
                if not anyone:
                    return
                tail.reset()
                if not every:
                    pooled = g.allgather_object(None if item is END else to_cpu(item))
                    mark = consumed_mark()
                    more = _more(it, pooled, g.rank) if item is not END else []
                    mine = mine + consumed_since(mark)
                    pooled += [b for extra in g.allgather_object(more) for b in extra]
                    item = _share([b for b in pooled if b is not None], g.rank,
                                  g.world_size, g.device)
                waited.rows(phases.batch_rows(item))
            ahead.arm()  # the next batch is fetched and agreed on in this step's allreduce
            trained = False
            try:
                yield item
                trained = True
            finally:
                if not trained:  # the loop stopped with this batch: its step ends here
                    phases.step(phases.SYNCED)
                if not trained and mine:
                    _give_back(g, mine)  # taken, not trained: back to the pool
    finally:
        ahead.close(g)


def _more(it: Iterator, pooled: list, rank: int) -> list:
    """A tail step where some ranks ran dry: the batches this rank takes besides its own
    so that the ranks with rows fill the step's global batch (the dry ranks' batches
    split over them, in rank order), fewer where its iterator runs dry too."""
    haves = [r for r, b in enumerate(pooled) if b is not None]
    need = len(pooled) - len(haves)
    mine = need // len(haves) + (haves.index(rank) < need % len(haves))
    out = []
    for _ in range(mine):
        batch = next(it, END)
        if batch is END:
            break
        out.append(to_cpu(batch))
    return out


def _give_back(g: Any, tokens: list) -> None:
    """Rows taken and never trained go back to the pool: now, or, when the loop ended
    because the group broke (the closure ends), with the closure's result (no call to
    the scheduler on the survivors' way to re-forming)."""
    if not g.usable:
        put_aside(tokens)
        return
    back = take_tokens(tokens)
    if back:
        session_services().release_tokens(back)


def _agree(g: Any, have: bool) -> tuple[bool, bool]:
    """Whether every rank, and whether any rank, got a batch (one small allreduce)."""
    n = int(have)
    flags = torch.tensor([n, -n], dtype=torch.int64, device=g.wire_device)
    g.allreduce(flags, op="min")
    return int(flags[0]) == 1, int(flags[1]) == -1


class _Tail:
    """The end of a dynamic epoch in a gang: when no rank got a batch, are rows of the
    epoch still leased to someone outside the gang's own hands (a closure elsewhere, a
    rank's loader giving its rows back)? Then the ranks wait for them, polling, until
    ``daskdist.collective.tail-wait``; rows the gang consumed and has not committed yet
    (a framework's fetch-ahead included: :func:`~daskdist.session.tokens.set_aside`) are its
    own. Rank 0 asks the lease service and decides for all (one broadcast)."""

    def __init__(self, it: Any) -> None:
        loader = getattr(it, "loader", None)
        # a daskdist loader under "dynamic" (other iterables end when they run dry)
        self.loader = loader if getattr(loader, "policy", None) == "dynamic" else None
        self.deadline: float | None = None
        self.pause = 0.0

    def reset(self) -> None:
        self.deadline, self.pause = None, 0.0

    def wait(self, g: Any) -> bool:
        """Whether every rank asks again (after a pause), or the loop ends: the same
        collective calls on every rank, whatever its iterable, and rank 0's answer
        everywhere (it decides when its iterable is a dynamic loader's)."""
        ld = self.loader
        mine = 0 if ld is None else sum(
            b - a for t in held_tokens() if (lease := LeaseToken.parse(t))
            and (lease.dataset_id, lease.epoch) == (ld.dataset_id, ld.epoch)
            for a, b in lease.ranges)
        held = torch.tensor([mine], dtype=torch.int64, device=g.wire_device)
        g.allreduce(held, op="sum")
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + config.seconds("collective.tail-wait")
        decision = torch.zeros(1, dtype=torch.int64, device=g.wire_device)
        if g.rank == 0 and ld is not None:
            p = ld.progress()
            out = p["leased"] - int(held[0])  # rows leased to others than the gang's
            decision[0] = int(not p["complete"] and out > 0 and now < self.deadline)
        g.broadcast(decision, src=0)
        if not int(decision[0]):
            return False
        self.pause = min(1.0, max(0.05, 2 * self.pause))
        time.sleep(self.pause)
        return True


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
