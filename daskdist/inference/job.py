"""A batch-inference job as it travels to the workers: :class:`JobSpec` (the per-worker
engine's factory, pickled once by the client and registered by the scheduler) and the
job's two closures, which the scheduler queues: :func:`run_unit`, with the engine as its
argument, and :func:`finalize`, with the output (no model is built to finalize)."""

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


def finalize(output: Any, name: str) -> dict:
    """The job's finalizing closure (Hadoop's job commit): publish the units whose
    attempts were lost after winning, then the manifest and ``_SUCCESS`` of ``output``;
    the scheduler hears how it went (and tries again, then fails the job)."""
    from daskdist.session.scope import session_services

    services = session_services()
    plan = services.call("daskdist_infer_plan", ended={"finalize": False}, job=name)
    if not plan.get("finalize"):
        return {"finalized": False}
    try:
        manifest = output.finalize(plan["orphans"])
    except Exception as e:  # noqa: BLE001 - the scheduler's to judge: again, or the job fails
        services.call("daskdist_infer_finalized", ended={}, job=name, ok=False,
                      error=f"{type(e).__name__}: {e}")
        return {"finalized": False}
    services.call("daskdist_infer_finalized", ended={}, job=name, ok=True)
    return {"finalized": True, "files": len(manifest["files"])}
