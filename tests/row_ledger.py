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
