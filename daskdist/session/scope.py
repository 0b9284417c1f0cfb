"""The scope of the closure a thread runs (TensorFlow's ``coordinator_context``): its
context, its worker session's services, the lease tokens it consumed, the ids of the
elastic States made in it, and its synchronous step.

The worker runner enters one scope per closure (:func:`closure_scope`); data and
collective code reach the session's services through :func:`session_services`, never
through the worker plugin, so a closure of an ended session can only make calls the
scheduler refuses. The token functions are in :mod:`daskdist.session.tokens`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_local = threading.local()  # what a per-worker resource being built mints States after
# The closure a thread runs, as a context variable: a thread the closure starts in its
# context (``threading.Thread(target=contextvars.copy_context().run, args=(fn,))``)
# belongs to the closure too, so the rows it takes count for it.
_current: contextvars.ContextVar[ClosureScope | None] = contextvars.ContextVar(
    "daskdist_closure_scope", default=None)


@dataclass
class ClosureScope:
    """What the closure running in a thread is bound to (TensorFlow's
    ``coordinator_context``): its context, the scheduler services of the worker session
    it was dispatched under, and the lease tokens it consumed.

    The worker runner enters one per closure (:func:`closure_scope`); data and collective
    code reach the services through :func:`session_services`, never through the worker
    plugin, so a closure of an ended session can only make calls the scheduler refuses.
    Threads the closure starts in its context share the scope (``tokens`` under
    ``lock``); once the closure ended (:meth:`end`) the scope takes no more tokens.
    """

    context: Any = None  # the closure's daskdist.context.WorkerContext
    services: Any = None  # plugins.worker.services.SessionServices (duck-typed here)
    tokens: list = field(default_factory=list)
    aside: list = field(default_factory=list)  # taken out of ``tokens``, still its own
    # its synchronous step (collective.step.step.Step: what rides the next gradient
    # allreduce, the batch fetched ahead, the deferred commit message), made when first
    # used; it ends with the closure (end)
    step: Any = None
    origin: str = ""  # what States made here are named after (see mint_state_id)
    minted: int = 0  # States made here so far
    ended: bool = False  # the closure returned: its tokens went with its result
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def end(self) -> list:
        """The closure ended: its step's deferred messages go (a loop never closed left
        them), and its tokens are returned (sent with its result); later ones are
        refused."""
        if self.step is not None:
            self.step.end()
        with self.lock:
            self.ended = True
            out, self.tokens = list(self.tokens), []
        return out

    def end_aside(self) -> list:
        """The tokens still set aside when the closure ended: batches fetched ahead and
        never trained (the runner gives their rows back)."""
        with self.lock:
            out, self.aside = list(self.aside), []
        return out


def origin_of(cid: str) -> str:
    """What a closure's :attr:`ClosureScope.origin` is: the gang a member closure belongs
    to (the same on every rank and attempt: a member's id is
    ``<gang>@<generation>#<rank>``, see ``core.gang.member_cid``); any other closure's
    own id."""
    return cid.split("@", 1)[0]


class ClosureEndedError(RuntimeError):
    """A thread the closure started consumed rows after the closure returned: no closure
    can acknowledge them any more."""


@contextlib.contextmanager
def closure_scope(scope: ClosureScope) -> Iterator[ClosureScope]:
    """Bind ``scope`` to this thread's context while the block runs (the runner, and
    tests); threads started in a copy of that context share it."""
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)


def _scope() -> ClosureScope | None:
    return _current.get()


def closure_scope_now() -> ClosureScope | None:
    """The scope of the closure running in this thread (``None`` outside one)."""
    return _scope()


@contextlib.contextmanager
def minting(origin: str) -> Iterator[None]:
    """States made in this thread while the block runs are named after ``origin`` (the
    worker's resource registry, while it builds per-worker resource ``origin``)."""
    prev = getattr(_local, "mint", None)
    _local.mint = [origin, 0]
    try:
        yield
    finally:
        _local.mint = prev


def mint_state_id() -> str:
    """An id for a new elastic ``State``, the same on every rank and on a replacement
    worker: the per-worker resource being built, or else the gang closure running (its
    id without the attempt: every rank runs the same one), and how many States it made
    before this one. Outside both, a local id (no scheduler ever sees it)."""
    mint = getattr(_local, "mint", None)
    if mint is not None:
        origin, n = mint
        mint[1] += 1
        return f"{origin}/{n}"
    scope = _scope()
    if scope is not None and scope.origin:
        scope.minted += 1
        return f"{scope.origin}/{scope.minted - 1}"
    return f"local-{uuid.uuid4().hex}"


def session_services() -> Any:
    """The scheduler services of the running closure's session (lease release, commit
    parts, commit outcomes); ``RuntimeError`` outside a closure run by a worker plugin."""
    scope = _scope()
    if scope is None or scope.services is None:
        raise RuntimeError("no daskdist session: call this inside a closure on a worker")
    return scope.services


