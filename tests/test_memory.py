"""Bounded scheduler memory: per-worker resources are released when their
client-side handle is garbage collected, never while a closure may still use them."""

from __future__ import annotations

import gc
import time

from daskdist.core.protocol import worker_plugin_name
from tests.conftest import wait_until


def numbers(ctx):
    return list(range(1000))


def take(it, seconds=0.0):
    time.sleep(seconds)
    return next(it)


def registry_sizes(client, name):
    def size(dask_worker, name=name):
        return len(dask_worker.plugins[worker_plugin_name(name)].runner.resources)

    return sorted(client.run(size).values())


def test_iterators_released_when_dropped_and_not_before(coord, client):
    ds = coord.create_per_worker_dataset(numbers)
    for _ in range(5):
        it = iter(ds)
        assert coord.fetch([coord.schedule(take, args=(it,)) for _ in range(4)])
    # a handle dropped while its closure is still queued: the closure still runs
    slow = coord.schedule(take, args=(iter(ds), 1.0))
    gc.collect()
    coord._release_now()
    assert slow.fetch(timeout=60) == 0
    del it
    gc.collect()
    coord._release_now()
    status = coord.status()
    assert status["resources"] == 1  # the dataset; its 6 iterators are gone
    assert status["resources_released"] == 6
    wait_until(lambda: max(registry_sizes(client, coord.name)) <= 1, 30,
               "the workers to drop their iterators")
    # the dataset still works
    assert coord.schedule(take, args=(iter(ds),)).fetch(timeout=60) == 0


def test_iterator_keeps_its_dataset_alive(coord, client):
    it = iter(coord.create_per_worker_dataset(numbers))  # the dataset object is dropped
    gc.collect()
    coord._release_now()
    assert coord.status()["resources"] == 2
    got = sorted(coord.fetch([coord.schedule(take, args=(it,)) for _ in range(2)]))
    assert got in ([0, 0], [0, 1])  # each worker builds the dataset, then the iterator
