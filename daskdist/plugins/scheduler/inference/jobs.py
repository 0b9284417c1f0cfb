"""A batch-inference job as the scheduler's inference book holds it: its owner's name on
the queue (``JOB_OWNER``), its definition, its commits and its waiters (:class:`Job`),
and its two messages checked as they arrive (:func:`job_def`, :func:`unit_report`).

Pure but for the job's ``asyncio.Event``; imports nothing from Dask, torch or pyarrow.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from daskdist.core import checks, protocol
from daskdist.core.inference import JobState
from daskdist.core.intervals import Interval
from daskdist.core.leases.table import group_tokens
from daskdist.core.protocol import DatasetDef, InferenceJobDef, UnitReport

JOB_OWNER = "__infer__/"  # + the job's name: the owner of a job's closures and engine


def job_owner(name: str) -> str:
    return JOB_OWNER + name


@dataclass
class Job:
    """One job: its definition, its engine's id (the lease table's dataset), its commits."""

    spec: InferenceJobDef
    dataset_id: str
    state: JobState
    seq: Any = field(default_factory=itertools.count)
    finishing: set[str] = field(default_factory=set)  # its finalizing closures' ids
    changed: asyncio.Event | None = None  # set at every change (progress long-polls)
    counts: dict = field(default_factory=dict)  # its lease table's, as last read
    # a job without an output (``output=""``): its committed units' outputs, by first
    # row, until a client read them (then None)
    memory: dict[int, bytes] | None = field(default_factory=dict)
    memory_bytes: int = 0

    @property
    def in_memory(self) -> bool:
        return not self.spec.output

    @property
    def owner(self) -> str:
        return job_owner(self.spec.name)


def new_event() -> asyncio.Event | None:
    """A job's change event (``None`` when driven without an event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # driven without an event loop (the tests' direct calls)
        return None
    return asyncio.Event()


def job_def(value: Any) -> InferenceJobDef:
    """A ``daskdist_infer_start``'s job, checked (the error names the field)."""
    op = "daskdist_infer_start"
    d = checks.named(value, f"{op}: job", InferenceJobDef)
    checks.text(d.name, f"{op}: name")
    checks.text(d.output, f"{op}: output", 4096, empty=True)  # "": returned in memory
    checks.text(d.fingerprint, f"{op}: fingerprint", 4096)
    checks.record(d.dataset, f"{op}: dataset", len(DatasetDef._fields))
    checks.text(d.resource, f"{op}: resource")
    if not isinstance(d.engine, bytes):
        raise TypeError(f"{op}: engine must be bytes, got {type(d.engine).__name__}")
    protocol.payload(d.run, f"{op}: run")
    protocol.payload(d.finish, f"{op}: finish")
    committed = checks.pairs(d.committed, f"{op}: committed", checks.MAX_RANGES)
    lengths = checks.optional(checks.pairs, d.lengths, f"{op}: lengths", checks.MAX_RUNS, -1)
    return d._replace(committed=committed, lengths=lengths,
                      units=checks.integer(d.units, f"{op}: units", 0, checks.MAX_ROWS),
                      out_rows=checks.integer(d.out_rows, f"{op}: out_rows", 0,
                                              checks.MAX_ROWS))


def unit_report(value: Any) -> UnitReport:
    """A ``daskdist_infer_unit``'s report, checked (the error names the field)."""
    op = "daskdist_infer_unit"
    r = checks.named(value, f"{op}: report", UnitReport)
    lengths = checks.pairs(r.lengths, f"{op}: lengths", checks.MAX_RANGES)
    return r._replace(
        job=checks.text(r.job, f"{op}: job"),
        attempt=checks.text(r.attempt, f"{op}: attempt"),
        tokens=list(checks.items(r.tokens, f"{op}: tokens")),
        staged=checks.text(r.staged, f"{op}: staged", 4096, empty=True),
        out_rows=checks.integer(r.out_rows, f"{op}: out_rows", 0, checks.MAX_ROWS),
        lengths=[(int(p), int(n)) for p, n in lengths],
        unit=checks.text(r.unit, f"{op}: unit", 4096, empty=True),
        error=checks.text(r.error, f"{op}: error", 16384, empty=True),
        data=_data(r.data, f"{op}: data"))


def _data(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"{what} must be bytes, got {type(value).__name__}")
    return value


def rows_of(tokens: list) -> list[Interval]:
    """The rows of a unit's lease tokens."""
    return [iv for ranges in group_tokens(tokens).values() for iv in ranges]
