"""Horovod parity for elastic State, on a real LocalCluster of worker
processes with 2 threads each: ``State.register_reset_callbacks`` runs after every
re-formation a State lives through, before it is synchronised, and
``HostsUpdatedInterrupt.skip_sync`` is Horovod's (``True`` when members only left,
``False`` when a worker joined)."""

from __future__ import annotations

import functools
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from distributed import Client

import daskdist as dd
from tests.conftest import make_cluster, wait_for_workers, wait_until

pytestmark = pytest.mark.timeout(240)


def _log(logdir: str, *fields) -> None:
    with open(Path(logdir) / f"{os.getpid()}.log", "a") as f:
        f.write(" ".join(str(x) for x in (time.time(), *fields)) + "\n")


def _read(logdir: Path) -> list[list[str]]:
    out = []
    for p in logdir.glob("*.log"):
        out += [[p.stem, *line.split()[1:]] for line in p.read_text().splitlines()]
    return out


def make_state(ctx, logdir: str):
    model = torch.nn.Linear(4, 1)
    state = dd.collective.State(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                                step=0)

    def on_reset():  # Horovod's use: rescale the learning rate to the new world size
        g = dd.collective.get_group()
        for group in state.optimizer.param_groups:
            group["lr"] = 0.1 * g.world_size
        _log(logdir, "reset", g.generation, g.world_size)

    state.register_reset_callbacks([on_reset])
    return state


def loop(state, logdir: str):
    """Commit every step until the driver writes ``stop`` (rank 0 decides for all)."""
    g = dd.collective.get_group()
    state.sync()
    _log(logdir, "sync", g.generation, g.world_size, state.step)
    stop = Path(logdir) / "stop"
    while not g.broadcast_object(stop.exists(), src=0):
        state.optimizer.zero_grad()
        state.model(torch.ones(2, 4)).pow(2).mean().backward()
        dd.collective.allreduce_gradients(state.model, average=True)
        state.optimizer.step()
        state.step += 1
        time.sleep(0.01)
        try:
            state.commit()
        except dd.collective.HostsUpdatedInterrupt as e:
            _log(logdir, "interrupt", g.generation, g.world_size, int(e.skip_sync))
            raise
        _log(logdir, "commit", g.generation, g.world_size, state.step)
    lrs = [pg["lr"] for pg in state.optimizer.param_groups]
    return g.rank, g.world_size, state.step, lrs


def test_reset_callbacks_and_skip_sync_on_a_join_and_a_retirement(tmp_path):
    with make_cluster(2, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="reset")
        wait_for_workers(client, coord, 2)
        first = coord.collective_group(timeout=30)
        state = coord.create_per_worker_resource(functools.partial(make_state,
                                                                   logdir=str(tmp_path)))
        gang = coord.schedule_on_all(loop, args=(state, str(tmp_path)))

        def committed(world):
            return any(e[1] == "commit" and int(e[3]) == world for e in _read(tmp_path))

        wait_until(lambda: committed(2), 60, "2 ranks committing")
        cluster.scale(3)  # a worker joins: every rank interrupted, skip_sync False
        wait_until(lambda: committed(3), 90, "3 ranks committing")
        members = coord._call("daskdist_group_info")["members"]
        client.retire_workers([members[0]])  # rank 0 leaves: skip_sync True
        wait_until(lambda: any(e[1] == "commit" and int(e[3]) == 2
                               and int(e[2]) > first.generation for e in _read(tmp_path)),
                   90, "the 2 survivors committing")
        # the retired worker's session ends (its plugin's teardown) while the survivors
        # go on: no membership change for them, so no second interrupt
        wait_until(lambda: coord.status()["workers"] == 2, 90, "the retired worker gone")
        def commits():
            return sum(e[1] == "commit" for e in _read(tmp_path))

        then = commits()
        wait_until(lambda: commits() >= then + 10, 90, "the survivors committing after it")
        (tmp_path / "stop").touch()
        out = coord.fetch(gang)
        coord.close()

    logs = _read(tmp_path)
    interrupts = {}  # generation -> {pid: skip_sync}
    for pid, kind, gen, _world, *rest in logs:
        if kind == "interrupt":
            interrupts.setdefault(int(gen), {})[pid] = int(rest[0])
    # the join interrupted both ranks of the first group at the same commit: skip_sync
    # False (the newcomer needs the state)
    grown = interrupts.pop(first.generation)
    assert len(grown) == 2 and set(grown.values()) == {0}, grown
    # after it, one retirement: one interrupt, skip_sync, on every rank of the
    # generation it started in; the survivors' group is not interrupted again when the
    # retired worker finally goes
    assert len(interrupts) == 1, interrupts
    assert all(set(v.values()) == {1} for v in interrupts.values()), interrupts
    for gen, v in interrupts.items():
        world = {int(w) for p, k, g, w, *_ in logs if int(g) == gen}
        assert len(v) in world, (gen, v, world)

    # reset callbacks: on every rank whose State lived through a re-formation, once per
    # generation, before that generation's sync; never on the newcomer's first run
    syncs = {(pid, int(gen)) for pid, kind, gen, *_ in logs if kind == "sync"}
    resets = [(pid, int(gen), int(world)) for pid, kind, gen, world, *_ in logs
              if kind == "reset"]
    assert len(resets) == len({(p, g) for p, g, _ in resets}), resets  # once each
    first_gen = {}
    for pid, gen in syncs:
        first_gen[pid] = min(gen, first_gen.get(pid, gen))
    expected = {(pid, gen) for pid, gen in syncs if gen > first_gen[pid]}
    assert {(p, g) for p, g, _ in resets} == expected
    assert len(expected) >= 4  # 2 ranks after the join, 2 survivors after the retirement
    for pid, gen, _world in resets:
        order = [e[1] for e in logs if e[0] == pid and int(e[2]) == gen
                 and e[1] in ("reset", "sync")]
        assert order[0] == "reset", (pid, gen, order)  # before the state is synchronised
    # the callback rescaled the learning rate, and the survivors agree on it
    assert len(out) == 2 and [o[1] for o in out] == [2, 2]
    assert out[0][2] == out[1][2] and out[0][3] == out[1][3] == [0.2]


def test_hosts_updated_interrupt_keeps_skip_sync_across_processes():
    e = dd.collective.HostsUpdatedInterrupt("workers left", skip_sync=True)
    back = pickle.loads(pickle.dumps(e))
    assert back.skip_sync is True and str(back) == "workers left"
    assert dd.collective.HostsUpdatedInterrupt().skip_sync is False
    state = dd.collective.State(step=0)
    with pytest.raises(TypeError, match="list"):
        state.register_reset_callbacks(print)
    with pytest.raises(TypeError, match="not callable"):
        state.register_reset_callbacks([1])
