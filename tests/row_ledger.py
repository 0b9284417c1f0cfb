"""The row-count ledger the exactly-once tests train (pickled by reference): a State
whose ``counts`` gains each committed step's allreduced bincount of the ranks' batch
ids, so after an epoch every row's count must be exactly 1."""

from __future__ import annotations

import time

import numpy as np
import torch

import daskdist as dd


def make_counts(ctx, n: int):
    """A State holding a float64 count per row id ``0 .. n-1``."""
    return dd.collective.State(counts=torch.zeros(n, dtype=torch.float64))


def train_rows(state, it, pause: float = 0.0) -> tuple[int, int]:
    """A commit per step; returns the commit the State resumed at and the steps taken."""
    g = dd.collective.get_group()
    state.sync()
    resumed = state.commits
    steps = 0
    for batch in dd.collective.synced(it):
        c = torch.bincount(batch["id"], minlength=state.counts.numel()).to(torch.float64)
        g.allreduce(c)
        state.counts += c.to(state.counts.device)
        time.sleep(pause)
        state.commit()
        steps += 1
    return resumed, steps


def final_counts(state) -> tuple[int, list[float]]:
    """The committed count of commits and per-row counts."""
    state.sync()
    return state.commits, state.counts.tolist()


def assert_every_row_once(per_rank: list, n: int | None = None) -> None:
    """``per_rank``: ``final_counts`` of every rank; all equal, every row counted once."""
    counts = [c for _, c in per_rank]
    assert all(c == counts[0] for c in counts)
    c = np.asarray(counts[0])
    if n is not None:
        assert len(c) == n
    assert (c == 1).all(), (f"rows trained 0 times: {int((c == 0).sum())}, more than "
                            f"once: {int((c > 1).sum())}")


class RowCounts(torch.nn.Module):
    """A count per row id as a parameter: a step's gradient is minus its batch's
    bincount, so ``SGD(lr=1)`` adds the batch's rows to it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.counts = torch.nn.Parameter(torch.zeros(n))


def make_grad_counts(ctx, n: int):
    """A State whose model counts rows through its gradients (``train_rows_riding``)."""
    model = RowCounts(n)
    return dd.collective.State(model=model,
                               optimizer=torch.optim.SGD(model.parameters(), lr=1.0))


class _Calls:
    """Collective calls this process's group makes (``Group._run``), counted."""

    def __init__(self) -> None:
        self.n = 0
        self.cls = type(dd.collective.get_group())
        self.run = self.cls._run

        def counted(group, *args, **kwargs):
            self.n += 1
            return self.run(group, *args, **kwargs)

        self.cls._run = counted

    def close(self) -> None:
        self.cls._run = self.run


def train_rows_riding(state, it, pause: float = 0.0, commit_every: int = 1):
    """``train_rows`` with the counts summed as gradients by ``allreduce_gradients``,
    which carries ``synced``'s agreement and the State's commit heads: returns the
    commit resumed at, the steps, the collective calls the commits made and the steps
    whose batch came without a call of ``synced``'s own."""
    state.sync()
    resumed = state.commits
    model, opt = state.model, state.optimizer
    calls = _Calls()
    steps = commit_calls = quiet = 0
    try:
        batches = dd.collective.synced(it)
        while True:
            before = calls.n
            batch = next(batches, None)
            if batch is None:
                break
            quiet += calls.n == before
            opt.zero_grad()
            c = torch.bincount(batch["id"], minlength=model.counts.numel()).float()
            (-(model.counts * c).sum()).backward()
            dd.collective.allreduce_gradients(model, average=False)
            opt.step()
            time.sleep(pause)
            steps += 1
            if steps % commit_every == 0:
                before = calls.n
                state.commit()
                commit_calls += calls.n - before
        if steps % commit_every:
            state.commit()
    finally:
        calls.close()
    return resumed, steps, commit_calls, quiet


def final_grad_counts(state) -> tuple[int, list[float]]:
    """``final_counts`` of a ``make_grad_counts`` State."""
    state.sync()
    return state.commits, state.model.counts.tolist()
