"""DeadlineWatch: this worker's preemption deadline, from every source, told to its
closures and to each coordinator's scheduler side (SPEC §4.6).

Sources, each giving a :class:`~daskdist.core.protocol.Preemption` (the earliest one
counts):

- SIGTERM (the graceful leave of :mod:`.preemption`): now + ``daskdist.preemption.grace``;
- the signals of ``daskdist.preemption.signals`` with their lead: Slurm's
  ``--signal=B:USR1@120`` is ``{USR1: 120}``; the worker goes on working;
- Dask's worker ``lifetime`` (``--lifetime``, ``distributed.worker.lifetime.duration``),
  known at start: the worker process's start + its (staggered) lifetime;
- cloud pollers (:mod:`.pollers`: AWS spot, Azure scheduled events, GCP);
- ``coord.notify_preemption(worker, deadline)`` (a ``daskdist-preemption`` message).

The notice is set where closures read it (``ctx.preemption``,
:mod:`daskdist.session.preemption`) and sent to every coordinator's scheduler side from
the runner's session (:func:`tell`), again from each session registered later. What
the worker does with it: its runners start only closures that end before it
(``core.lifetime.deadlines.DurationBook``), and a gang member's State leaves at its next
commit with a just-in-time checkpoint (``collective/state/deadline.py``).

Threads: signal handlers (main thread) only hand the notice to the event loop, which
owns the watch; pollers fetch in a thread and hand back the same way.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
from dask.utils import parse_timedelta

from daskdist import config
from daskdist.core.lifetime.deadlines import DurationBook, acting, earliest
from daskdist.core.protocol import Preemption
from daskdist.plugins.worker import pollers
from daskdist.session.preemption import forget_preemption, preemption_of, set_preemption

logger = logging.getLogger(__name__)

_ATTR = "_daskdist_deadlines"


def signal_leads(setting: Any) -> dict[int, tuple[str, float]]:
    """``daskdist.preemption.signals`` as ``{signal number: (name, lead seconds)}``
    (``{USR1: 120}``, ``{"SIGUSR2": "2min"}``); ``ValueError`` naming the setting."""
    what = "daskdist.preemption.signals"
    if not setting:
        return {}
    if not isinstance(setting, dict):
        raise ValueError(f"{what} must map signal names to lead seconds, got {setting!r}")
    out = {}
    for key, lead in setting.items():
        name = str(key).upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        signum = getattr(signal, name, None)
        if not isinstance(signum, signal.Signals) or signum in (signal.SIGKILL,
                                                                 signal.SIGSTOP):
            raise ValueError(f"{what}: {key!r} is not a signal a handler can take")
        if signum == signal.SIGTERM:
            raise ValueError(f"{what}: SIGTERM is the graceful leave already (its lead is "
                             f"daskdist.preemption.grace)")
        try:
            seconds = float(parse_timedelta(lead, default="seconds"))
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{what}: the lead of {key!r} must be a duration, got "
                             f"{lead!r}") from e
        out[int(signum)] = (name, seconds)
    return out


class DeadlineWatch:
    """This worker process's deadline and its sources (one per worker, see
    :func:`install`); every method but the signal handler runs on the event loop."""

    def __init__(self, worker: Any, runners: Callable[[], list]) -> None:
        self.worker = worker
        self.runners = runners  # the ClosureRunners of this worker's coordinators now
        self.loop = asyncio.get_running_loop()
        self.notice: Preemption | None = None
        self._previous: dict[int, Any] = {}  # signal -> the handler ours replaced
        self._polls: list[asyncio.Task] = []

    def start(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, (name, lead) in signal_leads(config.get("preemption.signals")).items():
                self._previous[signum] = signal.signal(signum, self._handler(name, lead))
        lifetime = getattr(self.worker, "lifetime", None)
        if lifetime:  # Dask closes the worker then (the process's start is a bound)
            self.set(Preemption(psutil.Process().create_time() + float(lifetime),
                                "worker lifetime"))
        interval = config.seconds("preemption.poll-interval")
        for name in config.get("preemption.pollers") or []:
            poller = pollers.make_poller(str(name))
            self._polls.append(asyncio.ensure_future(self._poll(poller, interval)))

    def _handler(self, name: str, lead: float) -> Callable[[int, Any], None]:
        def on_signal(signum: int, frame: Any) -> None:
            # main thread, between two bytecodes: only a hand-off to the event loop
            self.loop.call_soon_threadsafe(self.set, Preemption(time.time() + lead, name))

        return on_signal

    async def _poll(self, poller: pollers.Poller, interval: float) -> None:
        while True:
            try:
                deadline = await asyncio.to_thread(poller.poll)
            except Exception as e:  # noqa: BLE001 - a poller's bug must not end the worker
                logger.warning("daskdist: preemption poller %s failed: %r", poller.reason, e)
                deadline = None
            if deadline is not None:
                self.set(Preemption(deadline, poller.reason))
            await asyncio.sleep(interval)

    def set(self, notice: Preemption) -> None:
        """A source spoke: the earliest deadline counts; closures see it at once, and
        every coordinator's scheduler side hears it."""
        new = earliest(self.notice, notice)
        if new == self.notice:
            return
        self.notice = new
        set_preemption(self.worker.address, new)
        left = new.deadline - time.time()
        near = acting(new.deadline, time.time(), config.seconds("preemption.horizon"))
        logger.log(logging.WARNING if near else logging.INFO,
                   "daskdist: worker %s will be taken away in %.0f s (%s)",
                   self.worker.address, left, new.reason)
        for runner in self.runners():
            tell(runner)

    def stop(self) -> None:
        for task in self._polls:
            task.cancel()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        forget_preemption(self.worker.address)


class Admission:
    """Which closures a runner whose worker has a deadline (``runner.deadline``) starts
    (any thread): those expected to end ``daskdist.preemption.margin`` before it, by the
    durations of the same function here (:class:`~daskdist.core.lifetime.deadlines.DurationBook`:
    the longest of its last runs; ``daskdist.preemption.unknown-duration`` for one never
    run here). The runner appends every closure's ``(function key, seconds)`` to
    ``runner.ran``; they are read here when judging. A function is known by its pickled
    bytes (the same for the same function: clients pickle it once)."""

    def __init__(self) -> None:
        self.durations = DurationBook(unknown=config.seconds("preemption.unknown-duration"))
        self.margin = config.seconds("preemption.margin")
        self._lock = threading.Lock()

    def _fold(self, ran: Any) -> None:
        """The runs appended since the last judgement (under the lock)."""
        while ran:
            try:
                key, seconds = ran.popleft()
            except IndexError:  # another thread took the last one
                return
            self.durations.add(key, seconds)

    def fits(self, runner: Any, fn_bytes: bytes) -> bool:
        """Whether a closure of that function, started now, ends before the deadline."""
        notice = runner.deadline
        with self._lock:
            self._fold(runner.ran)
            return notice is None or self.durations.fits(hash(fn_bytes), time.time(),
                                                         notice.deadline, self.margin)

    def takes_more(self, runner: Any) -> bool:
        """Whether to ask for closures: no deadline, or the longest expected one still
        fits (so a closure handed back is not handed here again)."""
        notice = runner.deadline
        with self._lock:
            self._fold(runner.ran)
            return notice is None or self.durations.takes_more(time.time(), notice.deadline,
                                                               self.margin)


def tell(runner: Any) -> None:
    """Give ``runner`` this worker's deadline, and tell its coordinator (its scheduler
    side, from its current session), in the background (event loop); nothing without
    one."""
    notice = preemption_of(runner.worker.address)
    runner.deadline = notice
    session = runner.session_id
    if notice is None or not session:
        return

    async def send() -> None:
        try:
            await runner.worker.scheduler.daskdist_preemption(
                name=runner.name, session=session, deadline=notice.deadline,
                reason=notice.reason)
        except Exception as e:  # noqa: BLE001 - the scheduler is gone, or the session
            logger.info("daskdist: telling the scheduler this worker's deadline failed: "
                        "%r", e)

    asyncio.ensure_future(send())


def left_group(runner: Any) -> None:
    """A gang member of ``runner`` ended on a worker whose deadline is within the
    horizon: it left its group at a commit, and no formation takes it again. Its
    per-worker iterators close, giving the rows they hold leased back to the pool for
    the members that stay (a closure that uses one here again builds it anew). Event
    loop."""
    notice = preemption_of(runner.worker.address)
    resources = runner.resources
    if notice is None or resources is None or not acting(
            notice.deadline, time.time(), config.seconds("preemption.horizon")):
        return
    resources.drop([rid for rid in resources.rids() if rid.startswith("iterator-")])


def install(worker: Any, runners: Callable[[], list]) -> DeadlineWatch:
    """This worker's watch, started once (event loop)."""
    watch = getattr(worker, _ATTR, None)
    if watch is None:
        watch = DeadlineWatch(worker, runners)
        setattr(worker, _ATTR, watch)
        watch.start()
    return watch


def noticed(worker: Any, notice: Preemption) -> None:
    """A source outside the watch spoke (SIGTERM's leave, the scheduler's
    ``daskdist-preemption`` message): hand it to the worker's watch (event loop)."""
    watch = getattr(worker, _ATTR, None)
    if watch is not None:
        watch.set(notice)


def uninstall(worker: Any) -> None:
    """Stop this worker's watch (its last coordinator plugin went)."""
    watch = getattr(worker, _ATTR, None)
    if watch is not None:
        watch.stop()
        delattr(worker, _ATTR)
