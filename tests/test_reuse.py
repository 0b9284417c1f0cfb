"""A long-lived cluster's second coordinator: a Coordinator closed after
it saw churn (a member SIGKILLed and replaced by its nanny), then a new Coordinator of the
same name on the same worker processes. The new one's membership counters start clean:
its undisturbed gang runs once per member, every ``commit()`` without an interrupt."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from distributed import Client

import daskdist as dd
from tests.conftest import kill_and_replace, make_cluster, wait_for_workers, worker_pids

pytestmark = pytest.mark.timeout(240)


def make_state(ctx):
    model = torch.nn.Linear(4, 1)
    return dd.collective.State(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                               step=0)


def committed_loop(state, steps: int, logdir: str):
    """``steps`` committed steps; logs each run's start (one line per run of a member)."""
    g = dd.collective.get_group()
    with open(Path(logdir) / f"{os.getpid()}.log", "a") as f:
        f.write(f"run {g.generation} {g.rank}\n")
    state.sync()
    while state.step < steps:
        state.optimizer.zero_grad()
        state.model(torch.ones(2, 4)).pow(2).mean().backward()
        dd.collective.allreduce_gradients(state.model, average=True)
        state.optimizer.step()
        state.step += 1
        state.commit()
    return g.rank, g.world_size, state.step


def _runs(logdir: Path) -> list[str]:
    return [line for p in logdir.glob("*.log") for line in p.read_text().splitlines()]


def test_a_new_coordinator_after_churn_runs_its_gang_once_per_member(tmp_path):
    with make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        a = dd.Coordinator(client, name="day2")
        wait_for_workers(client, a, 3)
        a.collective_group(timeout=30)
        state = a.create_per_worker_resource(make_state)
        first = tmp_path / "a"
        first.mkdir()
        a.fetch(a.schedule_on_all(committed_loop, args=(state, 5, str(first))))
        victim = worker_pids(client)[a._call("daskdist_group_info")["members"][0]]
        kill_and_replace(client, a, victim, n=3)  # rank 0: SIGKILL, the nanny's replacement
        out = a.fetch(a.schedule_on_all(committed_loop, args=(state, 10, str(first))))
        assert [o[2] for o in out] == [10, 10, 10]
        a.close()

        b = dd.Coordinator(client, name="day2")
        wait_for_workers(client, b, 3)
        b.collective_group(timeout=30)
        state = b.create_per_worker_resource(make_state)
        second = tmp_path / "b"
        second.mkdir()
        t0 = time.monotonic()
        out = b.fetch(b.schedule_on_all(committed_loop, args=(state, 30, str(second))))
        print(f"B's 30 committed steps on 3 members: {time.monotonic() - t0:.2f} s")
        assert [o[:3] for o in out] == [(0, 3, 30), (1, 3, 30), (2, 3, 30)]
        runs = _runs(second)
        assert len(runs) == 3, f"B's undisturbed gang ran {len(runs)} times: {runs}"
        assert b.status()["workers_lost"] == 0
        b.close()
