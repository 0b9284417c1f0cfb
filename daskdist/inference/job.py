"""A batch-inference job as it travels to the workers: :class:`JobSpec` (the per-worker
engine's factory, pickled once by the client and registered by the scheduler) and the
job's two closures, which the scheduler queues with the engine as their argument."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["JobSpec", "finalize", "run_unit"]


@dataclass
class JobSpec:
    """What each member's engine is built from: the job's name, its source (a
    ``data.sources.Source``), ``predict(model, batch)``, ``model(ctx)`` (or ``None``), its
    output (:class:`~.storage.Output`), the batch size, the input columns read and kept
    beside predict's, rows a unit of files covers at least, ``fill_null`` and the device
    (``None``: the worker's)."""

    name: str
    source: Any
    predict: Callable[[Any, dict], Any]
    model: Callable[[Any], Any] | None
    output: Any
    dataset_id: str  # the lease table's dataset of the source's units
    batch_size: int
    columns: tuple
    keep: tuple
    unit_rows: int
    fill_null: Any = None
    device: Any = None

    def __call__(self, ctx: Any) -> Any:
        """The engine of the worker whose input context ``ctx`` is (built once there)."""
        from daskdist.inference.engine import Engine

        return Engine(self, ctx)


def run_unit(engine: Any) -> dict:
    """A job closure: one unit, predicted, staged, committed and published."""
    return engine.run_unit()


def finalize(engine: Any) -> dict:
    """The job's finalizing closure: its manifest and ``_SUCCESS``."""
    return engine.finalize()
