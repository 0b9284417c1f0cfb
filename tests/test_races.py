"""Races and silent failures found by reading (issue 11, point 4), each pinned by a test
that fails without its fix."""

from __future__ import annotations

import asyncio
import threading

from daskdist.context import (
    ClosureScope,
    WorkerContext,
    _set_membership,
    closure_scope,
    membership_version,
)
from daskdist.core.protocol import READY, USER_ERROR, Outcome
from daskdist.plugins.scheduler import CoordinatorPlugin
from daskdist.plugins.scheduler.state import CoordinatorState


def test_membership_counter_is_per_coordinator_name():
    _set_membership(7, name="race-a")
    _set_membership(3, name="race-b")
    _set_membership(2, name="race-a")  # never goes back
    assert membership_version("race-a") == 7 and membership_version("race-b") == 3
    seen = {}

    def closure_thread(name):
        # what elastic State.commit() calls: the version of the closure's coordinator
        with closure_scope(ClosureScope(WorkerContext(0, 1, "cpu", "tcp://w", 1, name))):
            seen[name] = membership_version()

    for name in ("race-a", "race-b"):
        t = threading.Thread(target=closure_thread, args=(name,))
        t.start()
        t.join()
    assert seen == {"race-a": 7, "race-b": 3}


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
