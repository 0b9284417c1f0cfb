"""Each gang member's step clock (SPEC §5.1): how its steps' wall time splits into data,
collective, commit and compute, measured where daskdist already is, without user code.

The hooks are one line each where daskdist owns the wait:

- :func:`phase` / :func:`timed` around a daskdist loader's ``next()`` and ``synced``
  (data; its agreement allreduce inside it counts as data), the group's calls
  (collective: ``Group._run``, which DDP's gradient allreduce also goes through) and
  ``State.commit`` / ``State.sync`` (commit). Nested calls count once, for the outermost.
- :func:`step` marks where one step ends and the next begins: each batch ``synced`` is
  asked for, or each commit when the loop has no ``synced``.
- :func:`partitions` in a Dask collection's producer: seconds waiting for Dask to
  compute a partition, and reading it.

While no gang closure runs here (:func:`recording` not entered) each hook costs one
global read. While one runs, its :class:`Recorder` sums every step into the open
:class:`~daskdist.observe.steptimes.WindowSum`; the worker plugin takes the closed windows
(:meth:`Recorder.roll`) once a window and sends them to the scheduler.

Threads: the gang closure's thread (``Recorder.thread``) owns the current step's sums
(``acc``, ``rows``) and is the only one whose data phases and step marks count. Other
threads (autograd's, when a CUDA backward runs DDP's hook; a collection's producer) add
to ``foreign`` and ``parts`` under ``lock``. ``lock`` also guards the open window and the
closed ones, which the worker's event loop takes. A thread's nesting depth is its own
(thread-local).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from daskdist.observe.steptimes import COLLECTIVE, COMMIT, DATA, WindowSum

__all__ = ["COLLECTIVE", "COMMIT", "COMPUTING", "DATA", "READING", "Recorder", "active",
           "batch_rows", "partitions", "phase", "recording", "step", "stuck", "timed"]

SYNCED, COMMITTED = "synced", "commit"  # what ended a step
COMPUTING, READING = 0, 1  # a collection's producer: waiting for Dask, reading a partition

F = TypeVar("F", bound=Callable[..., Any])

_ACTIVE: Recorder | None = None  # the recording gang closure of this process, if any
_local = threading.local()  # .depth: this thread's open phases


class Recorder:
    """One gang closure's steps on this rank, in windows of ``window`` seconds."""

    def __init__(self, window: float, name: str = "", session: str = "", gang: str = "",
                 generation: int = 0, rank: int = 0, thread: int | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time,
                 ask_stuck: Callable[[], str] | None = None) -> None:
        if not window > 0:
            raise ValueError(f"the observation window must be positive, got {window!r}")
        self.window = float(window)
        self.name, self.session, self.gang = name, session, gang
        self.generation, self.rank = generation, rank
        self.thread = threading.get_ident() if thread is None else thread
        self.clock, self.wall = clock, wall
        self.ask_stuck = ask_stuck  # which ranks are stuck where (a timed-out call asks)
        self.lock = threading.Lock()
        # the gang thread's own: the current step's data, collective and commit seconds
        self.acc = [0.0, 0.0, 0.0]
        self.rows = 0
        self.synced = False  # steps are synced batches (else commits)
        self.started = self.last = clock()  # the run's start; the current step's start
        self.last_step: float | None = None  # when the newest step ended
        self.total = 0  # steps so far
        self.open_phase: int | None = None  # the gang thread's outermost phase now
        # under lock
        self.foreign = [0.0, 0.0, 0.0]
        self.parts = [0.0, 0.0]  # COMPUTING, READING seconds since the last window closed
        self.current = WindowSum(self._index(wall()))
        self.closed: deque[WindowSum] = deque()

    def _index(self, t: float) -> int:
        return int(t // self.window)

    # -- the hooks' side (any thread; the gang thread's without a lock) --------------------
    def add(self, kind: int, seconds: float, rows: int = 0) -> None:
        """An outermost phase of ``kind`` took ``seconds`` (``rows`` handed out in it)."""
        if threading.get_ident() == self.thread:
            self.acc[kind] += seconds
            self.rows += rows
            self.open_phase = None
        elif kind != DATA:  # another closure's loader is not this gang's data
            with self.lock:
                self.foreign[kind] += seconds

    def add_partition(self, which: int, seconds: float) -> None:
        with self.lock:
            self.parts[which] += seconds

    def step(self, source: str) -> None:
        """A step ended (``source``: :data:`SYNCED` or :data:`COMMITTED`): its wall time
        since the previous one goes to the window it ended in."""
        if threading.get_ident() != self.thread:
            return
        now = self.clock()
        if source == SYNCED:
            if not self.synced:  # its first batch asked for: steps are its batches now
                self.synced = True
                self.last, self.acc, self.rows = now, [0.0, 0.0, 0.0], 0
                with self.lock:
                    self.foreign = [0.0, 0.0, 0.0]
                return
        elif self.synced:
            return  # commits inside a synced loop are phases, not steps
        seconds, self.last, self.last_step = now - self.last, now, now
        acc, rows = self.acc, self.rows
        self.acc, self.rows = [0.0, 0.0, 0.0], 0
        index = self._index(self.wall())
        with self.lock:
            f = self.foreign
            if f[0] or f[1] or f[2]:
                acc = [a + b for a, b in zip(acc, f, strict=True)]
                self.foreign = [0.0, 0.0, 0.0]
            if index != self.current.index:
                self._seal(index)
            self.current.add(seconds, acc[DATA], acc[COLLECTIVE], acc[COMMIT], rows)
            self.total += 1

    # -- the worker plugin's side (its event loop) ------------------------------------------
    def _seal(self, index: int) -> None:
        """Close the open window and open ``index`` (under ``lock``)."""
        w = self.current
        w.computing, w.reading = self.parts
        self.parts = [0.0, 0.0]
        self.closed.append(w)
        self.current = WindowSum(index)

    def roll(self, final: bool = False) -> list[WindowSum]:
        """The windows closed by now (an empty one too: a rank that made no step says
        so), oldest first; ``final``: the open one as well (the run ended)."""
        index = self._index(self.wall())
        with self.lock:
            if final or index > self.current.index:
                self._seal(index)
            out = list(self.closed)
            self.closed.clear()
        return out

    def since_step(self) -> float:
        """Seconds since the newest step ended (or since the run started, before one)."""
        last = self.last_step
        return max(0.0, self.clock() - (self.started if last is None else last))


class _Idle:
    """What a hook gets while no gang closure records: does nothing."""

    __slots__ = ()

    def __enter__(self) -> _Idle:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def rows(self, n: int) -> None:
        pass


_IDLE = _Idle()


class _Phase:
    """One phase of a recording gang: timed if it is its thread's outermost."""

    __slots__ = ("kind", "n", "rec", "t0")

    def __init__(self, rec: Recorder, kind: int) -> None:
        self.rec, self.kind, self.n, self.t0 = rec, kind, 0, -1.0

    def __enter__(self) -> _Phase:
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        if depth == 0:
            self.t0 = time.perf_counter()
            rec = self.rec
            if rec.thread == threading.get_ident():
                rec.open_phase = self.kind
        return self

    def rows(self, n: int) -> None:
        """Rows this phase handed out (counted if it is the outermost)."""
        self.n = n

    def __exit__(self, *exc: Any) -> None:
        _local.depth -= 1
        if self.t0 >= 0.0:
            self.rec.add(self.kind, time.perf_counter() - self.t0, self.n)


def phase(kind: int) -> _Phase | _Idle:
    """A ``with`` block timed as ``kind`` (:data:`DATA`, :data:`COLLECTIVE` or
    :data:`COMMIT`) in the recording gang, if any; ``.rows(n)`` inside counts rows."""
    rec = _ACTIVE
    return _IDLE if rec is None else _Phase(rec, kind)


def timed(kind: int, ends_step: bool = False, counts_rows: bool = False
          ) -> Callable[[F], F]:
    """A function's calls timed as :func:`phase` ``kind``; ``ends_step``: each call ends a
    step when the loop has no ``synced`` (a commit); ``counts_rows``: it returns a batch,
    whose rows count (:func:`batch_rows`)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            rec = _ACTIVE
            if rec is None:
                return fn(*args, **kwargs)
            try:
                with _Phase(rec, kind) as p:
                    out = fn(*args, **kwargs)
                    if counts_rows and p.t0 >= 0.0:
                        p.n = batch_rows(out)
                    return out
            finally:
                if ends_step:
                    rec.step(COMMITTED)
        return timed_call  # type: ignore[return-value]
    return wrap


def batch_rows(batch: Any) -> int:
    """A batch's rows: the first dimension of its first tensor (or array), at any depth
    of dicts, lists and tuples; a list of plain values is a column of rows; 0 when there
    is nothing to count."""
    x = batch
    for _ in range(8):
        shape = getattr(x, "shape", None)
        if shape is not None:
            return int(shape[0]) if len(shape) else 0
        if isinstance(x, dict):
            x = next(iter(x.values()), None)
        elif isinstance(x, (list, tuple)):
            if not x:
                return 0
            first = x[0]
            if not (hasattr(first, "shape") or isinstance(first, (dict, list, tuple))):
                return len(x)  # a column: one value a row
            x = first
        else:
            return 0
    return 0


def step(source: str = SYNCED) -> None:
    """Mark a step boundary in the recording gang (its thread's only)."""
    rec = _ACTIVE
    if rec is not None:
        rec.step(source)


class _Partition:
    __slots__ = ("rec", "t0", "which")

    def __init__(self, rec: Recorder, which: int) -> None:
        self.rec, self.which, self.t0 = rec, which, 0.0

    def __enter__(self) -> _Partition:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.rec.add_partition(self.which, time.perf_counter() - self.t0)


def partitions(which: int) -> Callable[[F], F]:
    """A collection producer's function timed as :data:`COMPUTING` (waiting for Dask)
    or :data:`READING` (turning a partition into tensors), in any thread."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            rec = _ACTIVE
            if rec is None:
                return fn(*args, **kwargs)
            with _Partition(rec, which):
                return fn(*args, **kwargs)
        return timed_call  # type: ignore[return-value]
    return wrap


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder | None]:
    """``rec`` records this process's gang hooks while the block runs (the block: the
    gang closure, in ``rec.thread``). A second gang running meanwhile records nothing
    (``None``): a process is in one group at a time."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield None
        return
    _ACTIVE = rec
    try:
        yield rec
    finally:
        _ACTIVE = None


def active() -> Recorder | None:
    """The recording gang's recorder, if any."""
    return _ACTIVE


def stuck() -> str:
    """Which ranks are stuck where, for a collective call that timed out (``""``: not
    known: no recording gang, or the scheduler did not say)."""
    rec = _ACTIVE
    if rec is None or rec.ask_stuck is None:
        return ""
    try:
        return rec.ask_stuck()
    except Exception:  # noqa: BLE001 - the error being raised matters more
        return ""
