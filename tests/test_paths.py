"""The files an event's path runs code in, counted by tracing it.

docs/architecture.md walks four paths through the code and names every file each one
crosses; this traces them (``path_trace.py``: one event at a time, in the client, the
scheduler and every worker) and holds each to exactly those files:

- a closure from ``schedule`` to ``fetch``;
- a closure taking one batch of a dynamic dataset, served from a block already read and
  crossing into the next block of its lease;
- a synced step of a gang with a commit (``State``, ``synced``, ``allreduce_gradients``);
- a re-formation: a member of a gang of three SIGKILLed, to the survivors' first step in
  the new group.

The walks' ``Files`` lines in docs/architecture.md are held to the same sets.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import dask
import path_trace
import pytest
from conftest import make_cluster, sigkill, wait_until
from distributed import Client

import daskdist as dd

CLOSURE_PATH = {"client/closures.py", "core/checks.py", "core/membership.py", "core/nest.py",
                "core/protocol.py", "core/queue.py", "plugins/scheduler/closures.py",
                "plugins/scheduler/polls.py", "plugins/worker/runner.py",
                "session/counters.py", "session/resources.py", "session/scope.py"}


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
def traced_cluster(n_workers: int, threads: int, **config):
    """A cluster under :data:`path_trace.QUIET` (and ``config``), the profile hook on
    every thread of this process, the scheduler and the workers from before the
    Coordinator is made until the test is done: ``(cluster, client)``."""
    with dask.config.set({**path_trace.QUIET, **config}), \
            make_cluster(n_workers=n_workers, threads=threads) as cluster, \
            Client(cluster) as client:
        client.run(path_trace.install)
        client.run_on_scheduler(path_trace.install)
        client.sync(path_trace.install_async)
        path_trace.install()
        try:
            yield cluster, client
        finally:
            path_trace.uninstall()
            client.run(path_trace.uninstall)
            client.run_on_scheduler(path_trace.uninstall)


def trace(client: Client, event) -> set[str]:
    """The files ``event()`` runs code in, in every process."""
    _start(client)
    try:
        event()
    finally:
        files = _stop(client)
    return files


def test_the_periodic_roots_are_the_processes_timers():
    """The hook pauses beneath the package's timer loops, read from the tree: the
    scheduler's liveness sweep, a session's renewal, the preemption handler's upkeep and
    a rank's window reports; never beneath the loops an event runs through (a worker's
    pull loop, the group driver's pump, the client's results loop)."""
    roots = {f"{file}:{name}" for file, name in path_trace.periodic_roots()}
    assert {"plugins/scheduler/plugin.py:CoordinatorPlugin._expire_loop",
            "plugins/worker/preemption.py:PreemptionNotice._keep",
            "observe/recorder.py:WindowReporter._loop"} <= roots, roots
    assert any(r.endswith("._renew_loop") for r in roots), roots
    assert not roots & {"plugins/worker/runner.py:ClosureRunner._loop",
                        "plugins/scheduler/groups.py:GroupDriver._pump",
                        "client/closures.py:ClosureClient._results_loop"}, roots


@pytest.mark.timeout(120)
def test_a_closure_path():
    """Two workers of two threads, warm: one closure, ``schedule`` to ``fetch``."""
    with traced_cluster(2, 2) as (_, client), dd.Coordinator(client, name="paths") as coord:
        coord.fetch([coord.schedule(_noop, args=(i,)) for i in range(20)])  # warm
        files = trace(client, lambda: coord.fetch(coord.schedule(_noop, args=(1,))))
    print("closure path:", len(files), sorted(files))
    assert files == CLOSURE_PATH, (sorted(files - CLOSURE_PATH), sorted(CLOSURE_PATH - files))


# -- a dynamic batch ----------------------------------------------------------------------
BATCH = 32  # rows a batch
BLOCK = 8 * BATCH  # a row group: a block, read whole
LEASE = 4 * BLOCK  # a lease: its blocks are read in order, the next lease asked ahead
# (a loader's first lease, before its pace is measured, is the least: a batch's block)
FILES, FILE_ROWS = 4, 16 * BLOCK

# beyond the closure's files, a batch from a block already read: the cut (loader,
# batching, convert), its rows handed to the closure (the leased pass, its holder, the
# closure's tokens) and acknowledged with its result (the lease table, its datasets,
# the epoch's pools, intervals), the dashboard's row count and the phase timer
BATCH_PATH = {"core/intervals.py", "core/leases/datasets.py", "core/leases/epochs.py",
              "core/leases/table.py", "data/batching.py", "data/convert.py",
              "data/leased/held.py", "data/leased/passes.py", "data/loader.py",
              "observe/phases.py", "plugins/scheduler/datasets.py",
              "plugins/scheduler/state.py", "plugins/scheduler/stats.py", "session/tokens.py"}
# and crossing into the next block of the lease: the feed runs the pass, which reads it
# (the source's unit reads, the Arrow file)
BLOCK_PATH = {"data/files/arrow.py", "data/files/source.py", "data/prefetch.py"}


def _take(it):
    """A closure: one batch's first row id."""
    return int(next(it)["x"][0])


def _write(tmp_path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in range(FILES):
        x = np.arange(f * FILE_ROWS, (f + 1) * FILE_ROWS, dtype=np.float32)
        pq.write_table(pa.table({"x": x}), tmp_path / f"p{f}.parquet", row_group_size=BLOCK)


@pytest.mark.timeout(120)
def test_a_dynamic_batch_path(tmp_path):
    """One worker of two threads (so the batch positions are known) reading row groups of
    8 batches, leased 4 at a time once its pace is measured (from its second batch here),
    with the loader's reads in the closure's thread (``prefetch=0``): in the second lease,
    a batch from the block read at its first batch, then the first batch of its second
    block."""
    _write(tmp_path)
    # leases of LEASE rows, each next one asked for as soon as one arrives (a lead and
    # a lease longer than this whole run), so the path is the same at any pace
    with traced_cluster(1, 2, **{"daskdist.data.lease-rows": LEASE,
                                 "daskdist.data.pace-span": 0,
                                 "daskdist.data.lease-seconds": "1h",
                                 "daskdist.data.lease-lead": "1h"}) as (_, client), \
            dd.Coordinator(client, name="lease-path") as coord:
        ds = coord.distribute_dataset(str(tmp_path / "*.parquet"), global_batch_size=BATCH,
                                      policy="dynamic", prefetch=0)
        it = iter(ds)

        def batch() -> int:
            return coord.fetch(coord.schedule(_take, args=(it,)))

        # the first lease (the least: one block), then the second's first two batches
        start = BLOCK // BATCH + 2
        assert [batch() for _ in range(start)] == [i * BATCH for i in range(start)]
        # the lease asked ahead when the second came is answered: 3 leases out
        wait_until(lambda: ds.progress()["free"] == FILES * FILE_ROWS - BLOCK - 2 * LEASE,
                   30, "the lease asked ahead")
        first: list[int] = []
        in_block = trace(client, lambda: first.append(batch()))
        assert first == [start * BATCH]
        for i in range(start + 1, 2 * BLOCK // BATCH):  # to the block's end
            assert batch() == i * BATCH
        crossing = trace(client, lambda: first.append(batch()))
        assert first[-1] == 2 * BLOCK  # the second lease's second block's first row
    print("a batch from a block read:", len(in_block), sorted(in_block))
    print("a batch crossing into the next block:", len(crossing), sorted(crossing))
    expected = CLOSURE_PATH | BATCH_PATH
    assert in_block == expected, (sorted(in_block - expected), sorted(expected - in_block))
    expected |= BLOCK_PATH
    assert crossing == expected, (sorted(crossing - expected), sorted(expected - crossing))


# -- a gang: a synced step, a re-formation ---------------------------------------------------
def _make_state(ctx):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    return dd.collective.State(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.01),
                               step=0)


def _gate(gates: str, step: int, generation: int, rank: int) -> None:
    """Where ``hold-<step>`` exists: say this rank got here (``at-<generation>-<step>-<rank>``,
    holding its pid) and wait for ``go-<step>-<rank>`` or ``go-<step>``."""
    d = Path(gates)
    if not (d / f"hold-{step}").exists():
        return
    at = d / f"at-{generation}-{step}-{rank}"
    (d / f"{at.name}.tmp").write_text(str(os.getpid()))
    os.replace(d / f"{at.name}.tmp", at)  # whole, as the test reads it
    deadline = time.monotonic() + 120
    while not ((d / f"go-{step}").exists() or (d / f"go-{step}-{rank}").exists()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go for step {step}")
        time.sleep(0.002)


def _train(state, it, gates: str, last: int) -> int:
    """A gang closure: synced steps of a dynamic dataset, the gradients allreduced, a
    commit every step, each step's end held where the test says (:func:`_gate`)."""
    g = dd.collective.get_group()
    state.sync()
    model, opt = state.model, state.optimizer
    for batch in dd.collective.synced(it):
        opt.zero_grad()
        model(batch["x"].unsqueeze(-1) / 1e4).pow(2).mean().backward()
        dd.collective.allreduce_gradients(model)
        opt.step()
        state.step += 1
        state.commit()
        _gate(gates, state.step, g.generation, g.rank)
        if state.step >= last:
            break
    return int(state.step)


def _at(gates: Path, step: int) -> dict[tuple[int, int], int]:
    """``(generation, rank) -> pid`` of the ranks held at ``step``."""
    out = {}
    for p in gates.glob(f"at-*-{step}-[0-9]"):
        _, generation, _, rank = p.name.split("-")
        out[int(generation), int(rank)] = int(p.read_text())
    return out


@contextlib.contextmanager
def gang_held_at_step_2(tmp_path: Path, members: int, threads: int, name: str, last: int):
    """A traced cluster of ``members`` workers running :func:`_train` as a gang over a
    dynamic dataset of 32-row batches a rank (:func:`_write`'s files, read in the
    closure's thread), every rank held after step 2's commit (and at step 3's), every
    rank's first lease out (the least, one block: its pace not measured yet) and no
    other asked (no reply is due): the traced steps read from that block. Yields ``(cluster, client,
    coord, gang, gates, held)``, ``held`` the ranks at step 2 (:func:`_at`)."""
    (tmp_path / "data").mkdir()
    _write(tmp_path / "data")
    gates = tmp_path / "gates"
    gates.mkdir()
    for step in (2, 3):
        (gates / f"hold-{step}").touch()
    with traced_cluster(members, threads, **{"daskdist.data.lease-rows": LEASE}) as \
            (cluster, client), dd.Coordinator(client, name=name) as coord:
        ds = coord.distribute_dataset(str(tmp_path / "data" / "*.parquet"),
                                      global_batch_size=BATCH * members, policy="dynamic",
                                      prefetch=0)
        state = coord.create_per_worker_resource(_make_state)
        gang = coord.schedule_on_all(_train, args=(state, iter(ds), str(gates), last))
        held = wait_until(lambda: len(_at(gates, 2)) == members and _at(gates, 2), 60,
                          "every rank at step 2")
        wait_until(lambda: ds.progress()["free"] == FILES * FILE_ROWS - members * BLOCK,
                   30, "every rank's first lease")
        yield cluster, client, coord, gang, gates, held


# a step inside the gang closure, which already runs (none of a closure's files but the
# wire's checks and the member's session on the scheduler): the batch (the loader cuts
# it from a block read; its rows held, their tokens the closure's), agreed on by synced
# in the gradient allreduce, which carries it and the commit's head (riders, the group,
# the process's membership); the commit (State, its host copy; the membership counters;
# its message queued, sent as the next batch is asked for: the worker's session
# services, the scheduler's gangs book, the commits in flight, the lease table's acks,
# the ledgers, the dashboard's row count; how each rank leaves, read from its worker's
# preemption deadline); the phase timer and its step times
STEP_PATH = {"collective/bootstrap.py", "collective/group.py", "collective/replicas.py",
             "collective/state/deadline.py", "collective/state/elastic.py",
             "collective/state/heads.py",
             "collective/state/replica.py", "collective/state/snapshot.py",
             "collective/step/riders.py", "collective/step/step.py", "collective/step/synced.py",
             "core/checks.py", "core/intervals.py", "core/leases/commits.py",
             "core/leases/datasets.py", "core/leases/ledgers.py", "core/leases/table.py",
             "core/membership.py", "core/protocol.py", "data/batching.py", "data/convert.py",
             "data/leased/held.py", "data/leased/passes.py", "data/loader.py", "observe/phases.py",
             "observe/steptimes.py", "plugins/scheduler/gangs.py", "plugins/scheduler/state.py",
             "plugins/scheduler/stats.py", "plugins/worker/services.py", "session/counters.py",
             "session/preemption.py", "session/scope.py", "session/tokens.py"}


@pytest.mark.timeout(120)
def test_a_synced_step_with_a_commit(tmp_path):
    """Two members of two threads: step 3 of a synced loop (its batch from a block read,
    the gradients allreduced, a commit), traced from the end of step 2's commit to the
    end of step 3's."""
    with gang_held_at_step_2(tmp_path, 2, 2, "step-path", 3) as (_, client, coord, gang,
                                                                  gates, _):
        def step() -> None:
            (gates / "go-2").touch()
            wait_until(lambda: len(_at(gates, 3)) == 2, 60, "both ranks past step 3")

        files = trace(client, step)
        (gates / "go-3").touch()
        assert sorted(coord.fetch(gang)) == [3, 3]
    print("a synced step with a commit:", len(files), sorted(files))
    assert files == STEP_PATH, (sorted(files - STEP_PATH), sorted(STEP_PATH - files))


def _in_allreduce() -> bool:
    """Whether a thread of this process waits inside a group's ``allreduce``."""
    import sys

    for frame in sys._current_frames().values():
        while frame is not None:
            code = frame.f_code
            if code.co_name == "allreduce" and code.co_filename.startswith(path_trace.ROOT):
                return True
            frame = frame.f_back
    return False


# from the kill to the survivors' first step in the new group: the scheduler sees the
# member leave (its plugin, the coordinator state: the session ended, its closures and
# leases given back, its commits aborted, the rank book's, the asynchronous models' book's
# and the dashboard's counts),
# tells the members (the gangs book, the gang's record), and forms the next generation
# (the group driver: the members with no preemption deadline near, the backend for
# them, the store and the joins); on the survivors the broken group ends the step (the
# worker plugin's routes, the process's membership, the group's calls), the gang
# closure fails (its batch taken ahead given back, its last window sent) and runs again
# (the runner, the closure's scope and resources), where State.sync() takes the newest
# commit and the step runs as above
REFORM_PATH = {"collective/bootstrap.py", "collective/device.py", "collective/group.py",
               "collective/replicas.py", "collective/state/deadline.py",
               "collective/state/elastic.py", "collective/state/heads.py",
               "collective/state/keeper.py",
               "collective/state/replica.py", "collective/state/snapshot.py",
               "collective/step/riders.py", "collective/step/step.py", "collective/step/synced.py",
               "config.py", "core/backends.py", "core/checks.py", "core/gang.py", "core/gpus.py",
               "core/intervals.py", "core/leases/commits.py", "core/leases/epochs.py",
               "core/leases/table.py", "core/membership.py", "core/nest.py", "core/protocol.py",
               "core/queue.py", "data/batching.py", "data/convert.py", "data/leased/held.py",
               "data/leased/passes.py", "data/loader.py", "errors.py", "observe/book.py",
               "observe/hangs.py", "observe/phases.py", "observe/recorder.py",
               "observe/steptimes.py", "observe/stragglers.py",
               "plugins/scheduler/asynchronous/book.py", "plugins/scheduler/closures.py",
               "plugins/scheduler/datasets.py", "plugins/scheduler/gangs.py",
               "plugins/scheduler/groups.py", "plugins/scheduler/inference/book.py",
               "plugins/scheduler/lifetime/preemptions.py",
               "plugins/scheduler/plugin.py", "plugins/scheduler/polls.py",
               "plugins/scheduler/state.py",
               "plugins/scheduler/stats.py", "plugins/worker/plugin.py",
               "plugins/worker/runner.py", "plugins/worker/services.py", "session/counters.py",
               "session/preemption.py", "session/resources.py", "session/scope.py",
               "session/tokens.py"}


@pytest.mark.timeout(120)
def test_a_reformation_after_a_member_dies(tmp_path):
    """Three members of one thread held after step 2's commit; ranks 0 and 1 go on into
    step 3's gradient allreduce and wait there for rank 2, which is SIGKILLed (its Nanny
    starts no replacement). Traced from the kill to the survivors' first commit in the
    new group (step 3 again, from step 2's commit)."""
    with gang_held_at_step_2(tmp_path, 3, 1, "reform-path", 4) as (cluster, client, coord,
                                                                    gang, gates, held):
        (generation,) = {g for g, _ in held}
        victim = held[generation, 2]
        pids = {pid: addr for addr, pid in client.run(os.getpid).items()}
        for nanny in cluster.workers.values():
            if nanny.worker_address == pids[victim]:
                nanny.close_gracefully()  # no replacement: the group re-forms on the survivors
        for rank in (0, 1):
            (gates / f"go-2-{rank}").touch()
        survivors = [addr for pid, addr in pids.items() if pid != victim]
        wait_until(lambda: all(client.run(_in_allreduce, workers=survivors).values()), 60,
                   "the survivors waiting for rank 2 in step 3's allreduce")

        def reform() -> None:
            sigkill(victim)
            wait_until(lambda: len([g for g, _ in _at(gates, 3) if g != generation]) == 2,
                       90, "the survivors' first commit in the new group")

        files = trace(client, reform)
        (gates / "go-3").touch()
        assert sorted(coord.fetch(gang)) == [4, 4]
    print("a re-formation:", len(files), sorted(files))
    assert files == REFORM_PATH, (sorted(files - REFORM_PATH), sorted(REFORM_PATH - files))


# -- the walks in docs/architecture.md -----------------------------------------------------
WALKS = {"closure": CLOSURE_PATH, "batch": CLOSURE_PATH | BATCH_PATH,
         "batch crossing a block": CLOSURE_PATH | BATCH_PATH | BLOCK_PATH,
         "synced step": STEP_PATH, "re-formation": REFORM_PATH}


def walk_files() -> dict[str, tuple[int, set[str]]]:
    """``{path: (count said, files named)}`` of docs/architecture.md's ``Files, <path>
    (<count>): ...`` paragraphs; ``the <path>'s <count> and`` names an earlier one's."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    out: dict[str, tuple[int, set[str]]] = {}
    for m in re.finditer(r"^Files, ([^(]+) \((\d+)\): (.*?)(?:\n\n|\Z)", text, re.M | re.S):
        name, count, body = m.group(1), int(m.group(2)), m.group(3)
        files = set(re.findall(r"`([^`]+\.py)`", body))
        for ref in re.findall(r"the ([\w -]+)'s \d+ and", body):
            files |= out[ref][1]
        out[name] = (count, files)
    return out


def test_the_walks_name_the_traced_files():
    """Each walk's files in docs/architecture.md are the set its test asserts, counted
    as its test counts them."""
    walks = walk_files()
    assert set(walks) == set(WALKS), sorted(walks)
    for name, (count, files) in walks.items():
        expected = WALKS[name]
        assert files == expected, (name, sorted(files - expected), sorted(expected - files))
        assert count == len(expected), (name, count, len(expected))
