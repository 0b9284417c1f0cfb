"""The exception types users catch (SPEC §2.5), and how errors travel between processes."""

from __future__ import annotations

import pickle
import traceback
from concurrent.futures import CancelledError as _FuturesCancelledError
from typing import Any

import cloudpickle

from daskdist.core.protocol import COLLECTIVE_REPEATED, INPUT_ERROR, WORKER_LOST


class CancelledError(_FuturesCancelledError):
    """A closure was cancelled because an earlier closure's error was raised to the user."""


class CoordinatorClosedError(CancelledError, RuntimeError):
    """The Coordinator was closed (or the scheduler dropped it: its client was cut off
    longer than ``client-grace``): closures of it that had not finished are cancelled,
    and it schedules, joins and fetches nothing more. A ``CancelledError``."""


class WorkerLostError(RuntimeError):
    """A closure's workers died ``max_worker_failures`` times while running it."""


class InputError(RuntimeError):
    """A per-worker resource (dataset, replica) could not be built on the worker.

    The factory's own exception is chained as ``__cause__`` and kept as ``original``.
    """

    def __init__(self, message: str, original: BaseException | None = None):
        super().__init__(message)
        self.original = original

    def __reduce__(self):
        return (type(self), (self.args[0], self.original))


class CollectiveError(RuntimeError):
    """A collective call failed because a member of the group was lost or timed out."""

    #: Whether running the gang again on a re-formed group may succeed (a lost member,
    #: a timeout). ``False`` on an error that a re-run would meet again (no member holds
    #: the committed state): the gang fails with it.
    transient: bool = True


class RemoteTraceback(Exception):
    """Carries a remote traceback's text; chained as ``__cause__`` of a re-raised error."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\n" + self.tb


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic state saw the group's membership change (Horovod semantics).

    Raised by ``State.commit()`` on every rank at the same commit; the gang closure
    then runs again on a group re-formed from the current workers.

    ``skip_sync`` (Horovod's): ``True`` when members only left (retired) since the
    group formed, no worker joined: every member that goes on holds the same committed
    state, so the next ``State.sync()`` skips its broadcast (it still makes one small
    allgather, so a rank that joined meanwhile is synced all the same: calling
    ``sync()`` is always safe). ``False`` when a worker joined.
    """

    def __init__(self, message: str = "workers joined or left", skip_sync: bool = False):
        super().__init__(message)
        self.skip_sync = bool(skip_sync)


def dump_error(exc: BaseException) -> bytes:
    """Pickle an exception with its traceback text; unpicklable ones become RuntimeError."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        return cloudpickle.dumps((exc, tb))
    except Exception:
        return cloudpickle.dumps((RuntimeError(f"{type(exc).__name__}: {exc}"), tb))


def load_error(payload: Any, kind: str | None) -> BaseException:
    """Rebuild a remote exception, its remote traceback chained as ``__cause__``."""
    if kind == WORKER_LOST:
        return WorkerLostError(
            payload or "the closure's workers died too many times while running it"
        )
    if kind == COLLECTIVE_REPEATED:  # the gang's budget of repeated failures ran out
        summary, first = payload
        cause = load_error(first, None)
        err = CollectiveError(f"{summary}: {type(cause).__name__}: {cause}")
        err.transient = False
        err.__cause__ = cause
        return err
    try:
        exc, tb = pickle.loads(payload)
    except Exception as e:  # an exception class missing on the client, say
        return RuntimeError(f"remote error could not be unpickled: {e!r}")
    if kind == INPUT_ERROR and not isinstance(exc, InputError):
        exc = InputError(str(exc), exc)
    if exc.__cause__ is None:
        exc.__cause__ = RemoteTraceback(tb)
    return exc
