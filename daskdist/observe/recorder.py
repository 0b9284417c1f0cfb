"""A gang member's measurements leave the worker (SPEC §5.1): the recorder of each gang
closure run (:func:`gang_scope`), its windows sent to the scheduler once a window
(:class:`WindowReporter`), and the stack of its thread on the scheduler's request
(:func:`gang_stack`).

Threads: :func:`gang_scope` runs in the gang closure's thread (it records there);
:class:`WindowReporter` and :func:`gang_stack` run on the worker's event loop, which a
blocked closure does not block, so a hung rank still reports windows without steps and
answers for its stack. Windows travel on the worker's batched stream to the scheduler
(``daskdist-rank-window``: no round trip, beside Dask's own messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from distributed.utils import sync

from daskdist import config
from daskdist.core.protocol import RankWindow, is_session_ended
from daskdist.observe import phases, stacks
from daskdist.observe.steptimes import WindowSum
from daskdist.session.scope import origin_of

logger = logging.getLogger(__name__)

OP = "daskdist-rank-window"


def _run_of(cid: str) -> tuple[str, int, int]:
    """A gang member closure's gang id, generation and rank (``core.gang.member_cid``:
    ``<gang>@<generation>#<rank>``)."""
    gang = origin_of(cid)
    generation, _, rank = cid.rpartition("@")[2].partition("#")
    return gang, int(generation), int(rank)


class WindowReporter:
    """Sends a recorder's closed windows to the scheduler just after each window ends,
    and the last (``ended``) once the closure returned. The worker's event loop owns it."""

    def __init__(self, worker: Any, rec: phases.Recorder) -> None:
        self.worker = worker
        self.rec = rec
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        """Until :meth:`stop`: wake a little after each window's end (its last steps are
        in then), send what closed."""
        rec = self.rec
        while True:
            now = rec.wall()
            await asyncio.sleep(rec.window - now % rec.window + min(0.05, rec.window / 20))
            self._send(rec.roll(), ended=False)

    def stop(self) -> None:
        """The closure returned: the open window goes too, marked as the last."""
        if self.task is not None:
            self.task.cancel()
        self._send(self.rec.roll(final=True), ended=True)

    def _send(self, windows: list[WindowSum], ended: bool) -> None:
        rec = self.rec
        for i, w in enumerate(windows):
            msg = RankWindow(rec.session, rec.gang, rec.generation, rec.rank, w.index,
                             w.steps, w.seconds, list(w.phases), w.rows,
                             sorted(w.hist.items()), rec.total, rec.since_step(),
                             [w.computing, w.reading], ended and i == len(windows) - 1)
            self.worker.batched_send({"op": OP, "name": rec.name, "window": tuple(msg)})


@contextlib.contextmanager
def gang_scope(runner: Any, cid: str, session: Any) -> Iterator[None]:
    """Record the gang member closure ``cid`` run in this thread by ``runner`` (a
    :class:`~daskdist.plugins.worker.runner.ClosureRunner`) under ``session``, when the
    scheduler asked for windows (``runner.observe``: their length, 0 for none)."""
    window = getattr(runner, "observe", 0.0) or 0.0
    if not window > 0:
        yield
        return
    worker = runner.worker
    gang, generation, rank = _run_of(cid)
    # the scheduler waits this long for each member's stack, then answers
    timeout = 2 * config.seconds("observe.stacks-timeout") + 5.0

    def ask_stuck() -> str:
        reply = sync(worker.loop, worker.scheduler.daskdist_rank_stuck, name=runner.name,
                     session=session.id, callback_timeout=timeout)
        return "" if is_session_ended(reply) or not reply else f"; {reply}"

    rec = phases.Recorder(window, runner.name, session.id, gang, generation, rank,
                          ask_stuck=ask_stuck)
    with phases.recording(rec) as recording:
        if recording is None:  # another gang records in this process
            yield
            return
        reporter = WindowReporter(worker, rec)
        worker.loop.add_callback(reporter.start)
        try:
            yield
        finally:
            try:
                worker.loop.add_callback(reporter.stop)
            except RuntimeError:  # the worker's loop is closed: the worker is going away
                pass


def gang_stack(name: str) -> dict | None:
    """The stack of the gang closure coordinator ``name`` runs here (RPC handler, on the
    event loop): ``{"session", "rank", "stack", "where", "waiting"}``, ``None`` when none
    runs. ``waiting``: it is inside a collective call, a commit or a data wait."""
    rec = phases.active()
    if rec is None or rec.name != name:
        return None
    got = stacks.thread_stack(rec.thread)
    if got is None:
        return None
    stack, where = got
    return {"session": rec.session, "rank": rec.rank, "stack": stack, "where": where,
            "waiting": rec.open_phase is not None}


__all__ = ["WindowReporter", "gang_scope", "gang_stack"]
