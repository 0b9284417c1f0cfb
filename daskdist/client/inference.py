"""Batch inference from the client (SPEC §7): ``Coordinator.map_batches`` and the job
handle it returns.

The client checks the arguments before anything runs (``batch_size``, ``keep``'s
columns, a writable ``output``), prepares the output (what earlier runs of the job
committed, read from its ledger and made consistent; a different source under the same
name refused with ``dd.InputError``; ``overwrite=True`` starts over), registers nothing
itself and hands the job to the scheduler plugin, which drives it
(``plugins/scheduler/inference/``). The :class:`InferenceJob` handle only watches and
cancels; its result is a lazy dask DataFrame over the committed output.
:class:`BatchInference` is the Coordinator's half that starts a job; the job's calls
reach the scheduler through a :class:`Channel` of the Coordinator's calls.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle

from daskdist import config
from daskdist.core.protocol import InferenceJobDef, ResourceRef, ResourceSpec
from daskdist.errors import CancelledError, InputError

__all__ = ["BatchInference", "Channel", "InferenceJob", "map_batches"]

POLL = 2.0  # longest one progress long-poll waits on the scheduler


@dataclass(frozen=True)
class Channel:
    """How the job reaches the scheduler: the Coordinator's plain call and its call as
    an owner (its token), each ``(op, call_timeout=None, **kwargs) -> reply``."""

    call: Callable[..., Any]
    owned: Callable[..., Any]


def _positive(value: Any, what: str) -> int:
    n = getattr(value, "__index__", None)
    if isinstance(value, bool) or n is None or n() < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return n()


def map_batches(channel: Channel, predict: Callable, source: Any, *, output: str | None,
                model: Callable | None = None, batch_size: int = 256,
                keep: Sequence[Any] | None = None, name: str | None = None,
                columns: Sequence[Any] | None = None, overwrite: bool = False,
                unit_rows: int | None = None, fill_null: Any = None, device: Any = None,
                storage_options: dict | None = None) -> InferenceJob:
    """Start (or resume, or attach to) a batch-inference job: see
    ``Coordinator.map_batches``."""
    from distributed.worker import dumps_function

    from daskdist.core.leases.units import unit_runs
    from daskdist.data.sources import as_source
    from daskdist.inference.job import JobSpec, finalize, run_unit
    from daskdist.inference.storage import Output, Resume

    if not callable(predict):
        raise TypeError(f"predict must be callable as predict(model, batch), got {predict!r}")
    if model is not None and not callable(model):
        raise TypeError(f"model must be callable as model(ctx) (or None), got {model!r}")
    batch_size = _positive(batch_size, "batch_size")
    unit_rows = _positive(unit_rows if unit_rows is not None
                          else config.integer("inference.unit-rows"), "unit_rows")
    keep = list(keep or [])
    src = as_source(source)  # files or a collection: TypeError naming anything else
    known = list(src.columns)
    unknown = [c for c in [*keep, *(columns or [])] if c not in known]
    if unknown:
        raise ValueError(f"column(s) {unknown} of keep=/columns= are not columns of "
                         f"{src.what}: {known}")
    read = list(columns) + [k for k in keep if k not in columns] if columns else known
    if columns and getattr(src, "num_partitions", None) is not None:
        src = as_source(source, read)  # a frame's projection, pushed into its graph
    out = None if output is None else Output(output, storage_options)
    url = out.url if out is not None else ""  # "": the output returned in memory
    if out is not None:
        out.check_writable()  # ValueError naming the output
    if name is None:  # an output's job resumes by its URL; one in memory is new
        key = uuid.uuid5(uuid.NAMESPACE_URL, url) if url else uuid.uuid4()
        name = f"infer-{key.hex[:12]}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    fingerprint = src.fingerprint()
    running = channel.call("daskdist_infer_progress", job=name)
    if running.get("state") in ("running", "finalizing"):
        if running["output"] != url:
            raise ValueError(f"a batch-inference job named {name!r} is running over output "
                             f"{running['output']!r}; name this one differently")
        if overwrite:
            raise ValueError(f"batch-inference job {name!r} is running: cancel it before "
                             "starting it over (overwrite=True)")
        info = channel.owned("daskdist_infer_start", job=tuple(_definition(
            name, out, fingerprint, src, None, None, None, None)))
        return InferenceJob(channel, name, out, info)
    done = _prepare(out, name, fingerprint, src.what, overwrite) if out is not None \
        else Resume()
    if done.complete:
        return InferenceJob(channel, name, out, _completed(name, out, done))
    lengths = None
    if getattr(src, "num_partitions", None) is not None and src.lengths is None:
        lengths = unit_runs(done.lengths.get(p, -1) for p in range(src.num_partitions))
    rid = f"infer-{uuid.uuid4().hex[:12]}"  # the engine's id; its lease dataset's + "-input"
    spec = JobSpec(name, src, predict, model, out, f"{rid}-input", batch_size, tuple(read),
                   tuple(keep), unit_rows, fill_null, device)
    try:
        engine = cloudpickle.dumps(ResourceSpec("dataset", spec, None))
    except Exception as e:
        raise TypeError(f"map_batches: predict, model or the source cannot be pickled: "
                        f"{e}") from e
    payloads = ([dumps_function(run_unit),
                 cloudpickle.dumps(((ResourceRef(rid, "dataset"),), {}))],
                [dumps_function(finalize), cloudpickle.dumps(((out, name), {}))])
    job = _definition(name, out, fingerprint, src, rid, engine, payloads, done, lengths)
    info = channel.owned("daskdist_infer_start", job=tuple(job))
    return InferenceJob(channel, name, out, info)


def _definition(name: str, out: Any, fingerprint: str, src: Any, rid: str | None,
                engine: bytes | None, payloads: tuple | None, done: Any,
                lengths: list | None = None) -> InferenceJobDef:
    """The job's definition for the scheduler (only its identity when attaching to the
    job running under ``name``: the scheduler keeps the one it has)."""
    rid = rid or "attach"
    dataset = src.definition(f"{rid}-input", name, 0, False)
    run, finish = payloads if payloads is not None else ([b"", None], [b"", None])
    return InferenceJobDef(
        name, out.url if out is not None else "", fingerprint, tuple(dataset), rid,
        engine or b"", run, finish,
        [] if done is None else [list(r) for r in done.committed],
        None if not lengths else [list(r) for r in lengths],
        0 if done is None else done.units, 0 if done is None else done.out_rows)


def _prepare(out: Any, name: str, fingerprint: str, what: str, overwrite: bool) -> Any:
    """The output made ready for a run of job ``name``: its ledger read and made
    consistent (a resume), or a new job's record (``overwrite``: the old job's files
    removed first). What earlier runs committed (a ``storage.Resume``)."""
    from daskdist.inference.storage import Resume

    job = out.job()
    if job is not None and overwrite:
        out.clear()
        job = None
    if job is None:
        foreign = out.foreign()
        if foreign:
            raise ValueError(f"output {out.url!r} holds files that are not a batch-inference "
                             f"job's ({foreign[:5]}); readers of it would mix them in: give "
                             "an empty or new directory")
        out.start({"name": name, "fingerprint": fingerprint, "source": what})
        return Resume()
    if job.get("name") != name:
        raise ValueError(f"output {out.url!r} holds the output of job {job.get('name')!r}; "
                         f"name this job so to resume it, or pass overwrite=True")
    if job.get("fingerprint") != fingerprint:
        raise InputError(f"job {name!r}: output {out.url!r} holds the output of another "
                         f"source ({job.get('source')}), not of {what}; a different source "
                         "needs another name and output, or overwrite=True to start over")
    return out.resume()


def _completed(name: str, out: Any, done: Any) -> dict:
    """The progress of a job whose output is complete already (nothing runs)."""
    return {"name": name, "output": out.url, "state": "complete", "version": 0,
            "error": None, "units": done.units, "rows": done.rows, "out_rows": done.out_rows,
            "total": done.rows, "known": True, "leased": 0, "resumed_units": done.units,
            "resumed_rows": done.rows, "rows_per_second": 0.0, "units_per_second": 0.0,
            "workers": [], "errors": [], "attached": False}


class BatchInference:
    """``Coordinator.map_batches``: a half of ``Coordinator`` (as ``JobLife`` is); the
    class using it has the Coordinator's calls to the scheduler."""

    _call: Callable[..., Any]
    _owned: Callable[..., Any]
    _check_open: Callable[[], None]

    def map_batches(self, predict: Callable[[Any, dict], Any], source: Any, *,
                    output: str | None,
                    model: Callable[[Any], Any] | None = None, batch_size: int = 256,
                    keep: list | None = None, name: str | None = None,
                    **options: Any) -> InferenceJob:
        """Run ``predict(model, batch)`` over every row of ``source`` on the members and
        write its output to ``output`` exactly once (SPEC §7): a Parquet dataset on any
        fsspec URL, committed unit by unit (staged per attempt, first committer wins),
        with a manifest and ``_SUCCESS`` at the end. Returns the job
        (:class:`InferenceJob`): ``progress(bar=True)``, ``result()`` (a lazy dask
        DataFrame over the output), ``cancel()``.

        ``source`` is what ``distribute_dataset`` takes (files, a dask DataFrame, a dict
        of dask Arrays); ``batch`` is a dict of tensors as it yields them. ``model(ctx)``
        is built once per worker, on its device. ``predict`` returns a dict of arrays or
        tensors, or a DataFrame, with any number of rows; ``keep`` input columns are
        copied beside it, row for row. The scheduler plugin drives the job, held by this
        coordinator's owner as its closures are: it goes on while the client is away
        (``client-grace``; a ``keep_alive=True`` coordinator's until
        ``keep-alive-timeout`` with nobody attaching) and is cancelled once every owner
        holding it closed. The same call (same ``name`` and ``output``) attaches to the
        job while it runs (from an attached Coordinator too) and, on any cluster,
        resumes it: committed units are neither read nor computed again; another source
        under the same name raises ``dd.InputError`` (``overwrite=True`` starts over).
        ``output=None`` returns a small output in memory instead (kept on the scheduler,
        at most ``daskdist.inference.memory-bytes``; no resume).
        ``options``: ``columns`` (the input columns read), ``overwrite``, ``unit_rows``
        (rows one unit of files covers at least: an output file each),
        ``fill_null``, ``device``, ``storage_options`` (fsspec's).
        """
        self._check_open()
        return map_batches(Channel(self._call, self._owned), predict, source, output=output,
                           model=model, batch_size=batch_size, keep=keep, name=name,
                           **options)


class InferenceJob:
    """A batch-inference job (``Coordinator.map_batches``): driven by the scheduler
    plugin; this handle watches it (:meth:`progress`, :meth:`wait`), reads its output
    (:meth:`result`, :meth:`files`) and cancels it.

    ``resumed`` is whether this run continues earlier ones (units they committed are
    neither read nor computed again); ``attached``, whether the job was running already
    (started by another call, or client) and this handle joined it."""

    def __init__(self, channel: Channel, name: str, output: Any, info: dict) -> None:
        self._channel = channel
        self.name = name
        self.output = output.url if output is not None else None  # None: in memory
        self._out = output
        self._last = dict(info)
        self.attached = bool(info.get("attached"))
        self.resumed = bool(info.get("resumed_units"))
        self._bar: Any = None
        self._kept: Any = None  # an output returned in memory, once read (a pandas frame)

    # -- watching ------------------------------------------------------------------------
    def _fetch(self, wait: float = 0.0) -> dict:
        if self._last.get("state") in ("complete", "failed", "cancelled"):
            return self._last
        p = self._channel.call("daskdist_infer_progress",
                               call_timeout=wait + 60 if wait else None, job=self.name,
                               wait=float(wait), version=int(self._last.get("version", -1)))
        if p.get("state") is None:
            raise RuntimeError(f"batch-inference job {self.name!r} is not known to the "
                               "scheduler any more (it restarted?): call map_batches again "
                               "with the same name and output to resume it")
        self._last = p
        return p

    @property
    def state(self) -> str:
        """``"running"``, ``"finalizing"``, ``"complete"``, ``"failed"`` or ``"cancelled"``."""
        return self._fetch()["state"]

    def done(self) -> bool:
        return self.state in ("complete", "failed", "cancelled")

    def progress(self, bar: bool = False) -> dict:
        """Units and rows committed (this run's and earlier runs'), of the input's total
        (``known`` False while a lazy frame's lengths are learned), output rows, rows and
        units a second, per worker (``workers``: address, units, rows, rows/s), the
        newest unit errors. ``bar=True`` also shows it on a ``tqdm.auto`` bar. Raises
        ``dd.InputError`` once the job failed."""
        p = self._fetch()
        if bar:
            self._show(p)
        if p["state"] == "failed":
            raise InputError(p["error"] or f"batch-inference job {self.name!r} failed")
        return p

    def _show(self, p: dict) -> None:
        from tqdm.auto import tqdm

        if self._bar is None:
            self._bar = tqdm(total=p["total"] or None, desc=self.name, unit="row",
                             unit_scale=True)
        t = self._bar
        if p["total"] and t.total != p["total"]:
            t.total = p["total"]
        t.update(p["rows"] - t.n)
        t.set_postfix(units=p["units"], rows_s=f"{p['rows_per_second']:.0f}",
                      workers=len(p["workers"]), refresh=False)
        if p["state"] in ("complete", "failed", "cancelled"):
            t.close()

    def wait(self, timeout: float | None = None) -> dict:
        """Wait until the job ended (``TimeoutError`` after ``timeout`` seconds): its
        last progress."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            p = self._fetch()
            if p["state"] in ("complete", "failed", "cancelled"):
                return p
            left = POLL if deadline is None else min(POLL, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"batch-inference job {self.name!r} is still {p['state']} "
                                   f"after {timeout} s ({p['rows']} rows committed)")
            self._fetch(wait=left)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the job, then a lazy dask DataFrame over its committed output (the
        files its manifest lists). Raises ``dd.InputError`` if it failed,
        ``dd.CancelledError`` if it was cancelled."""
        import dask.dataframe as ddf

        p = self.wait(timeout)
        if p["state"] == "failed":
            raise InputError(p["error"] or f"batch-inference job {self.name!r} failed")
        if p["state"] == "cancelled":
            raise CancelledError(p["error"] or f"batch-inference job {self.name!r} was "
                                 "cancelled")
        import pandas as pd

        if self._out is None:  # returned in memory: each committed unit's output once
            return ddf.from_pandas(self._collect(), npartitions=1)
        files = self.files()
        if not files:  # an empty input: an empty frame
            return ddf.from_pandas(pd.DataFrame(), npartitions=1)
        return ddf.read_parquet(files, storage_options=self._out.storage_options or None)

    def _collect(self) -> Any:
        """A job's output returned in memory, as one pandas DataFrame (row order)."""
        import pandas as pd
        import pyarrow as pa

        from daskdist.inference.outputs import from_ipc

        if self._kept is not None:
            return self._kept
        reply = self._channel.owned("daskdist_infer_outputs", job=self.name, release=True)
        if reply.get("outputs") is None:
            raise RuntimeError(f"batch-inference job {self.name!r}'s output is not on the "
                               "scheduler any more (read by another client, or the "
                               "scheduler restarted): run the job again")
        tables = [from_ipc(data) for data in reply["outputs"]]
        self._kept = (pa.concat_tables(tables, promote_options="permissive").to_pandas()
                      if tables else pd.DataFrame())
        return self._kept

    def files(self) -> list[str]:
        """The committed units' files, in row order: the manifest's once the job
        completed, else those its ledger holds now."""
        from daskdist.inference.storage import manifest_files

        if self._out is None:  # returned in memory: no file
            return []
        if self._fetch()["state"] == "complete":
            return manifest_files(self._out.url, self._out.storage_options)
        return [self._out.url_of(r["file"]) for r in self._out.records()]

    def cancel(self) -> None:
        """Cancel the job: nothing more is committed; what was stays, and the same call
        again resumes it."""
        if self._last.get("state") in ("complete", "failed", "cancelled"):
            return
        self._last = self._channel.owned("daskdist_infer_cancel", job=self.name)

    def __repr__(self) -> str:
        p = self._last
        return (f"<InferenceJob {self.name!r} {p.get('state')}: {p.get('units', 0)} units, "
                f"{p.get('rows', 0)} rows committed, output {self.output!r}>")
