"""PreemptionNotice: SIGTERM on a worker process is a graceful leave (SPEC §4.3).

Slurm (``scancel``, ``--signal=TERM@60``) and cloud spot reclaims send SIGTERM 30 s to
2 min before the kill. Left to Python's default, the worker dies like a SIGKILLed one:
its closures count as failures and its gang re-forms after a crash. Instead, the
worker leaves the way a retirement does:

1. Its deadline (now + grace) goes to the worker's deadline watch (:mod:`.deadlines`:
   closures see it as ``ctx.preemption``). The worker's status becomes
   ``closing_gracefully`` at once, on the worker and (by Dask's status message) on the
   scheduler: every coordinator's scheduler side drains its session (no new closures),
   and a gang member leaves its group at its next commit (a membership change, not a
   loss), where a State with ``checkpoint_to`` writes a just-in-time checkpoint when
   the write fits before the deadline (``collective/state/deadline.py``).
2. Closures received and not started go back to the scheduler now, unstarted.
3. The closures running here finish, up to the grace deadline (a gang member's ends at
   its next commit); the scheduler then moves this worker's Dask data elsewhere
   (``retire_workers``).
4. The worker closes with its nanny (no restart: the machine is going away); each
   coordinator plugin's teardown reports its last results and which closures started,
   so the scheduler counts nothing as lost.

``daskdist.preemption.notice: false`` leaves SIGTERM to Python (and to the user's own
handler). Every wait has an end: ``daskdist.preemption.grace`` (25 s) from the notice,
a watchdog thread ends the process whatever is still running. A second SIGTERM, or one that comes
while the worker is already closing, takes Python's default action (the process ends
at once), as Dask's own CLI does for a repeated signal.

Threads: the signal handler (main thread) only hands the notice to the worker's event
loop, which runs the leave and, until then, takes SIGTERM back from a handler installed
after ours once a second; the watchdog is a daemon timer thread.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from distributed.core import Status

from daskdist import config
from daskdist.core.protocol import Preemption
from daskdist.plugins.worker import deadlines

logger = logging.getLogger(__name__)

_ATTR = "_daskdist_preemption"
_OPEN = (Status.running, Status.paused)


class PreemptionNotice:
    """This worker process's SIGTERM handler (one per process, see :func:`install`)."""

    def __init__(self, worker: Any, runners: Callable[[], list]) -> None:
        self.worker = worker
        self.runners = runners  # the ClosureRunners of this worker's coordinators now
        self.loop = asyncio.get_running_loop()
        self.noticed: float | None = None  # time.monotonic() of the notice
        self.left = asyncio.Event()  # set when the leave finished (the worker closed)
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._keeper = asyncio.ensure_future(self._keep())

    async def _keep(self) -> None:
        """Take SIGTERM back from a handler installed after this one: ``dask worker
        --no-nanny`` installs its own (closing the worker at once) once the worker has
        started, which may be after this plugin's setup. Ends at the notice or at
        :meth:`uninstall`."""
        while self.noticed is None:
            await asyncio.sleep(1.0)
            current = signal.getsignal(signal.SIGTERM)
            if self.noticed is None and current != self._on_signal:
                logger.debug("daskdist: SIGTERM handler %r replaced ours: taken back",
                             current)
                self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def uninstall(self) -> None:
        """Put back the handler this one replaced (no coordinator is left here)."""
        self._keeper.cancel()
        if signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # main thread, between two bytecodes: no logging or locks here, only a hand-off
        if self.noticed is not None or self.worker.status not in _OPEN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # again, or closing: end now
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.noticed = time.monotonic()
        self.loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        grace = config.seconds("preemption.grace")
        # its deadline, for closures, the scheduler and a State's just-in-time commit
        deadlines.noticed(self.worker, Preemption(time.time() + grace, "SIGTERM"))
        watchdog = threading.Timer(grace, _end_process, args=(grace,))
        watchdog.daemon = True
        watchdog.name = "daskdist-preemption-watchdog"
        watchdog.start()
        asyncio.ensure_future(self.leave(self.noticed + grace))

    async def leave(self, deadline: float) -> None:
        """Leave this worker gracefully before ``deadline`` (``time.monotonic()``)."""
        w = self.worker
        logger.warning("daskdist: worker %s received a preemption notice (SIGTERM): "
                       "leaving within %.0f s", w.address, deadline - time.monotonic())
        try:
            if w.status in _OPEN:
                w.status = Status.closing_gracefully  # the scheduler drains it at once
            for runner in self.runners():
                runner.give_back(2**31)  # received, not started: they run elsewhere
            # a margin before the deadline to move data and close: at most a tenth
            margin = min(5.0, 0.1 * (deadline - time.monotonic()))
            while any(r.busy for r in self.runners()) and \
                    time.monotonic() < deadline - margin:
                await asyncio.sleep(0.05)  # the running closures end (gangs at a commit)
                for runner in self.runners():
                    runner.give_back(2**31)  # any dispatched before the drain arrived
            busy = sum(r.busy for r in self.runners())
            if busy:
                logger.warning("daskdist: worker %s leaves with %d closure(s) still running "
                               "(daskdist.preemption.grace reached): they run again "
                               "elsewhere", w.address, busy)
            try:
                await asyncio.wait_for(
                    w.scheduler.retire_workers(workers=[w.address], close_workers=False,
                                               remove=False,
                                               stimulus_id=f"daskdist-preemption-{time.time()}"),
                    max(0.1, deadline - time.monotonic() - 1.0))
            except Exception as e:  # noqa: BLE001 - the data is recomputed if it is lost
                logger.info("daskdist: moving worker %s's data away failed: %r",
                            w.address, e)
            await w.close(nanny=True, reason="daskdist-preemption-notice")
        finally:
            self.left.set()


def _end_process(grace: float) -> None:
    logger.error("daskdist: the worker did not leave within daskdist.preemption.grace "
                  "(%.0f s) of its preemption notice: ending the process (its threads' "
                  "stacks follow on stderr)", grace)
    faulthandler.dump_traceback(all_threads=True)
    logging.shutdown()
    os._exit(128 + signal.SIGTERM)


def install(worker: Any, runners: Callable[[], list]) -> PreemptionNotice | None:
    """Install this worker process's SIGTERM handler once (event loop; the loop must be
    the main thread's: a worker in a thread of another process is not preempted alone,
    so none is installed there). The handler, or ``None``."""
    notice = getattr(worker, _ATTR, None)
    if notice is not None:
        return notice
    if not config.get("preemption.notice"):
        return None
    if threading.current_thread() is not threading.main_thread():
        logger.debug("daskdist: worker %s runs off the main thread: no SIGTERM handler",
                     worker.address)
        return None
    notice = PreemptionNotice(worker, runners)
    setattr(worker, _ATTR, notice)
    return notice


def uninstall(worker: Any) -> None:
    """Remove this worker's SIGTERM handler (its last coordinator plugin went)."""
    notice = getattr(worker, _ATTR, None)
    if notice is not None and notice.noticed is None:
        notice.uninstall()
        delattr(worker, _ATTR)
