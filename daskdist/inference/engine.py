"""One member's side of a batch-inference job: the :class:`Engine`, a per-worker resource
built once per worker on its device.

It holds the model (``model(ctx)``, built when the engine is), a feed of units read
ahead in a thread of its own (:mod:`.feed`), and a pool of threads that convert and
write outputs (:mod:`.outputs`). A job closure calls :meth:`Engine.run_unit`: it takes
the next unit whole, cuts it into ``batch_size`` views, runs ``predict`` under
``torch.inference_mode`` (its outputs written meanwhile), stages the unit's Parquet
output under its attempt and asks the scheduler to commit it. The first committer wins:
its rows are acknowledged there and the closure publishes the unit
(:meth:`~.storage.Output.publish`); a refused attempt's staging is removed. A unit
whose ``predict`` raises gives its rows back, deferred, its failure counted (the job
fails, naming the unit and the error, after ``max_worker_failures``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from daskdist import config
from daskdist.core.intervals import Interval
from daskdist.core.protocol import UnitReport
from daskdist.data.convert import concat_cols, slice_cols, to_device
from daskdist.data.sources import ChunkItem, ReadSpec
from daskdist.data.staging import CudaTransfer, DeviceStage
from daskdist.inference.feed import EPOCH, ReadUnit, UnitFeed
from daskdist.inference.outputs import UnitWriter
from daskdist.inference.units import describe, lengths_learned
from daskdist.session.scope import closure_scope_now
from daskdist.session.tokens import take_consumed

__all__ = ["Engine", "batches"]

WRITERS = 2  # threads converting and writing a member's outputs
IDLE_WAIT = 10.0  # longest a closure that found no unit waits for this worker's others


def batches(items: list[ChunkItem], size: int) -> Iterator[tuple[Any, int]]:
    """A unit's blocks cut into batches of ``size`` rows (views; a batch straddling two
    blocks concatenated), with their row counts."""
    parts: list[Any] = []
    got = 0
    for item in items:
        a = 0
        while a < item.rows:
            b = min(item.rows, a + size - got)
            parts.append(slice_cols(item.cols, a, b))
            got += b - a
            a = b
            if got == size:
                yield concat_cols(parts), got
                parts, got = [], 0
    if parts:
        yield concat_cols(parts), got


class Engine:
    """A member's model, units and writers for one job (module doc)."""

    def __init__(self, spec: Any, ctx: Any) -> None:
        self.spec = spec
        self.services = ctx.services
        if self.services is None:
            raise RuntimeError("a batch-inference engine runs on a coordinator's worker")
        self.dataset_id = spec.dataset_id
        self.device = torch.device(spec.device) if spec.device is not None else ctx.device
        self.model = spec.model(ctx.worker if ctx.worker is not None else ctx) \
            if spec.model is not None else None
        read = ReadSpec(tuple(spec.columns), spec.batch_size, False, 0, spec.batch_size,
                        spec.fill_null, False, int(config.get("data.partitions-ahead", 2)),
                        self.dataset_id, spec.name, spec.unit_rows, self.services)
        self.reader = spec.source.open(read)
        stage = None
        if self.device.type == "cuda":
            stage = DeviceStage(CudaTransfer(self.device),
                                int(config.get("data.staging-slots", 2)),
                                config.nbytes("data.staging-bytes"))
        self.to_device = self.device if self.device.type != "cpu" and stage is None else None
        self.feed = UnitFeed(self.reader, self.services, self.dataset_id, spec.name, stage,
                             on_failure=self._read_failed)
        self.pool = ThreadPoolExecutor(WRITERS, "daskdist-infer-write")
        self.row_group_rows = int(config.get("inference.row-group-rows", 65536))
        self._running = 0  # units this engine's closures are predicting now
        self._ended = threading.Condition()

    # -- one unit: a job closure's work ----------------------------------------------------
    def run_unit(self) -> dict:
        """Take the next unit, predict it, stage its output, commit and publish it (module
        doc): what happened, for the closure's result."""
        attempt = _attempt()
        unit = self.feed.take() or self._after_others()
        if unit is None:
            return {"unit": None}
        with self._ended:
            self._running += 1
        try:
            return self._run(attempt, unit)
        finally:
            with self._ended:
                self._running -= 1
                self._ended.notify_all()

    def _after_others(self) -> ReadUnit | None:
        """No unit is free now, but this worker's other closures are predicting: wait
        until one of them ends (at most ``IDLE_WAIT``), then look again. At the job's
        tail the scheduler routes its closures to the members still holding rows, and
        one that returned at once would come straight back while those units run."""
        with self._ended:
            running = self._running
            if not running:
                return None
            self._ended.wait_for(lambda: self._running < running, IDLE_WAIT)
        return self.feed.take()

    def _run(self, attempt: str, unit: ReadUnit) -> dict:
        name = describe(self.spec.source, unit.ranges)
        output = self.spec.output  # None: the output is returned in memory
        staged = output.staged(attempt) if output is not None else ""
        writer = UnitWriter(output, staged or None, self.pool, self.row_group_rows)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                for batch, n in batches(unit.items, self.spec.batch_size):
                    if self.to_device is not None:
                        batch = to_device(batch, self.to_device)
                    writer.put(self.spec.predict(self.model, batch), batch, self.spec.keep, n)
            out_rows = writer.close()
        except Exception as e:  # noqa: BLE001 - the unit failed: its rows go back, counted
            writer.abort()
            if output is not None:
                output.discard(staged)
            return self._predict_failed(attempt, name, unit, e)
        tokens = take_consumed()
        try:
            report = UnitReport(self.spec.name, attempt, tokens, staged, out_rows,
                                lengths_learned(self.spec.source, unit.ranges), name, "",
                                writer.data)
            reply = self.services.call("daskdist_infer_unit",
                                       ended={"commit": False, "why": "session ended"},
                                       report=tuple(report))
            if not reply.get("commit"):  # its rows go back, if they are still its own
                if output is not None:
                    output.discard(staged)
                self.services.release_tokens(tokens)
                return {"unit": name, "refused": reply.get("why", "")}
            if output is not None:
                output.publish(reply["record"])
        except BaseException:
            # rows this session still holds go back (committed rows stay committed: a
            # unit won and not published is the finalization's)
            with contextlib.suppress(Exception):
                self.services.release_tokens(tokens)
            raise
        return {"unit": name, "file": reply["file"], "rows": unit.rows, "out_rows": out_rows,
                "seconds": time.perf_counter() - t0}

    def _predict_failed(self, attempt: str, name: str, unit: ReadUnit,
                        e: BaseException) -> dict:
        """``predict`` (or its output's conversion) raised on a unit: its rows go back
        deferred, the failure counted against the unit's source (the lease table fails
        the job after ``max_worker_failures``), and the job hears why."""
        take_consumed()  # the unit's token: its rows are given back here, not released
        message = f"{name}: predict raised {type(e).__name__}: {e}"
        self.services.release(self.dataset_id, EPOCH, unit.ranges,
                              failure=(_source_key(name), message))
        self._report_failure(attempt, name, message)
        return {"unit": name, "failed": f"{type(e).__name__}: {e}"}

    def _read_failed(self, source: str, rows: list[Interval], message: str) -> None:
        """The feed could not read a unit (its rows went back, counted)."""
        name = describe(self.spec.source, rows)
        self._report_failure(f"read-{uuid.uuid4().hex[:8]}", name,
                             f"{name}: reading it raised {message}")

    def _report_failure(self, attempt: str, name: str, message: str) -> None:
        report = UnitReport(self.spec.name, attempt, [], "", 0, [], name, message)
        with contextlib.suppress(Exception):  # progress only: the lease table counted it
            self.services.call("daskdist_infer_unit", report=tuple(report))

    def close(self) -> None:
        """Released (the job ended) or the session ended: stop reading, give leased rows
        back, let the writes end."""
        self.feed.close()
        with self._ended:
            self._running = 0  # a closure waiting for the others returns now
            self._ended.notify_all()
        self.pool.shutdown(wait=True)


def _attempt() -> str:
    """This closure's attempt: its id and attempt number (unique across the job)."""
    scope = closure_scope_now()
    if scope is None or scope.context is None:
        return f"local-{uuid.uuid4().hex[:12]}#1"
    return f"{scope.origin}#{scope.context.attempt}"


def _source_key(name: str) -> str:
    """What the lease table counts a unit's failures against: its file or partition (a
    retry of the same rows counts again, whatever the lease around them)."""
    return name.split(", rows ", 1)[0]
