"""Errors belong to their owner, and an unread error costs no CPU
(SPEC §2.5b), on a real LocalCluster with worker processes."""

from __future__ import annotations

import os
import time

import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import wait_for_workers, wait_until


def lookup(key):
    return {"a": 1}[key]


def square(x):
    return x * x


class CountingResults:
    """The client's scheduler RPC, counting ``daskdist_results`` calls (each is one
    long-poll round: a spinning client makes thousands a second)."""

    def __init__(self, rpc) -> None:
        self.rpc = rpc
        self.calls = 0

    def __getattr__(self, name):
        fn = getattr(self.rpc, name)
        if name != "daskdist_results":
            return fn

        async def counted(**kwargs):
            self.calls += 1
            return await fn(**kwargs)

        return counted


def wait_for_file(path, timeout=120.0):
    """A closure that runs until the test creates ``path``."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(path)


def test_an_unread_error_leaves_client_and_scheduler_idle(client, tmp_path):
    """A failed closure the user has not read yet, another still running: the results
    long-poll still waits for news (it spun, a core's worth, before). Counted, not
    timed: over ``window`` seconds at most one reply per poll interval comes (a loaded
    machine gives fewer, never more); the CPU it costs is benchmarks/bench_life.py's."""
    from daskdist import config

    poll = config.seconds("scheduler.poll-interval")  # the scheduler's (in this process)
    coord = dd.Coordinator(client, name="idle-error")
    try:
        wait_for_workers(client, coord, 2)
        gate = str(tmp_path / "gate")
        running = coord.schedule(wait_for_file, args=(gate,))
        failed = coord.schedule(lookup, args=("b",))
        assert isinstance(failed.exception(timeout=30), KeyError)
        wait_until(lambda: coord.status()["error_pending"], 10, "the error to be pending")
        counting = coord._rpc = CountingResults(coord._rpc)
        window = 3 * poll
        time.sleep(window)  # the measurement window, not a synchronisation
        print(f"results long-polls in {window:g} s with an error pending: {counting.calls}")
        assert counting.calls <= window / poll + 2, counting.calls
        assert not running.done()
        open(gate, "w").close()
        with pytest.raises(KeyError):
            coord.join()  # the error is still there to be read
        assert running.fetch() is True
    finally:
        coord.close()


def test_errors_belong_to_the_owner_whose_closure_raised(cluster, client):
    """Two notebooks use the default name: B's KeyError is raised to B, never to A, and
    A's queued work is not cancelled by it."""
    with Client(cluster) as other:
        a = dd.Coordinator(client, name="shared")
        b = dd.Coordinator(other, name="shared")
        try:
            wait_for_workers(client, a, 2)
            bad = b.schedule(lookup, args=("b",))
            assert isinstance(bad.exception(timeout=30), KeyError)
            wait_until(lambda: a.status()["error_pending"], 10, "B's error to be pending")
            mine = [a.schedule(square, args=(i,)) for i in range(20)]
            a.join(timeout=60)  # B's error is not A's
            assert a.fetch(mine) == [i * i for i in range(20)]
            assert a.done()
            with pytest.raises(KeyError):
                b.join(timeout=60)
            assert b.schedule(square, args=(3,)).fetch(timeout=30) == 9
        finally:
            b.close()
            a.close()
