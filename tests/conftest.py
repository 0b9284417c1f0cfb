"""Shared fixtures: real LocalClusters with worker processes, and condition waits."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dask
import pytest
from hypothesis import settings

from tests.processes import quiet_environ, use_fork_server

# A LocalCluster closes a Nanny whose worker has not come back within this time; tests
# kill the same worker repeatedly (poison pills) on a loaded machine, so give it room.
dask.config.set({"distributed.deploy.lost-worker-timeout": "600s"})

# property tests assert what comes out, never how long an example took: no per-example
# deadline (on a loaded 2-core machine any example can stall past hypothesis's 200 ms)
settings.register_profile("daskdist", deadline=None)
settings.load_profile("daskdist")

# worker processes fork from a warm server (tests/processes.py), Lightning imported too
# (4-5 s of imports a worker otherwise)
use_fork_server("lightning.pytorch")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(*first: str, **extra: str) -> dict[str, str]:
    """This environment for a child Python process that imports daskdist (and the
    tests) from this checkout: the checkout, then ``first``, ahead of the PYTHONPATH we
    have (where Dask itself may come from, as on the GPU machine), plus ``extra``."""
    path = os.pathsep.join([ROOT, *first, *filter(None, [os.environ.get("PYTHONPATH")])])
    # its Dask as quiet as ours (tests/processes.py)
    return {**os.environ, "PYTHONPATH": path, **quiet_environ(), **extra}


def wait_until(pred: Callable[[], object], timeout: float = 30.0, what: str = "condition",
               interval: float = 0.02, longest: float = 0.1):
    """Poll ``pred`` until it is truthy; fail the test after ``timeout`` seconds. The
    interval grows from ``interval`` to ``longest``: a quick condition is seen at once,
    and a long wait (a predicate that asks every worker) costs the machine little."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
        interval = min(longest, interval * 1.5)


def take_rows(it, seconds: float = 0.0) -> list[int]:
    """A closure: one batch's ``rid`` column (row ids); ``[]`` when no unleased rows
    remain right now. ``seconds`` of work after taking it, so closures overlap."""
    try:
        batch = next(it)
    except StopIteration:
        return []
    time.sleep(seconds)
    return batch["rid"].tolist()


def make_cluster(n_workers: int = 2, threads: int = 1, **kwargs):
    from distributed import LocalCluster

    kwargs.setdefault("dashboard_address", None)
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=threads,
        processes=True,
        silence_logs=logging.ERROR,
        **kwargs,
    )


def worker_pids(client) -> dict[str, int]:
    """Worker address -> pid, skipping workers that died but are not yet removed."""
    return client.run(os.getpid, on_error="ignore")


def sigkill(pid: int) -> float:
    """SIGKILL a worker process; returns the time of the kill."""
    t = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return t


def wait_for_workers(client, coord, n: int, timeout: float = 60.0,
                     gone: int | None = None) -> None:
    """Wait until ``n`` live workers (none with pid ``gone``) have all joined ``coord``
    and built its per-worker resources (none still warming)."""
    def ready():
        pids = worker_pids(client)
        if not (len(pids) >= n and gone not in pids.values()
                and len(client.scheduler_info(n_workers=-1)["workers"]) == len(pids)):
            return False
        status = coord.status()
        return status["workers"] - status["warming"] >= n

    wait_until(ready, timeout, f"{n} workers")


def route(co, op: str):
    """Route ``op`` of coordinator state ``co`` as the scheduler plugin registers it (its
    caller checked first), called with keyword arguments."""
    from daskdist.core import protocol
    from daskdist.plugins.scheduler.plugin import BOOK_ROUTES

    for book, table in BOOK_ROUTES.items():
        if op in table:
            handler = protocol.book_handler({co.name: co}, book, op, table[op])
            return lambda **kw: handler(name=co.name, **kw)
    raise KeyError(op)


def live_session(client, name: str) -> str:
    """A worker's live session of coordinator ``name`` (to call its routes as it)."""
    from daskdist.core.protocol import worker_plugin_name

    sessions = client.run(lambda dask_worker: dask_worker.plugins[
        worker_plugin_name(name)].runner.session_id)
    return sorted(sessions.values())[0]


def kill_and_replace(client, coord, pid: int, n: int = 2) -> float:
    """SIGKILL worker ``pid`` and wait until its nanny's replacement joined ``coord``."""
    t = sigkill(pid)
    wait_for_workers(client, coord, n, gone=pid)
    return t


@pytest.fixture
def tmp(tmp_path) -> Path:
    """An empty directory for a command's files and its ``TMPDIR`` (the CLI tests)."""
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


@pytest.fixture(scope="module")
def threads() -> int:
    """Threads per worker of the module's ``cluster``; a module that must hold at any
    thread count overrides this with ``params=[1, 2]`` (see ``THREADS``)."""
    return 1


THREADS = [1, 2]  # the thread counts a guarantee is tested at (Dask's default is cores/workers)


@pytest.fixture(scope="module")
def cluster(threads):
    with make_cluster(2, threads=threads) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    from distributed import Client

    with Client(cluster) as c:
        yield c


@pytest.fixture
def coord(client, request):
    """A Coordinator with a queue of its own (named after the test)."""
    import daskdist as dd

    co = dd.Coordinator(client, name=request.node.name)
    wait_for_workers(client, co, 2)
    yield co
    co.close()


@contextlib.contextmanager
def gpu_and_plain_cluster(threads: int = 2) -> Iterator[tuple]:
    """Two workers declaring the Dask resource ``GPU=1`` and one plain worker (worker
    processes, ``threads`` each): ``(cluster, client, members, plain)``, the two GPU
    workers' addresses and the plain one's."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    gpu = {"cls": Nanny, "options": {"nthreads": threads, "resources": {"GPU": 1},
                                     "silence_logs": logging.ERROR}}
    plain = {"cls": Nanny, "options": {"nthreads": threads, "silence_logs": logging.ERROR}}
    spec = {"gpu-a": gpu, "gpu-b": gpu, "cpu": plain}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    with SpecCluster(workers=spec, scheduler=scheduler, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(3)
        info = client.scheduler_info()["workers"]
        members = {a for a, w in info.items() if w.get("resources", {}).get("GPU")}
        (cpu,) = set(info) - members
        yield cluster, client, members, cpu


def pytest_collection_modifyitems(config, items) -> None:
    """Files with the most ``slow`` tests first, then the files with the most tests:
    ``scripts/dev.sh test`` hands whole files to its processes in this order (xdist's
    ``--dist loadfile --no-loadscope-reorder``), so the longest start at once instead
    of ending the run alone on one process."""
    slow: dict[object, int] = {}
    size: dict[object, int] = {}
    for item in items:
        may = item.get_closest_marker("may_rerun")
        if may is not None:  # one more try, for the reason it names (pytest-rerunfailures)
            if not (may.kwargs.get("reason") or may.args):
                raise pytest.UsageError(f"{item.nodeid}: may_rerun needs reason='why'")
            item.add_marker(pytest.mark.flaky(reruns=1))
        size[item.path] = size.get(item.path, 0) + 1
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: (-slow[item.path], -size[item.path]))  # stable in a file
