"""Shared fixtures: real LocalClusters with worker processes, and condition waits."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator

import dask
import pytest

# A LocalCluster closes a Nanny whose worker has not come back within this time; tests
# kill the same worker repeatedly (poison pills) on a loaded machine, so give it room.
dask.config.set({"distributed.deploy.lost-worker-timeout": "600s"})

# Worker processes start from a fork server that imported Dask, torch and daskdist once
# (Dask's own test suite does the same): a worker, or a Nanny's replacement after a
# SIGKILL, is up in a fraction of the time a spawned interpreter takes to import torch.
# Importing creates no CUDA context, so a worker still binds the GPU it is given.
dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
# Lightning too (4-5 s of imports a worker otherwise); a module not installed is skipped.
_PRELOAD = ["distributed", "dask", "numpy", "pandas", "pyarrow", "torch", "daskdist",
            "daskdist.plugins.worker.plugin", "daskdist.data", "daskdist.collective",
            "lightning.pytorch"]


def _preload_fork_server() -> None:
    from distributed.utils import get_mp_context

    get_mp_context().set_forkserver_preload(_PRELOAD)


_preload_fork_server()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(*first: str, **extra: str) -> dict[str, str]:
    """This environment for a child Python process that imports daskdist (and the
    tests) from this checkout: the checkout, then ``first``, ahead of the PYTHONPATH we
    have (where Dask itself may come from, as on the GPU machine), plus ``extra``."""
    path = os.pathsep.join([ROOT, *first, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def wait_until(pred: Callable[[], object], timeout: float = 30.0, what: str = "condition",
               interval: float = 0.02):
    """Poll ``pred`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


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
