"""The lease tokens the closure running in this thread consumed: recorded as it takes
batches, sent with its result (acknowledged only if it completes), taken by an elastic
State's commit instead, set aside for a batch fetched ahead, given back by identity.

Every function works on the scope of the closure running in the calling thread
(:mod:`daskdist.session.scope`), under the scope's lock; outside a closure they record
nothing and return nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from daskdist.session.scope import ClosureEndedError, closure_scope_now


def record_consumed(token: Any) -> bool:
    """Record that the closure running in this thread consumed ``token`` (e.g. leased rows).

    The worker plugin sends every recorded token with the closure's result, in one
    message, so the scheduler acknowledges them only if the closure completes. Returns
    ``False`` (recording nothing) in a thread that runs no closure, and raises
    :class:`ClosureEndedError` in a thread the closure started once the closure ended:
    the caller gives such rows back (no closure could acknowledge them).
    """
    scope = closure_scope_now()
    if scope is None:
        return False
    with scope.lock:
        if scope.ended:
            raise ClosureEndedError(
                f"thread {threading.current_thread().name!r} consumed rows after the "
                f"closure it was started in ended")
        scope.tokens.append(token)
    return True


def consumed_mark() -> int:
    """How many tokens the closure in this thread has recorded so far (0 outside one)."""
    scope = closure_scope_now()
    if scope is None:
        return 0
    with scope.lock:
        return len(scope.tokens)


def take_consumed(since: int = 0) -> list:
    """Remove and return the tokens recorded in this thread from position ``since`` on.

    Elastic state takes them at ``commit()`` (the commit acknowledges them instead of
    the closure's end) and ``synced`` takes a batch it gives back. ``[]`` outside a
    closure.
    """
    return _take(since, aside=False)


def set_aside(since: int) -> list:
    """Take the tokens recorded from position ``since`` on out of the closure's list (a
    commit does not acknowledge them) and keep them as its own, set aside: a batch a
    framework fetched ahead, its rows trained later (:func:`take_back`) or given back
    (:func:`drop_aside`). ``[]`` outside a closure."""
    return _take(since, aside=True)


def _take(since: int, aside: bool) -> list:
    scope = closure_scope_now()
    if scope is None:
        return []
    with scope.lock:
        out = scope.tokens[since:]
        del scope.tokens[since:]
        if aside:
            scope.aside.extend(out)
    return out


def take_back(tokens: list) -> None:
    """Tokens set aside (the same objects) are recorded as consumed again, now: their
    batch begins training, so the next commit acknowledges them."""
    _unset(tokens)
    for t in tokens:
        record_consumed(t)


def drop_aside(tokens: list) -> None:
    """Tokens set aside (the same objects) are no longer the closure's: the caller gives
    their rows back."""
    _unset(tokens)


def _unset(tokens: list) -> None:
    scope = closure_scope_now()
    if scope is None or not tokens:
        return
    ids = {id(t) for t in tokens}
    with scope.lock:
        scope.aside[:] = [t for t in scope.aside if id(t) not in ids]


def held_tokens() -> list:
    """Every token the closure in this thread holds, recorded or set aside (rows it
    consumed and has not committed); ``[]`` outside one."""
    scope = closure_scope_now()
    if scope is None:
        return []
    with scope.lock:
        return scope.tokens + scope.aside


def consumed_since(mark: int) -> list:
    """The tokens recorded in this thread's closure from position ``mark`` on, left
    where they are (a batch's own, for :func:`take_tokens` later); ``[]`` outside one."""
    scope = closure_scope_now()
    if scope is None:
        return []
    with scope.lock:
        return scope.tokens[mark:]


def put_aside(tokens: list) -> None:
    """Those of ``tokens`` (the same objects) the closure in this thread still holds are
    set aside: no commit acknowledges them, and the closure's end gives their rows back
    (a batch never trained when the group broke: the closure is ending)."""
    scope = closure_scope_now()
    if scope is None or not tokens:
        return
    ids = {id(t) for t in tokens}
    with scope.lock:
        scope.aside.extend(t for t in scope.tokens if id(t) in ids)
        scope.tokens[:] = [t for t in scope.tokens if id(t) not in ids]


def take_tokens(tokens: list) -> list:
    """Remove and return those of ``tokens`` (the same objects) that the closure running
    in this thread still holds.

    How a batch taken but never trained is given back: by identity, never by position
    (others take tokens out and record them again meanwhile, e.g. a framework's
    fetch-ahead, and a generator's ``finally`` may run late, in another closure's
    thread, when the garbage collector finalizes it: there it finds nothing of its own).
    """
    scope = closure_scope_now()
    if scope is None or not tokens:
        return []
    ids = {id(t) for t in tokens}
    with scope.lock:
        out = [t for t in scope.tokens if id(t) in ids]
        if out:
            scope.tokens[:] = [t for t in scope.tokens if id(t) not in ids]
    return out


