"""Races and silent failures found by reading, each pinned by a test
that fails without its fix."""

from __future__ import annotations

import asyncio
import threading

from daskdist.context import WorkerContext
from daskdist.core.protocol import READY, USER_ERROR, Outcome
from daskdist.plugins.scheduler import CoordinatorPlugin
from daskdist.plugins.scheduler.state import CoordinatorState
from daskdist.session.counters import (
    forget_membership,
    membership_joins,
    membership_version,
    set_membership,
)
from daskdist.session.scope import ClosureScope, closure_scope


class _Services:
    """What a closure's scope carries for the counters: its worker session's id."""

    def __init__(self, session: str) -> None:
        self.session = session


def test_membership_counter_is_per_worker_session():
    """Counters belong to a worker session (one coordinator's registration on a worker):
    two coordinators on a worker, or a closed coordinator and a new one of the same
    name, never share them."""
    set_membership(7, 2, session="race-a")
    set_membership(3, 1, session="race-b")
    set_membership(2, 1, session="race-a")  # never goes back
    assert membership_version("race-a") == 7 and membership_version("race-b") == 3
    assert membership_joins("race-a") == 2
    seen = {}

    def closure_thread(session):
        # what elastic State.commit() calls: the counters of the closure's session
        scope = ClosureScope(WorkerContext(0, 1, "cpu", "tcp://w", 1, "same-name"),
                             _Services(session))
        with closure_scope(scope):
            seen[session] = membership_version()

    for session in ("race-a", "race-b", "race-c"):
        t = threading.Thread(target=closure_thread, args=(session,))
        t.start()
        t.join()
    assert seen == {"race-a": 7, "race-b": 3, "race-c": 0}  # a new session starts clean
    forget_membership("race-a")
    assert membership_version("race-a") == 0


def test_two_error_raises_do_not_interleave():
    """A raise that times out must not un-pause the queue while another raise waits."""
    async def main():
        plugin = CoordinatorPlugin()
        co = plugin.coordinators["r"] = CoordinatorState("r")
        co.closure_book.add_owner("o", None, "secret")
        q = co.queue
        q.add_session("s", slots=2)
        q.put("o-0", "o", b"")
        q.put("o-1", "o", b"")
        q.dispatch("s", 2)
        q.finish("s", "o-0", False, b"boom", USER_ERROR)  # the error; o-1 still runs
        # waits for o-1
        second = asyncio.ensure_future(co.closure_book.raise_owner_error("o", "secret"))
        # ``second`` runs first (it was scheduled first) and takes the raise lock, so
        # this raise times out waiting for the lock
        first = await co.closure_book.raise_owner_error("o", "secret", timeout=0.1)
        await asyncio.sleep(0)
        assert first == {"timeout": True}
        assert not second.done()
        assert q.held == {"o"}  # the waiting raise still holds the owner's dispatch
        q.put("o-2", "o", b"")
        assert q.dispatch("s", 5) == []
        co.closure_book.apply_results("s", [Outcome("o-1", READY, b"ok", None, 1)])
        got = await asyncio.wait_for(second, 5)
        assert got["error"] is not None and got["error"][0] == "o-0"
        assert ("o", "o-2") in got["cancelled"]
        assert not q.held
        again = await co.closure_book.raise_owner_error("o", "secret")
        assert again == {"error": None, "cancelled": []}

    asyncio.run(main())


def test_input_context_services_and_its_deprecated_name():
    """``InputContext.services`` is the session's whole services object;
    ``leases`` was its name and stays as a deprecated alias."""
    import dataclasses
    import warnings

    import pytest

    from daskdist.context import InputContext

    svc = object()
    assert InputContext(services=svc).services is svc
    with pytest.warns(DeprecationWarning, match="services"):
        ctx = InputContext(leases=svc)
    assert ctx.services is svc and ctx.leases is svc
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = dataclasses.replace(ctx, num_replicas_in_sync=2)  # not the user's: silent
    assert again.services is svc and again.num_replicas_in_sync == 2
