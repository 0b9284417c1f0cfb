"""The files a closure's path runs code in, counted by tracing it.

docs/architecture.md names every file a path crosses; this traces one closure from
``schedule`` to ``fetch`` through the client, the scheduler and two workers of two
threads (``path_trace.py``) and holds it to its 10 files, and a closure taking a dynamic
batch to those and its 11 more. The trace sees every thread and event loop of each
process, so the processes' own timers (:data:`TIMERS`), which run whatever the closure
does, are left out of the count; on a loaded machine a trace is long enough to meet them.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import path_trace
import pytest
from conftest import make_cluster
from distributed import Client

import daskdist as dd

RUNS = 5
# the timers of the processes a closure crosses: the scheduler's liveness sweep (its
# plugin, the coordinator state, the config it reads) and metrics sample; a worker's
# session lease renewal and the preemption handler's upkeep
TIMERS = {"plugins/scheduler/plugin.py", "plugins/scheduler/state.py", "config.py",
          "plugins/scheduler/web/pages.py", "plugins/worker/services.py",
          "plugins/worker/preemption.py"}
CLOSURE_PATH = {"client/closures.py", "session/scope.py", "session/resources.py",
                "session/counters.py", "core/membership.py", "core/nest.py",
                "core/protocol.py", "core/queue.py", "plugins/scheduler/closures.py",
                "plugins/worker/runner.py"}


def _noop(x=None):
    return x


def _start(client: Client) -> None:
    client.run(path_trace.start)
    client.run_on_scheduler(path_trace.start)
    path_trace.start()


def _stop(client: Client) -> set[str]:
    files = set(path_trace.stop())
    for seen in client.run(path_trace.stop).values():
        files.update(seen)
    files.update(client.run_on_scheduler(path_trace.stop))
    return files


@contextlib.contextmanager
def tracing(client: Client):
    """The profile hook on every thread of this process, the scheduler and the workers,
    from before the Coordinator is made until the test is done."""
    client.run(path_trace.install)
    client.run_on_scheduler(path_trace.install)
    client.sync(path_trace.install_async)
    path_trace.install()
    try:
        yield
    finally:
        path_trace.uninstall()
        client.run(path_trace.uninstall)
        client.run_on_scheduler(path_trace.uninstall)


def traced_files(client: Client, coord: dd.Coordinator, once) -> tuple[list[str], Counter]:
    """The files ``once()`` runs code in, in most of :data:`RUNS` traces; every file
    seen, with the number of traces that saw it."""
    counts: Counter = Counter()
    for _ in range(RUNS):
        _start(client)
        try:
            once()
        finally:
            counts.update(_stop(client))
    return sorted(f for f, n in counts.items() if n > RUNS // 2 and f not in TIMERS), counts


@pytest.mark.timeout(180)
def test_a_closure_crosses_at_most_ten_files():
    with make_cluster(n_workers=2, threads=2) as cluster, Client(cluster) as client, \
            tracing(client), dd.Coordinator(client, name="paths") as coord:
        coord.fetch([coord.schedule(_noop, args=(i,)) for i in range(20)])  # warm
        files, counts = traced_files(
            client, coord, lambda: coord.fetch(coord.schedule(_noop, args=(1,))))
    print("closure path:", files, "seen:", dict(counts))
    assert "client/closures.py" in files and "core/queue.py" in files, counts
    assert len(files) <= 10, f"a closure runs code in {len(files)} files: {files} ({counts})"
    assert set(files) <= CLOSURE_PATH, sorted(set(files) - CLOSURE_PATH)


def _take(it):
    return len(next(it)["x"])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# beyond the closure's files, a batch of a dynamic dataset crosses only these: the loader
# (cut, convert, the rows held, the leased pass), the lease table (the table, its datasets'
# index, the epoch's pools, intervals), the dashboard's row count and the phase timer
BATCH_PATH = {"data/loader.py", "data/batching.py", "data/convert.py", "data/leased/held.py",
              "data/leased/passes.py", "core/leases/table.py", "core/leases/datasets.py",
              "core/leases/epochs.py", "core/intervals.py", "plugins/scheduler/stats.py",
              "observe/phases.py", "session/tokens.py"}
# a lease asked for ahead: the scheduler's route, the table's acquire, the reads
LEASE_AHEAD = {"plugins/scheduler/datasets.py", "plugins/scheduler/locality.py",
               "core/leases/tail.py", "core/leases/units.py", "data/files/source.py"}


@pytest.mark.timeout(180)
def test_a_dynamic_batch_path(tmp_path):
    """A closure taking one batch of a dynamic dataset (read from its worker's lease,
    acknowledged with its result): the closure's 10 files and 12 more, each named (the
    loader's 5, the lease table's 4, the dashboard's row count, the phase timer), as
    docs/architecture.md lists them; the lease was acquired ahead, while the warm-up ran."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in range(4):
        x = np.arange(f * 4000, (f + 1) * 4000, dtype=np.float32)
        pq.write_table(pa.table({"x": x}), tmp_path / f"p{f}.parquet", row_group_size=500)
    with make_cluster(n_workers=2, threads=2) as cluster, Client(cluster) as client, \
            tracing(client), dd.Coordinator(client, name="lease-path") as coord:
        ds = coord.distribute_dataset(str(tmp_path / "*.parquet"), global_batch_size=64,
                                      policy="dynamic")
        it = iter(ds)
        assert sum(coord.fetch([coord.schedule(_take, args=(it,))
                                for _ in range(4)])) == 4 * 32  # warm
        files, counts = traced_files(
            client, coord, lambda: coord.fetch(coord.schedule(_take, args=(it,))))
        cuda = any(client.run(_has_cuda).values())
    print("dynamic batch path:", files, "seen:", dict(counts))
    assert "core/leases/table.py" in files and "plugins/scheduler/stats.py" in files, counts
    extra = sorted(set(files) - CLOSURE_PATH)
    print("beyond the closure path:", len(extra), extra)
    # a worker with a GPU copies its batches to its device there: data/staging.py more;
    # on a loaded machine the reply to the lease asked for ahead may land during the
    # traced batch: its own files then, and only those
    allowed = BATCH_PATH | ({"data/staging.py"} if cuda else set())
    if "plugins/scheduler/datasets.py" in extra:
        allowed |= LEASE_AHEAD
    assert set(extra) <= allowed, sorted(set(extra) - allowed)
