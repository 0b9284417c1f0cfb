"""Gangs and elastic States over a day of real use (SPEC §4.2), on one
module-scoped LocalCluster of 3 worker processes with 2 threads each and gloo groups:

- a second State trains after the first on the same group (commit keys unique per State);
- a user error on one rank (not rank 0) fails the gang at once with that error, the
  peers' collective calls raise ``CollectiveError`` saying why, and the group runs the
  next gang;
- Horovod's pattern: a commit refused because one rank's worker event loop stalled past
  the group timeout (its part came late: the open commit expired), every rank catches
  ``CollectiveError``, ``restore()``s and goes on in the same generation;
- every member lost at once after commits: ``sync()`` on the replacements raises
  instead of starting afresh (the last test: it kills the module's workers).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from distributed import Client

import daskdist as dd
from tests.conftest import make_cluster, sigkill, wait_for_workers, wait_until
from tests.row_ledger import assert_every_row_once, final_counts, make_counts, train_rows

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]


@pytest.fixture(scope="module")
def cluster3():
    with make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        yield cluster, client


@pytest.fixture
def coord3(cluster3, request):
    _cluster, client = cluster3
    coord = dd.Coordinator(client, name=request.node.name)
    wait_for_workers(client, coord, 3)
    yield client, coord
    coord.close()


def _write_rows(root: Path, n: int, files: int = 3, row_group: int = 100) -> str:
    """``n`` rows with ids ``0 .. n-1`` in ``files`` Parquet files (a unit per row group)."""
    root.mkdir(parents=True, exist_ok=True)
    per = n // files
    for f in range(files):
        ids = np.arange(f * per, (f + 1) * per, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), root / f"p{f}.parquet", row_group_size=row_group)
    return str(root / "*.parquet")


def _assert_every_row_once(coord, state, n):
    assert_every_row_once(coord.fetch(coord.schedule_on_all(final_counts, args=(state,))), n)


def _train_until_complete(coord, ds, state, it, n, gangs=20):
    for _ in range(gangs):
        if ds.progress()["complete"]:
            break
        coord.fetch(coord.schedule_on_all(train_rows, args=(state, it)))
    return ds.progress()


def test_a_second_state_trains_after_the_first_on_the_same_group(coord3, tmp_path):
    """A sweep: two States, one after the other, on one group generation. The second's
    commits must acknowledge its own rows (its keys never meet the first's)."""
    _client, coord = coord3
    n = 1500
    group = coord.collective_group(timeout=30)
    for trial in range(2):
        data = _write_rows(tmp_path / f"trial{trial}", n)
        state = coord.create_per_worker_resource(functools.partial(make_counts, n=n))
        ds = coord.distribute_dataset(data, global_batch_size=60, policy="dynamic",
                                      shuffle=True, seed=trial, prefetch=0,
                                      name=f"trial{trial}")
        it = iter(ds)
        p = _train_until_complete(coord, ds, state, it, n)
        assert p["complete"] and p["acknowledged"] == n and p["leased"] == 0, (trial, p)
        _assert_every_row_once(coord, state, n)
    assert coord.status()["group_generation"] == group.generation  # one generation


# -- a user error on one rank ------------------------------------------------------------


def step_or_raise(log, bad_rank, at):
    """Steps of one allreduce each; rank ``bad_rank`` raises a user error at step ``at``."""
    g = dd.collective.get_group()
    for i in range(100_000):
        if g.rank == bad_rank and i == at:
            log.append(("raised", time.time(), g.generation))
            raise KeyError("no such column: 'label'")
        t = torch.ones(1)
        try:
            g.allreduce(t)
        except dd.CollectiveError as e:
            log.append(("collective-error", time.time(), str(e)))
            raise
        time.sleep(0.005)
    return "done"


def read_log(log):
    g = dd.collective.get_group()
    t = torch.ones(1)
    g.allreduce(t)
    return list(log), g.generation, t.item()


def test_a_user_error_on_one_rank_fails_the_gang_at_once(coord3):
    _client, coord = coord3
    group = coord.collective_group(timeout=60)
    log = coord.create_per_worker_resource(lambda ctx: [])
    gang = coord.schedule_on_all(step_or_raise, args=(log, 1, 20))
    with pytest.raises(KeyError, match="no such column"):
        coord.fetch(gang)
    t_fetch = time.time()
    with pytest.raises(KeyError):  # TensorFlow's semantics: join raises it once too
        coord.join()
    # the group runs the next gang (re-formed: its members abandoned a generation)
    out = coord.fetch(coord.schedule_on_all(read_log, args=(log,)))
    assert [o[2] for o in out] == [3.0, 3.0, 3.0]
    assert all(o[1] > group.generation for o in out)
    entries = [e for o in out for e in o[0]]
    raised = [e for e in entries if e[0] == "raised"]
    assert len(raised) == 1, entries  # ran once: never a retry loop
    told = [e for e in entries if e[0] == "collective-error"]
    assert len(told) == 2, entries  # both peers' calls raised
    for _, _t, msg in told:
        assert "rank 1" in msg and "timed out" not in msg, msg
    t_raise = raised[0][1]
    print(f"user error on rank 1 -> peers' CollectiveError: "
          f"{max(t for _, t, _ in told) - t_raise:.3f} s; -> fetch raised: "
          f"{t_fetch - t_raise:.3f} s (group timeout 60 s)")


# -- Horovod's pattern: catch CollectiveError, restore(), go on -----------------------------

# rank 0 waits half the group timeout for the stalled commit's reply, then every rank
# raises; its restore() waits out the rest of the stall while the peers wait in the
# next allreduce: both under the group timeout
STALL_AT, STALL_S, GROUP_TIMEOUT = 5, 3.0, 3.0


def _stall_event_loop(seconds):
    """Block this worker's event loop for ``seconds`` (as a long GC pause or a huge
    unpickle would): the scheduler RPCs of its closures wait meanwhile."""
    from distributed import Worker

    worker = next(iter(Worker._instances))
    worker.loop.add_callback(time.sleep, seconds)


def train_horovod(state, it, n):
    """A commit that fails (``CollectiveError``) is caught: ``restore()`` and go on."""
    g = dd.collective.get_group()
    state.sync()
    caught = steps = 0
    for batch in dd.collective.synced(it):
        c = torch.bincount(batch["id"], minlength=n).to(torch.float64)
        g.allreduce(c)
        state.counts += c.to(state.counts.device)
        steps += 1
        if steps == STALL_AT and g.rank == 0:
            # this commit reaches the scheduler late: rank 0 sends every rank's part in
            # one message; its reply misses the next commit, every rank raises, and the
            # other ranks' restore() asks the scheduler, which refuses it for good
            _stall_event_loop(STALL_S)
        try:
            state.commit()
        except dd.CollectiveError:
            caught += 1
            state.restore()
            if caught > 10:
                break
    return caught, g.generation


def test_horovod_pattern_restore_after_a_refused_commit_goes_on(coord3, tmp_path):
    _client, coord = coord3
    n = 6000
    data = _write_rows(tmp_path, n, files=6, row_group=1000)  # no new lease near the stall
    group = coord.collective_group(timeout=GROUP_TIMEOUT)
    state = coord.create_per_worker_resource(functools.partial(make_counts, n=n))
    ds = coord.distribute_dataset(data, global_batch_size=30, policy="dynamic",
                                  shuffle=False, prefetch=0, name="horovod")
    it = iter(ds)
    out = coord.fetch(coord.schedule_on_all(train_horovod, args=(state, it, n)))
    assert [o[1] for o in out] == [group.generation] * 3  # the same generation throughout
    caught = {o[0] for o in out}
    assert len(caught) == 1 and 1 <= caught.pop() <= 2, out  # refused once, then on
    # the epoch's tail (leases shrink toward a batch as the pool runs low) may end a
    # synced gang with rows still leased to a rank: the driver's loop runs another
    while not ds.progress()["complete"]:
        more = coord.fetch(coord.schedule_on_all(train_horovod, args=(state, it, n)))
        assert {o[0] for o in more} == {0}, more  # nothing refused once the stall is over
    p = ds.progress()
    assert p["complete"] and p["acknowledged"] == n, p
    _assert_every_row_once(coord, state, n)


# -- every member lost at once (last: it kills the module's workers) -------------------------


def test_all_members_lost_sync_raises_instead_of_a_fresh_start(coord3, tmp_path):
    client, coord = coord3
    n = 3000
    data = _write_rows(tmp_path, n)
    coord.collective_group(timeout=30)
    state = coord.create_per_worker_resource(functools.partial(make_counts, n=n))
    ds = coord.distribute_dataset(data, global_batch_size=30, policy="dynamic",
                                  shuffle=True, seed=1, prefetch=0, name="all-lost")
    it = iter(ds)
    killed: list[int] = []

    def kill_all_after_commits():
        wait_until(lambda: ds.progress()["acknowledged"] >= 300, 120, "committed rows")
        pids = list(client.run(os.getpid, on_error="ignore").values())
        for pid in pids:
            sigkill(pid)
            killed.append(pid)

    killer = threading.Thread(target=kill_all_after_commits, daemon=True)
    killer.start()
    with pytest.raises(dd.CollectiveError, match="no member holds the committed state"):
        for _ in range(20):
            if ds.progress()["complete"]:
                break
            coord.fetch(coord.schedule_on_all(train_rows, args=(state, it, 0.02)))
    killer.join(60)
    assert len(killed) == 3
    acknowledged = ds.progress()["acknowledged"]
    assert 300 <= acknowledged < n  # the lost commits' rows stay acknowledged
    wait_for_workers(client, coord, 3, gone=killed[-1])
