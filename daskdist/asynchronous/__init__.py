"""One model trained asynchronously on the closure queue (SPEC §2.8):
``coord.async_model(model=, optimizer=, outer=, max_staleness=)``.

The outer optimizers a holder applies deltas with: :class:`Nesterov` (DiLoCo's, the
default), :class:`Average`, :class:`DelayedNesterov` (Asynchronous Local-SGD's) and
:class:`Mixing` (FedAsync's);
:class:`OuterOptimizer` is the seam for another. The worker's side (replicas, the
holder, its standby) is imported where it runs: importing this package loads no torch.
"""

from __future__ import annotations

from daskdist.asynchronous.outer import (
    Average,
    DelayedNesterov,
    Mixing,
    Nesterov,
    OuterOptimizer,
)

__all__ = ["Average", "DelayedNesterov", "Mixing", "Nesterov", "OuterOptimizer"]
