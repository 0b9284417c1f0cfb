"""A coordinator's close ends every wait and frees what it held (SPEC
§2.5b), on a real LocalCluster with worker processes and 2 threads per worker."""

from __future__ import annotations

import glob
import os
import threading
import time
import uuid

import dask
import psutil
import pytest
from distributed import Client

import daskdist as dd
from daskdist.core.protocol import worker_plugin_name
from tests.conftest import wait_for_workers, wait_until


@pytest.fixture(scope="module")
def threads() -> int:
    return 2


def square(x):
    return x * x


def numbers(ctx):
    return list(range(1000))


def big(ctx, mb=1):
    return bytearray(b"x") * (mb * 2**20)  # resident at once (not calloc'd zeros)


def started(gate):
    """Say when a closure started (a file beside ``gate`` holding the wall time)."""
    with open(f"{gate}.started.{uuid.uuid4().hex}", "w") as f:
        f.write(repr(time.time()))


def use_and_wait(res, it, gate, timeout=120.0):
    """Touches the per-worker resource and iterator, then runs until ``gate`` exists."""
    started(gate)
    len(res)
    next(it)
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getpid()


def wait_for(gate, timeout=120.0):
    started(gate)
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


def use(res):
    return os.getpid(), len(res)


def registry(client, name):
    """Per worker: the rids its session holds for coordinator ``name`` (``None``: its
    worker plugin is gone)."""
    def rids(dask_worker, name=name):
        plugin = dask_worker.plugins.get(worker_plugin_name(name))
        if plugin is None or plugin.runner is None or plugin.runner.resources is None:
            return None
        return sorted(plugin.runner.resources._objects)

    return list(client.run(rids).values())


def threads_of(client, name):
    """Per worker: its live threads of coordinator ``name``'s runner."""
    def names(name=name):
        return sorted(t.name for t in threading.enumerate()
                      if t.name.startswith((f"daskdist-{name}", f"daskdist-gang-{name}")))

    return list(client.run(names).values())


def scheduler_has(client, name):
    return client.run_on_scheduler(
        lambda dask_scheduler, name=name: name in dask_scheduler.extensions["daskdist"]
        .coordinators)


def test_close_ends_every_wait_and_releases_the_owners_resources(client, tmp_path):
    name = "closing"
    keep = dd.Coordinator(client, name=name)  # another notebook on the same name
    coord = dd.Coordinator(client, name=name)
    gate = str(tmp_path / "gate")
    try:
        wait_for_workers(client, coord, 2)
        kept = keep.create_per_worker_resource(big)
        assert len({pid for pid, _ in keep.fetch(
            [keep.schedule(use, args=(kept,)) for _ in range(8)])}) >= 1
        res = coord.create_per_worker_resource(big)
        it = iter(coord.create_per_worker_dataset(numbers))
        finished = coord.schedule(square, args=(3,))
        assert finished.fetch(timeout=30) == 9
        running = [coord.schedule(use_and_wait, args=(res, it, gate)) for _ in range(4)]
        queued = [coord.schedule(wait_for, args=(gate,)) for i in range(20)]
        # closures run holding the owner's resource, dataset and iterator
        mine = {res.rid, it.rid, it.parent.rid}
        wait_until(lambda: any(r and mine <= set(r) for r in registry(client, name)), 60,
                   "the owner's resources built")
        with_kept = [r is not None and kept.rid in r for r in registry(client, name)]

        joined: list = []

        def join():
            try:
                coord.join()
            except BaseException as e:  # noqa: BLE001 - what the waiting join raised
                joined.append(e)

        joiner = threading.Thread(target=join)
        joiner.start()
        closed_at = time.time()
        coord.close()
        joiner.join(60)
        assert not joiner.is_alive() and isinstance(joined[0], dd.CoordinatorClosedError)
        for rv in running + queued:
            assert rv.done()  # at once: no wait
            with pytest.raises(dd.CancelledError, match="closed"):
                rv.fetch(timeout=0)
        assert finished.fetch(timeout=0) == 9  # finished before the close: its value
        with pytest.raises(dd.CancelledError, match="closed"):
            coord.fetch(running)
        with pytest.raises(RuntimeError, match="closed"):
            coord.schedule(square, args=(1,))
        with pytest.raises(dd.CoordinatorClosedError):
            coord.join(timeout=1)
        # its resources and iterators went on every worker; the other owner's stay
        wait_until(lambda: [r is not None and kept.rid in r and not mine & set(r)
                            for r in registry(client, name)] == with_kept, 30,
                   "resources released")
        open(gate, "w").close()  # the closures running at the close finish now
        assert keep.fetch([keep.schedule(use, args=(kept,)) for _ in range(8)])
        keep.join(timeout=30)  # the other owner saw no error, no cancellation
        # nothing of the closed owner started after the close (prefetched ones went back)
        wait_until(lambda: keep.status()["running"] == 0, 30, "the closed owner's last runs")
        starts = [float(open(p).read()) for p in glob.glob(f"{gate}.started.*")]
        assert len(starts) >= 1 and max(starts) < closed_at
    finally:
        open(gate, "w").close()
        coord.close()
        keep.close()
    # no coordinator of the name is left: its queue and plugin are gone when the last
    # close() returns (a cluster closed right after has no plugin left to race with),
    # its threads go after
    assert not scheduler_has(client, name)
    assert registry(client, name) == [None, None]
    wait_until(lambda: threads_of(client, name) == [[], []], 60, "its threads gone")
    # and nothing kept per name on the scheduler: the lock of a name's life goes too
    assert client.run_on_scheduler(
        lambda dask_scheduler: name in dask_scheduler.extensions["daskdist"].names._life) \
        is False


def test_a_client_gone_for_client_grace_frees_its_owner(cluster, client):
    """A kernel that dies without close(): after client-grace its owner is dropped like
    a close, its resources freed on the workers and the name's plugin removed."""
    name = "gone"
    with dask.config.set({"daskdist.coordinator.client-grace": "200ms"}):
        other = Client(cluster)
        coord = dd.Coordinator(other, name=name)
        wait_for_workers(other, coord, 2)
        res = coord.create_per_worker_resource(big)
        wait_until(lambda: on_both_workers(coord, res), 60, "built twice")
        other.close()  # no coord.close(): the kernel died
        wait_until(lambda: not scheduler_has(client, name), 30, "the owner to be dropped")
        wait_until(lambda: registry(client, name) == [None, None], 30, "the plugin gone")


def worker_rss(client) -> dict[str, int]:
    return client.run(lambda: psutil.Process().memory_info().rss)


def on_both_workers(coord, res) -> bool:
    """Run closures using ``res`` until both workers have built it."""
    return len({pid for pid, _ in coord.fetch(
        [coord.schedule(use, args=(res,)) for _ in range(4)])}) == 2


def test_restarting_the_kernel_with_close_frees_worker_memory(cluster, client):
    """Five fresh clients (a restarted kernel each), each with a 64 MB per-worker
    resource and close(): worker memory comes back each time (not +64 MB a cycle)."""
    mb = 64
    rss = [worker_rss(client)]
    for _ in range(5):
        with Client(cluster) as kernel:
            coord = dd.Coordinator(kernel)  # the default name, as a notebook would
            res = coord.create_per_worker_resource(lambda ctx, mb=mb: big(ctx, mb))
            wait_until(lambda c=coord, r=res: on_both_workers(c, r), 60, "built twice")
            coord.close()
        wait_until(lambda: registry(client, "default") == [None, None], 30, "plugin gone")
        rss.append(worker_rss(client))
    print("worker RSS (MB) over 5 create/close cycles:",
          [[round(cycle[w] / 2**20) for w in sorted(cycle)] for cycle in rss])
    growth = {w: (rss[-1][w] - rss[0][w]) / 2**20 for w in rss[0]}
    assert max(growth.values()) < 2 * mb, growth
