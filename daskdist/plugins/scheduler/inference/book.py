"""InferBook: batch-inference jobs on the scheduler (``Coordinator.map_batches``), and
their routes.

The book drives each job; its client only starts, watches and cancels it. A job is:

- a per-worker *engine* (the model built once per worker, a reader of the source, a
  writer), registered here as a per-worker resource of the job's own owner
  (``jobs.JOB_OWNER``: released with the job, by the owners' rule below); its id is also
  the id of the lease table's dataset over the source's units (row groups, partitions),
  leased as ``"dynamic"``;
- its closures, which the book queues itself, as the group driver queues gang members
  (:meth:`InferBook.pump`): each runs one unit on a member (the tag of the engine's
  dataset routes it, at the tail, to a member still holding leased rows), up to
  ``daskdist.inference.closures-per-worker`` per member while rows are free;
- its commits (:class:`~daskdist.core.inference.JobState`, pure): a unit's attempt
  reports its staged output (``daskdist_infer_unit``); the first committer wins, and its
  rows are acknowledged in the lease table in the same step; a failed unit's rows went
  back deferred, its failure counted, and the job fails with ``dd.InputError`` once the
  lease table says the input cannot complete;
- its end: once every row is committed and published, a closure writes the manifest
  and ``_SUCCESS`` (publishing any unit whose attempt was lost after winning), then the
  engines are released on every worker. A job without an output (its outputs returned
  in memory) keeps each committed unit's output, which came with its commit, until its
  client reads it: at most ``daskdist.inference.memory-bytes``.

A job lives by its coordinator's owners' rule: it goes on while an owner that started
it (or attached to it, starting it again) is left, and is cancelled once every one of
them was dropped (:meth:`InferBook.owner_dropped`): closed, its client gone past
``client-grace``, or a keep-alive owner nobody attached to within
``keep-alive-timeout``. A client that attaches to a keep-alive owner
(``Coordinator.attach``) holds its jobs as that owner did.

Its routes are :data:`INFER_ROUTES`; what it needs of the other books it asks its
coordinator (:class:`InferenceCoordinator`). Runs on the scheduler's event loop;
imports nothing from Dask, torch or pyarrow.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Protocol

from daskdist import config
from daskdist.core import checks
from daskdist.core.inference import FINAL, FINALIZING, RUNNING, JobState
from daskdist.core.membership import Membership
from daskdist.core.protocol import ANY, OWNER, READY, SESSION, DatasetDef, Outcome, Route
from daskdist.errors import load_error
from daskdist.plugins.scheduler.inference.jobs import (
    JOB_OWNER,
    Job,
    job_def,
    job_owner,
    new_event,
    rows_of,
    unit_report,
)

logger = logging.getLogger(__name__)

KEPT_JOBS = 64  # ended jobs whose progress stays readable (the newest)


class InferenceCoordinator(Protocol):
    """What the inference book asks its coordinator (the scheduler's ``CoordinatorState``)."""

    name: str
    members: Membership  # the shared membership: the member count, a session's worker

    def define_dataset(self, dataset: DatasetDef, owner: str) -> None:
        """Define a dynamic dataset's units for ``owner`` (the lease book)."""

    def resume_dataset(self, dataset_id: str, epoch: int, acknowledged: list,
                       lengths: list | None) -> None:
        """Start ``epoch`` of a dataset with ``acknowledged`` rows (a collection's
        ``lengths`` learned first); ``ValueError`` when they do not fit it."""

    def forget_datasets(self, dataset_ids: list[str]) -> None:
        """These datasets go: their lease tables and row counts."""

    def epoch_progress(self, dataset_id: str, epoch: int) -> dict:
        """An epoch's counts in the lease table (read-only)."""

    def takes(self, dataset: str, session: str) -> bool:
        """Whether ``session`` should run a closure reading ``dataset`` now."""

    def ack_tokens(self, session: str, tokens: list) -> bool:
        """Acknowledge the rows of a session's lease tokens, all or none."""

    def add_resource(self, owner: str, rid: str, payload: bytes) -> None:
        """Register a per-worker resource of ``owner`` (the resource book)."""

    def release_resources(self, rids: list[str]) -> None:
        """Release per-worker resources here and on every worker."""

    def put_job_closure(self, cid: str, owner: str, payload: Any, tag: str | None) -> None:
        """Queue a closure of a job's own ``owner`` (``tag``: the dataset it reads)."""

    def cancel_closures(self, owner: str) -> None:
        """Cancel ``owner``'s queued closures (nobody waits for their outcomes)."""


class InferBook:
    """Batch-inference jobs, by name (module doc)."""

    def __init__(self, co: InferenceCoordinator, max_worker_failures: int) -> None:
        self.co = co
        self.max_failures = max_worker_failures
        self.jobs: OrderedDict[str, Job] = OrderedDict()

    # -- routes: the client's ----------------------------------------------------------------
    def start(self, owner: str, token: str, job: Any) -> dict:
        """Start job ``job`` (an :class:`InferenceJobDef`) for ``owner``, or attach
        ``owner`` to the one of that name running over the same output and source (it
        holds the job from then on, as the owner that started it does); its progress."""
        d = job_def(job)
        old = self.jobs.get(d.name)
        if old is not None and old.state.state not in FINAL:
            if (old.spec.output, old.spec.fingerprint) != (d.output, d.fingerprint):
                raise ValueError(f"a batch-inference job named {d.name!r} is running over "
                                 f"another source or output ({old.spec.output}); wait for "
                                 "it, cancel it, or name this one differently")
            old.state.owners.add(owner)
            return {"attached": True, **self.progress_of(old)}
        dataset = DatasetDef(*d.dataset)
        ds = checks.text(dataset.dataset_id, "daskdist_infer_start: dataset_id")
        co = self.co
        owner_of_job = job_owner(d.name)
        co.define_dataset(dataset, owner_of_job)  # its units; then what earlier runs did
        try:
            if d.lengths or d.committed:
                co.resume_dataset(ds, 0, d.committed, d.lengths)
        except Exception:  # a ledger that does not fit the source: nothing starts
            co.forget_datasets([ds])
            raise
        state = JobState(d.name, d.committed, d.units, d.out_rows, self.max_failures,
                         owners={owner})
        new = Job(d, ds, state, changed=new_event())
        gone = [self.jobs.pop(d.name)] if old is not None else []
        self.jobs[d.name] = new
        while len(self.jobs) > KEPT_JOBS and next(iter(self.jobs.values())).state.state in FINAL:
            gone.append(self.jobs.pop(next(iter(self.jobs))))
        # an ended job's lease table stays until the job is forgotten: a member's lease
        # asked just as it ended finds it (and gives its rows back with its engine)
        co.forget_datasets([g.dataset_id for g in gone])
        co.add_resource(owner_of_job, d.resource, d.engine)
        logger.info("daskdist[%s]: batch-inference job %r started (%d units committed "
                    "before)", co.name, d.name, d.units)
        self.pump(new)
        return {"attached": False, **self.progress_of(new)}

    async def progress(self, job: str, wait: float = 0.0, version: int = -1) -> dict:
        """Job ``job``'s progress (``{"state": None}`` for a job not known here); with
        ``wait``, once its state changed from ``version`` (or after ``wait`` seconds)."""
        j = self.jobs.get(checks.text(job, "daskdist_infer_progress: job"))
        if j is None:
            return {"state": None}
        wait = checks.number(wait, "daskdist_infer_progress: wait", 0.0, 3600.0)
        version = checks.integer(version, "daskdist_infer_progress: version", -1, 2**62)
        if wait and j.state.version == version and j.changed is not None:
            j.changed.clear()
            try:
                await asyncio.wait_for(j.changed.wait(), wait)
            except asyncio.TimeoutError:
                pass
        return self.progress_of(j)

    def cancel(self, owner: str, token: str, job: str) -> dict:
        """Cancel job ``job``: nothing more is committed, its queued closures are
        cancelled and its engines released (running closures finish on their workers,
        their commits refused; the output keeps what was committed, and a re-run
        resumes)."""
        j = self.jobs.get(checks.text(job, "daskdist_infer_cancel: job"))
        if j is None:
            return {"state": None}
        if j.state.state not in FINAL:
            j.state.cancel()
            self._ended(j)
        return self.progress_of(j)

    # -- routes: the job's closures' ------------------------------------------------------------
    def unit(self, session: str, report: Any) -> dict:
        """A unit an attempt ran: commit its staged output (``{"commit": True}``: its
        rows acknowledged, the attempt publishes it), or refuse it (``"why"``); a failed
        unit is counted for progress."""
        r = unit_report(report)
        j = self.jobs.get(r.job)
        if j is None:
            return {"commit": False, "why": f"no job {r.job!r}"}
        st = j.state
        member = self.co.members.members.get(session)
        address = member.address if member is not None else ""
        if r.error:
            st.unit_failed(session, r.unit, r.error, address)
            self._changed(j)
            return {"commit": False, "why": "failed"}
        rows = rows_of(r.tokens)
        why = st.refusal(session, rows)
        if why is None and not self.co.ack_tokens(session, r.tokens):
            why = "its rows are not leased to its session (fenced)"
        if why is not None:
            logger.info("daskdist[%s]: job %r refused %s of attempt %s: %s", self.co.name,
                        r.job, r.unit, r.attempt, why)
            return {"commit": False, "why": why}
        unit = st.commit(session, r.attempt, rows, r.staged, r.out_rows, r.lengths, address)
        if j.in_memory and j.memory is not None:  # its output came with the commit
            j.memory[unit.first] = r.data
            j.memory_bytes += len(r.data)
            limit = config.nbytes("inference.memory-bytes")
            if j.memory_bytes > limit:
                st.fail(f"batch-inference job {j.spec.name!r}: its output passed "
                        f"daskdist.inference.memory-bytes ({limit} bytes) on the "
                        "scheduler; give it an output= to write it to")
                self._ended(j)
        self.pump(j, committed=True)
        self._changed(j)
        return {"commit": True, "file": unit.file, "record": unit.record()}

    def outputs(self, owner: str, token: str, job: str, release: bool = False) -> dict:
        """A job's output returned in memory: its committed units' Arrow IPC streams, in
        row order (``{"outputs": None}`` for a job that writes its output, or whose
        output a client read with ``release``: the scheduler keeps it no longer)."""
        j = self.jobs.get(checks.text(job, "daskdist_infer_outputs: job"))
        if j is None or not j.in_memory or j.memory is None:
            return {"outputs": None}
        out = [j.memory[first] for first in sorted(j.memory)]
        if checks.flag(release, "daskdist_infer_outputs: release") and j.state.state in FINAL:
            j.memory, j.memory_bytes = None, 0
        return {"outputs": out}

    def plan(self, session: str, job: str) -> dict:
        """What the finalizing closure publishes: the units decided whose attempt did not
        publish them (their records)."""
        j = self.jobs.get(checks.text(job, "daskdist_infer_plan: job"))
        if j is None or j.state.state != FINALIZING:
            return {"finalize": False}
        return {"finalize": True, "orphans": [u.record() for u in j.state.orphans()]}

    def finalized(self, session: str, job: str, ok: bool, error: str = "") -> dict:
        """The finalizing closure's word: the output is complete (manifest, ``_SUCCESS``),
        or writing it failed (``error``; tried again up to ``max_worker_failures``)."""
        j = self.jobs.get(checks.text(job, "daskdist_infer_finalized: job"))
        if j is None:
            return {}
        self._finalize_ended(j, checks.flag(ok, "daskdist_infer_finalized: ok"),
                             checks.text(error, "daskdist_infer_finalized: error", 16384,
                                         empty=True))
        return {}

    # -- from the coordinator -------------------------------------------------------------------
    def closure_finished(self, o: Outcome) -> None:
        """A job closure's final outcome (the closure book routes the job owners' here)."""
        j = self.jobs.get(o.owner[len(JOB_OWNER):])
        if j is None:
            return
        if o.cid in j.finishing:
            j.finishing.discard(o.cid)
            if j.state.state == FINALIZING:  # it ended without its word: a failure
                self._finalize_ended(j, False, "the finalizing closure ended without "
                                               f"writing the output ({o.state})")
            return
        st = j.state
        st.outstanding = max(0, st.outstanding - 1)
        st.attempt_ended(f"{o.cid}#{o.attempt}", o.state == READY)
        if o.state != READY and st.state == RUNNING:
            err = load_error(o.value, o.kind)
            if st.closure_failed(f"{type(err).__name__}: {err}"):
                self._ended(j)
                return
        self.pump(j)

    def session_ended(self, session: str) -> None:
        """A worker session ended: its commits are refused from now on, what it won and
        had not published is the finalization's, and its leased rows are free again."""
        for j in list(self.jobs.values()):
            if j.state.state in FINAL:
                continue
            j.state.session_ended(session)
            self.pump(j)

    def owner_dropped(self, owner: str) -> None:
        """An owner of the coordinator was dropped (closed, its client gone past its
        grace, a keep-alive owner nobody attached to): the jobs it held and no other
        owner holds are cancelled (the output keeps what was committed)."""
        for j in list(self.jobs.values()):
            if j.state.owner_gone(owner):
                logger.info("daskdist[%s]: job %r: its last owner %s was dropped; cancelled",
                            self.co.name, j.spec.name, owner)
                self._ended(j)

    def close(self) -> None:
        """The coordinator closes: every waiter returns."""
        for j in self.jobs.values():
            if j.changed is not None:
                j.changed.set()

    # -- driving a job -------------------------------------------------------------------------
    def pump(self, j: Job, committed: bool = False) -> None:
        """Queue what the job needs now: more unit closures while rows are free, the
        finalizing closure once every row is committed; fail it when its input cannot
        complete."""
        st = j.state
        if st.state != RUNNING:
            return
        co = self.co
        p = co.epoch_progress(j.dataset_id, 0)
        if p.get("failed"):
            st.fail(f"batch-inference job {j.spec.name!r}: {p['failed']}")
            self._ended(j)
            return
        if p.get("complete") or (p.get("known") and p.get("total") == 0):
            if st.ready_to_finalize(True):
                st.begin_finalize()
                if j.in_memory:  # nothing to write: every unit came with its commit
                    self._finalize_ended(j, True, "")
                else:
                    self._queue_finalize(j)
                self._changed(j)
            return
        # free (or deferred) rows, or none leased: a closure may lease; else only members
        # holding leased rows can make progress, and the queue routes closures to them
        leaseable = co.takes(j.dataset_id, "")
        per = int(config.get("inference.closures-per-worker", 2))
        n = st.top_up(max(1, len(co.members)) * max(1, per), leaseable, committed)
        for _ in range(n):
            st.outstanding += 1
            co.put_job_closure(f"{j.owner}-{next(j.seq)}", j.owner, j.spec.run, j.dataset_id)

    def _queue_finalize(self, j: Job) -> None:
        cid = f"{j.owner}-f{next(j.seq)}"
        j.finishing.add(cid)
        self.co.put_job_closure(cid, j.owner, j.spec.finish, None)

    def _finalize_ended(self, j: Job, ok: bool, error: str) -> None:
        st = j.state
        if st.finalized(ok, error):
            logger.warning("daskdist[%s]: job %r: finalizing its output failed (%s); "
                           "trying again", self.co.name, j.spec.name, error)
            self._queue_finalize(j)
        elif st.state in FINAL:
            self._ended(j)
        self._changed(j)

    def _ended(self, j: Job) -> None:
        """The job ended: its queued closures are cancelled and its engines released
        on every worker (with its lease table)."""
        if j.state.error:
            logger.warning("daskdist[%s]: %s", self.co.name, j.state.error)
        self.co.cancel_closures(j.owner)
        self.co.release_resources([j.spec.resource])
        self._changed(j)

    def _changed(self, j: Job) -> None:
        j.state.version += 1
        if j.changed is not None:
            j.changed.set()

    # -- what is shown -------------------------------------------------------------------------
    def progress_of(self, j: Job) -> dict:
        st = j.state
        if st.state not in FINAL:  # an ended job's table may be gone: its last counts
            j.counts = self.co.epoch_progress(j.dataset_id, 0)
        p = j.counts
        rps, ups = st.rates()
        units0, rows0, _ = st.resumed
        return {
            "name": j.spec.name, "output": j.spec.output, "state": st.state,
            "version": st.version, "error": st.error,
            "units": st.units, "rows": st.rows.size, "out_rows": st.out_rows,
            "total": p.get("total", st.rows.size), "known": p.get("known", True),
            "leased": p.get("leased", 0), "resumed_units": units0, "resumed_rows": rows0,
            "rows_per_second": rps, "units_per_second": ups,
            "workers": st.per_worker(), "errors": [list(e) for e in st.errors],
        }

    def report(self) -> list[dict]:
        """Every job's progress, newest last (the dashboard's and the metrics')."""
        return [self.progress_of(j) for j in self.jobs.values()]

    def summary(self) -> dict:
        """Per job: its state, units and rows committed, rows a second (``status()``)."""
        out = {}
        for name, j in self.jobs.items():
            rps, _ = j.state.rates()
            out[name] = {"state": j.state.state, "units": j.state.units,
                         "rows": j.state.rows.size, "rows_per_second": rps}
        return out


# The book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler): a message's name leads here, beside its method. A job
# closure's call from an ended session gets SESSION_ENDED (its services give the call's
# "nothing": a commit refused).
INFER_ROUTES = {
    "daskdist_infer_start": Route(InferBook.start, caller=OWNER),
    "daskdist_infer_progress": Route(InferBook.progress, caller=ANY),
    "daskdist_infer_cancel": Route(InferBook.cancel, caller=OWNER),
    "daskdist_infer_outputs": Route(InferBook.outputs, caller=OWNER),
    "daskdist_infer_unit": Route(InferBook.unit, caller=SESSION),
    "daskdist_infer_plan": Route(InferBook.plan, caller=SESSION),
    "daskdist_infer_finalized": Route(InferBook.finalized, caller=SESSION),
}
