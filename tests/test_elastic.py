"""Elastic training under membership change (SPEC §4.1, §4.2), on real LocalClusters of
3 worker processes with gloo: rank 0 killed twice, a retired member, a worker added
mid-loop, rows trained exactly once across kills and a retirement, a formation that
always fails."""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

import dask
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from distributed import Client

import daskdist as dd
from tests.conftest import THREADS, make_cluster, sigkill, wait_for_workers, wait_until
from tests.processes import process_context
from tests.row_ledger import assert_every_row_once, final_counts, make_counts, train_rows

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]


def _log(logdir: str, kind: str, step: int, g) -> None:
    with open(Path(logdir) / f"{os.getpid()}.log", "a") as f:
        f.write(f"{time.time()} {kind} {step} {g.generation} {g.rank} {g.world_size}\n")


def _read_logs(logdir: Path) -> list[tuple]:
    out = []
    for p in logdir.glob("*.log"):
        for line in p.read_text().splitlines():
            t, kind, step, gen, rank, world = line.split()
            out.append((float(t), kind, int(step), int(gen), int(rank), int(world),
                        int(p.stem)))
    return sorted(out)


def make_state(ctx):
    torch.manual_seed(100 + ctx.worker_index)  # every fresh replica differs
    model = torch.nn.Linear(4, 1)
    return dd.collective.State(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                               step=0)


def elastic_loop(state, steps, logdir, pause=0.02):
    """A step = an allreduce of the gradient; commit every step; logs resumes and commits."""
    g = dd.collective.get_group()
    state.sync()
    _log(logdir, "resume", state.step, g)
    while state.step < steps:
        state.optimizer.zero_grad()
        state.model(torch.ones(2, 4)).pow(2).mean().backward()
        dd.collective.allreduce_gradients(state.model, average=True)
        state.optimizer.step()
        time.sleep(pause)
        state.step += 1
        try:
            state.commit()
        except dd.collective.HostsUpdatedInterrupt:
            _log(logdir, "commit", state.step, g)  # committed, then interrupted
            _log(logdir, "interrupt", state.step, g)
            raise
        _log(logdir, "commit", state.step, g)
    flat = torch.cat([p.detach().flatten() for p in state.model.parameters()]).tolist()
    return g.rank, g.world_size, g.generation, state.step, flat, os.getpid()


def _group(coord) -> dict:
    return coord._call("daskdist_group_info")


def _pid_of_rank0(coord, client) -> int:
    pids = client.run(os.getpid, on_error="ignore")
    return pids[_group(coord)["members"][0]]


@pytest.fixture
def cluster3(request):
    threads = getattr(request, "param", 1)
    with make_cluster(3, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="elastic")
        wait_for_workers(client, coord, 3)
        yield cluster, client, coord
        coord.close()


@pytest.mark.slow
def test_rank0_killed_twice_resumes_from_the_newest_commit(cluster3, tmp_path):
    _cluster, client, coord = cluster3
    coord.collective_group(timeout=30)
    state = coord.create_per_worker_resource(make_state)
    steps = 700  # room for two kills, each with its replacement joining
    gang = coord.schedule_on_all(elastic_loop, args=(state, steps, str(tmp_path)))
    kills = []
    for _ in range(2):
        floor = max([e[2] for e in _read_logs(tmp_path) if e[1] == "commit"], default=0)
        # a full group of 3 is stepping (after the first kill: with the replacement)
        wait_until(lambda floor=floor: any(e[1] == "commit" and e[5] == 3 and e[2] > floor + 5
                                           for e in _read_logs(tmp_path)),
                   60, "3 ranks stepping")
        victim = _pid_of_rank0(coord, client)
        kills.append((time.time(), victim))
        sigkill(victim)
        wait_for_workers(client, coord, 3, gone=victim)
    out = coord.fetch(gang)
    assert [o[0] for o in out] == list(range(len(out)))
    assert all(o[3] == steps for o in out)
    assert all(o[4] == out[0][4] for o in out)  # every rank holds the same model
    assert all(o[5] not in {v for _, v in kills} for o in out)
    logs = _read_logs(tmp_path)
    for t_kill, _victim in kills:
        committed = max(e[2] for e in logs if e[1] == "commit" and e[0] < t_kill)
        resumed = [e[2] for e in logs if e[1] == "resume" and e[0] > t_kill]
        assert resumed and min(resumed) >= committed - 1, (committed, resumed)


def test_retired_member_survivors_step_again(cluster3, tmp_path):
    _cluster, client, coord = cluster3
    coord.collective_group(timeout=30)
    state = coord.create_per_worker_resource(make_state)
    steps = 150
    gang = coord.schedule_on_all(elastic_loop, args=(state, steps, str(tmp_path)))
    wait_until(lambda: any(e[1] == "commit" and e[2] > 10 for e in _read_logs(tmp_path)),
               60, "steps")
    leaving = _group(coord)["members"][2]
    t0 = time.time()
    client.retire_workers([leaving])
    out = coord.fetch(gang)
    logs = _read_logs(tmp_path)
    after = [e for e in logs if e[1] == "commit" and e[0] > t0 and e[5] == 2]
    assert after, "survivors made no step after the retirement"
    print(f"retire -> next committed step on the survivors: {after[0][0] - t0:.2f} s")
    assert len(out) == 2 and [o[0] for o in out] == [0, 1]  # the survivors' results
    assert all(o[1] == 2 and o[3] == steps for o in out)
    assert out[0][4] == out[1][4]
    assert coord.status()["workers_lost"] == 0


@pytest.mark.slow
def test_worker_added_joins_at_a_commit_with_the_same_state(tmp_path):
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="grow")
        wait_for_workers(client, coord, 2)
        first = coord.collective_group(timeout=30)
        state = coord.create_per_worker_resource(make_state)
        steps = 500  # about 12 s: room for the newcomer's process to start and join
        gang = coord.schedule_on_all(elastic_loop, args=(state, steps, str(tmp_path)))
        wait_until(lambda: any(e[1] == "commit" for e in _read_logs(tmp_path)), 60, "steps")
        cluster.scale(3)
        out = coord.fetch(gang)
        assert len(out) == 3 and all(o[1] == 3 and o[3] == steps for o in out)
        assert all(o[2] > first.generation for o in out)
        assert out[0][4] == out[1][4] == out[2][4]  # the newcomer holds the same model
        logs = _read_logs(tmp_path)
        # every rank of the 2-member generation was interrupted at the same commit
        last = {e[6]: e[2] for e in logs if e[1] == "interrupt" and e[3] == first.generation}
        assert len(last) == 2 and len(set(last.values())) == 1
        # ... and the re-formed group resumed there, the newcomer included
        resumed = [e for e in logs if e[1] == "resume" and e[5] == 3]
        assert {e[2] for e in resumed} == {max(last.values())}
        coord.close()
        with pytest.raises(RuntimeError, match="closed"):
            coord.schedule_on_all(elastic_loop, args=(state, 1, str(tmp_path)))


# -- rows exactly once --------------------------------------------------------------

N_ROWS = 6000


def _write_rows(root: Path) -> dd.data.ArrowShards:
    for f in range(4):
        ids = np.arange(f * N_ROWS // 4, (f + 1) * N_ROWS // 4, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), root / f"p{f}.parquet", row_group_size=100)
    return dd.data.ArrowShards(str(root / "*.parquet"))


@pytest.mark.parametrize("cluster3", THREADS, indirect=True)
def test_row_ledger_every_row_once_across_kills_and_a_retirement(cluster3, tmp_path):
    cluster, client, coord = cluster3
    shards = _write_rows(tmp_path)
    coord.collective_group(timeout=30)
    state = coord.create_per_worker_resource(functools.partial(make_counts, n=N_ROWS))
    ds = coord.distribute_dataset(shards, global_batch_size=60, policy="dynamic",
                                  shuffle=True, seed=3, prefetch=0)
    it = iter(ds)
    faults: list[str] = []
    stop = threading.Event()

    def inject():
        for frac, what in ((0.15, "kill"), (0.4, "kill"), (0.65, "retire")):
            while not stop.is_set() and ds.progress()["acknowledged"] < frac * N_ROWS:
                time.sleep(0.02)
            if stop.is_set():
                return
            members = _group(coord)["members"]
            if what == "kill":  # rank 0 first, then the last rank
                addr = members[0 if not faults else -1]
                victim = client.run(os.getpid, workers=[addr], on_error="ignore").get(addr)
                if isinstance(victim, int):
                    sigkill(victim)
                    faults.append(what)
            else:
                # retire a member of a group of 2 or more that committed a step since:
                # the others hold the committed state (retiring the only holder of the
                # state loses it, as in Horovod: checkpoint for that)
                def two_members():
                    m = _group(coord)["members"]
                    return m if len(m) >= 2 else None

                wait_until(two_members, 60, "a group of 2")
                base = ds.progress()["acknowledged"]
                wait_until(lambda base=base: ds.progress()["acknowledged"] > base
                           or ds.progress()["complete"], 60, "a committed step")
                if not ds.progress()["complete"]:
                    client.retire_workers([_group(coord)["members"][-1]])
                    faults.append(what)

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    gangs = 0
    try:
        deadline = time.monotonic() + 150
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, ds.progress()
            coord.fetch(coord.schedule_on_all(train_rows, args=(state, it, 0.05)))
            gangs += 1
    finally:
        stop.set()
        injector.join(60)
    assert faults == ["kill", "kill", "retire"], faults
    assert_every_row_once(coord.fetch(coord.schedule_on_all(final_counts, args=(state,))),
                          N_ROWS)
    p = ds.progress()
    assert p["acknowledged"] == p["total"] == N_ROWS


def test_formation_that_always_fails_fails_the_gang(tmp_path):
    with dask.config.set({"daskdist.collective.formation-timeout": "2s",
                          "daskdist.collective.formation-retry": "50ms"}):
        with make_cluster(2) as cluster, Client(cluster) as client:
            coord = dd.Coordinator(client, name="never")
            wait_for_workers(client, coord, 2)
            with pytest.raises(dd.CollectiveError):
                coord.collective_group(backend="nccl", timeout=5)  # no CUDA here
            gang = coord.schedule_on_all(lambda: 1)
            with pytest.raises(dd.CollectiveError, match="could not be formed"):
                coord.fetch(gang)
            coord.close()


# -- the sync source, without Dask -----------------------------------------------------


def _sync_member(rank: int, addr_q, out_q) -> None:
    """Ranks 1 and 2 committed 3 and 2 times; rank 0 is fresh: all take rank 1's state."""
    from daskdist.collective import State, create_store, destroy_member, get_group, init_member

    torch.set_num_threads(1)
    if rank == 0:
        host, port = create_store(1, "127.0.0.1")
        for _ in range(2):
            addr_q.put((host, port))
    else:
        host, port = addr_q.get()
    init_member(rank, 3, host, port, "gloo", 1, 30.0)
    torch.manual_seed(rank)
    state = State(model=torch.nn.Linear(3, 1), step=0, who=rank)
    if rank:  # a history of commits, as a survivor has (no peers needed to make it)
        state.step = 4 - rank
        state.save()
        state._commits, state._synced = 4 - rank, True
        with torch.no_grad():  # uncommitted changes: sync goes back to the commit first
            state.model.weight.add_(100.0)
    get_group().barrier()
    state.sync()
    out_q.put((rank, state.step, state.who, state.commits,
               state.model.weight.detach().flatten().tolist()))
    destroy_member()


@pytest.mark.slow
def test_sync_takes_the_newest_commit_not_rank_0():
    ctx = process_context()
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_sync_member, args=(r, addr_q, out_q)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        out = sorted(out_q.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
    assert [o[1:4] for o in out] == [(3, 1, 3)] * 3  # rank 1's state: most commits
    assert out[0][4] == out[1][4] == out[2][4]
    assert all(abs(w) < 50 for w in out[0][4])  # the commit, not the uncommitted change
