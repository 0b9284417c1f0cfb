"""What an asynchronous model is made of, as the client pickles it once: the model
factory, the inner optimizer's, the outer optimizer and the staleness bound.

Loads no torch: the client makes these, the workers unpickle them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daskdist.asynchronous.outer import OuterOptimizer


@dataclass(frozen=True)
class AsyncSpec:
    """One asynchronously trained model: ``model()`` builds the module (on every worker
    and for the global copy), ``optimizer(params)`` a replica's inner optimizer,
    ``outer`` applies a delta on the holder; a delta whose staleness (versions applied
    since its pull) exceeds ``max_staleness`` is refused."""

    model_id: str
    model: Callable[[], Any]
    optimizer: Callable[[Any], Any]
    outer: OuterOptimizer
    max_staleness: int
