"""Collective groups bootstrapped through Dask, gang closures and elastic state (SPEC §4).

Real LocalClusters with worker processes and gloo process groups; faults are SIGKILLs
and a worker added mid-training.
"""

from __future__ import annotations

import os
import time

import dask
import pytest
import torch

import daskdist as dd
from tests.conftest import THREADS, make_cluster, sigkill, wait_for_workers, wait_until


@pytest.fixture(scope="module", params=THREADS, ids=lambda n: f"threads{n}")
def threads(request) -> int:
    """Gang closures and groups hold at 1 and 2 threads per worker."""
    return request.param

OPS = {"sum": sum, "max": max, "min": min}


def all_ops(dtype_name):
    """Every op on this rank; returns what each produced (checked on the client)."""
    dtype = getattr(torch, dtype_name)
    g = dd.collective.get_group()
    r = g.rank
    out = {"rank": r, "world": g.world_size, "generation": g.generation}
    for op in ("sum", "max", "min", "product", "mean"):
        if op == "mean" and not dtype.is_floating_point:
            continue
        t = torch.tensor([r + 1, 2 * (r + 1)], dtype=dtype)
        same = g.allreduce(t, op=op)
        out[op] = t.tolist()
        out[op + "_inplace"] = same is t or torch.equal(same, t)
    b = torch.full((3,), float(r), dtype=dtype)
    g.broadcast(b, src=1)
    out["broadcast"] = b.tolist()
    out["gather"] = [x.tolist() for x in g.allgather(torch.tensor([r * 10], dtype=dtype))]
    out["bobj"] = g.broadcast_object({"from": r} if r == 0 else None, src=0)
    out["gobj"] = g.allgather_object(("rank", r))
    g.barrier()
    return out


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_every_op_through_dask(coord, dtype):
    group = coord.collective_group(timeout=30)
    assert group.world_size == 2 and group.backend == "gloo" and len(group.members) == 2
    out = coord.fetch(coord.schedule_on_all(all_ops, args=(dtype,)))
    assert [o["rank"] for o in out] == [0, 1]
    assert {o["generation"] for o in out} == {group.generation}
    for o in out:
        assert o["sum"] == [3, 6] and o["max"] == [2, 4] and o["min"] == [1, 2]
        assert o["product"] == [2, 8]
        if dtype == "float32":
            assert o["mean"] == [1.5, 3.0]
        assert o["sum_inplace"]
        assert o["broadcast"] == [1, 1, 1]
        assert o["gather"] == [[0], [10]]
        assert o["bobj"] == {"from": 0}
        assert o["gobj"] == [("rank", 0), ("rank", 1)]


def make_model(ctx):
    torch.manual_seed(1000 + ctx.worker_index)  # every replica starts different
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def sync_replicas(model):
    before = flat(model).clone()
    dd.collective.broadcast_parameters(model, src=0)
    return before.tolist(), flat(model).tolist()


def ddp_step(model):
    g = dd.collective.get_group()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(g.rank)  # different data per rank
    x = torch.randn(32, 8)
    loss = ddp(x).pow(2).mean()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    # the helper gives the same averaged gradients as DDP, from plain local ones
    model(x).pow(2).mean().backward()
    dd.collective.allreduce_gradients(model, average=True)
    mine = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    return grads.tolist(), mine.tolist()


def test_replicas_broadcast_and_ddp(coord):
    coord.collective_group(timeout=30)
    model = coord.create_per_worker_resource(make_model)
    (b0, a0), (b1, a1) = coord.fetch(coord.schedule_on_all(sync_replicas, args=(model,)))
    assert b0 != b1  # differently seeded
    assert a0 == a1 == b0  # rank 0's parameters everywhere
    (g0, h0), (g1, h1) = coord.fetch(coord.schedule_on_all(ddp_step, args=(model,)))
    assert g0 == pytest.approx(g1, abs=1e-6)  # DDP averaged gradients agree across ranks
    assert h0 == pytest.approx(g0, abs=1e-5) and h1 == pytest.approx(g1, abs=1e-5)


def make_state(ctx):
    torch.manual_seed(ctx.worker_index)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return dd.collective.State(model=model, optimizer=opt, step=0, note=f"w{ctx.worker_index}")


def state_roundtrip(state):
    g = dd.collective.get_group()
    state.sync()
    synced = (flat(state.model).tolist(), state.step, state.note)
    state.step = 5
    state.commit()
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    state.step = 99
    state.restore()
    return g.rank, synced, flat(state.model).tolist() == synced[0], state.step


def test_elastic_state_sync_commit_restore(coord):
    coord.collective_group(timeout=30)
    state = coord.create_per_worker_resource(make_state)
    out = coord.fetch(coord.schedule_on_all(state_roundtrip, args=(state,)))
    (r0, s0, ok0, step0), (r1, s1, ok1, step1) = out
    assert (r0, r1) == (0, 1)
    assert s0 == s1 and s0[2] == "w0"  # rank 0's model and objects everywhere
    assert ok0 and ok1 and step0 == step1 == 5  # restored to the commit


def slow_gang_step(i, seconds):
    g = dd.collective.get_group()
    time.sleep(seconds)
    t = torch.ones(4, device=g.device)
    g.allreduce(t)
    return i, g.generation, g.world_size, t[0].item(), os.getpid()


def test_sigkill_member_during_gang_loop(coord, client):
    group = coord.collective_group(timeout=30)
    results = []
    victim = None
    for i in range(6):
        rvs = coord.schedule_on_all(slow_gang_step, args=(i, 0.3))
        if i == 2:
            pids = sorted(client.run(os.getpid).values())
            victim = pids[-1]
            wait_until(lambda: coord.status()["running"] >= 2, 10, "the gang to start")
            sigkill(victim)
        results.append(coord.fetch(rvs))
    for i, ranks in enumerate(results):
        assert [r[0] for r in ranks] == [i] * len(ranks)
        assert all(r[3] == r[2] for r in ranks)  # allreduce saw every member
    generations = [ranks[0][1] for ranks in results]
    assert generations[0] == group.generation
    assert generations[-1] > group.generation  # re-formed after the loss
    assert generations == sorted(generations)
    assert all(victim not in {r[4] for r in ranks} for ranks in results[3:])
    wait_for_workers(client, coord, 2, gone=victim)


def test_dead_peer_raises_collective_error(coord, client):
    """Rank 1 dies mid-gang: rank 0's allreduce raises CollectiveError (no hang); the
    gang then re-runs on the group re-formed with the replacement worker."""
    # a timeout past the test's own (pytest-timeout): only the loss can end the call
    coord.collective_group(timeout=600)
    seen = coord.create_per_worker_resource(lambda ctx: [])

    def probe(log):
        g = dd.collective.get_group()
        if g.generation == first_generation and g.rank == 1:
            os.kill(os.getpid(), 9)
        try:
            g.allreduce(torch.ones(1, device=g.device))
            log.append(("ok", g.generation))
        except dd.CollectiveError as e:
            log.append(("collective-error", str(e)))
            raise
        return list(log)

    first_generation = coord.status()["group_generation"]
    out = coord.fetch(coord.schedule_on_all(probe, args=(seen,)))
    logs = [entry for log in out for entry in log]
    errors = [e for e in logs if e[0] == "collective-error"]
    assert errors and all("timed out" not in text.lower() for _, text in errors), errors
    # the re-run succeeded on every rank of the generation that completed it: the
    # survivor alone (the group shrinks at once), or with the replacement if it was quick
    assert 1 <= len(out) <= 2 and all(log[-1][0] == "ok" for log in out)
    wait_for_workers(client, coord, 2)


def two_groups_step():
    g = dd.collective.get_group()
    t = torch.tensor([float(g.rank)])
    g.allreduce(t)
    return g.generation, g.world_size, t.item()


def test_two_groups_in_a_row_share_no_state(coord):
    first = coord.collective_group(timeout=30)
    a = coord.fetch(coord.schedule_on_all(two_groups_step))
    second = coord.collective_group(timeout=30)
    b = coord.fetch(coord.schedule_on_all(two_groups_step))
    assert second.generation == first.generation + 1
    assert {x[0] for x in a} == {first.generation} and {x[0] for x in b} == {second.generation}
    assert [x[2] for x in a] == [x[2] for x in b] == [1.0, 1.0]


def _workers_saw_generation(n):
    from daskdist.collective import bootstrap

    state = bootstrap.PROCESS
    with state.lock:
        state.lost_upto = max(state.lost_upto, n)


def test_generations_continue_above_what_workers_saw(client, request):
    """Workers that outlived a scheduler refuse old generation numbers: new groups are
    numbered above the newest generation any registering worker has seen."""
    client.run(_workers_saw_generation, 10_000)
    co = dd.Coordinator(client, name=request.node.name + "-fresh")
    try:
        co.wait_for_workers(2, timeout=60)
        group = co.collective_group(timeout=30)
        assert group.generation > 10_000
        out = co.fetch(co.schedule_on_all(two_groups_step))
        assert [x[0] for x in out] == [group.generation] * 2
    finally:
        co.close()


def elastic_train(state, log, steps, world=0):
    """Commits every step; on HostsUpdatedInterrupt, log the step and let the gang re-run.
    Runs ``steps`` steps, and on until the group has ``world`` members (a newcomer may
    take a while to start on a loaded machine)."""
    g = dd.collective.get_group()
    state.sync()
    while state.step < steps or g.world_size < world:
        t = torch.ones(1)
        g.allreduce(t)
        time.sleep(0.05)
        state.step += 1
        try:
            state.commit()
        except dd.collective.HostsUpdatedInterrupt:
            log.append(state.step)
            raise
    return g.rank, g.world_size, g.generation, list(log), state.step


def test_worker_added_interrupts_all_ranks_at_same_step():
    with make_cluster(2) as cluster:
        from distributed import Client

        with Client(cluster) as client:
            coord = dd.Coordinator(client, name="elastic")
            wait_for_workers(client, coord, 2)
            group = coord.collective_group(timeout=30)
            state = coord.create_per_worker_resource(make_state)
            log = coord.create_per_worker_resource(lambda ctx: [])
            rvs = coord.schedule_on_all(elastic_train, args=(state, log, 120, 3))
            wait_until(lambda: coord.status()["running"] >= 2, 30, "the gang to run")
            cluster.scale(3)
            out = coord.fetch(rvs)
            # the results of the generation that completed the gang: the newcomer's too
            assert [o[0] for o in out] == [0, 1, 2]
            assert all(o[1] == 3 for o in out)  # finished on the re-formed 3-member group
            assert all(o[2] > group.generation for o in out)
            interrupted = [o[3] for o in out]
            assert interrupted[0] and interrupted[0] == interrupted[1]  # same step, all ranks
            assert out[0][4] >= 120 and all(o[4] == out[0][4] for o in out)
            coord.close()


def test_explicit_nccl_on_workers_without_own_gpus_is_a_clear_error(coord, client):
    """LocalCluster workers have no GPU or share one: NCCL is refused before formation,
    with a message naming why (and, for a shared GPU, the workers and the GPU)."""
    has_cuda = any(client.run(torch.cuda.is_available).values())
    with pytest.raises(dd.CollectiveError) as e:
        coord.collective_group(backend="nccl", timeout=10)
    msg = str(e.value)
    if has_cuda:
        assert "share GPU" in msg and "gpu_pin" in msg
        assert all(a in msg for a in client.scheduler_info(n_workers=-1)["workers"])
    else:
        assert "CUDA on every member" in msg
    # auto still forms (gloo: no LocalCluster worker has a GPU of its own)
    assert coord.collective_group(backend="auto", timeout=30).backend == "gloo"


def relay_probe(log, first_generation):
    g = dd.collective.get_group()
    if g.generation == first_generation and g.rank == 0:
        os.kill(os.getpid(), 9)
    try:
        g.allreduce(torch.ones(1, device=g.device))
        log.append(("ok", g.generation, g.rank))
    except dd.CollectiveError as e:
        log.append(("error", g.generation, g.rank, str(e)))
        raise
    return list(log)


@pytest.mark.timeout(300)
def test_a_wide_groups_loss_reaches_every_survivor_down_the_tree():
    """With ``relay-fanout`` 2, rank 0 of 6 dies before its allreduce. The
    scheduler tells ranks 1, 2 and 3 only; 4 and 5 hear it from rank 1, whose init named
    them. Every survivor's call raises the loss at once (the group's timeout is past
    the test's own), and the gang runs again on the re-formed group."""
    from distributed import Client

    with dask.config.set({"daskdist.collective.relay-fanout": 2}), \
            make_cluster(6, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="relay")
        wait_for_workers(client, coord, 6)
        group = coord.collective_group(timeout=600)
        assert group.world_size == 6
        seen = coord.create_per_worker_resource(lambda ctx: [])
        first = coord.status()["group_generation"]
        out = coord.fetch(coord.schedule_on_all(relay_probe, args=(seen, first)))
        errors = {e[2]: e[3] for log in out for e in log if e[0] == "error" and e[1] == first}
        assert sorted(errors) == [1, 2, 3, 4, 5], out  # every survivor, none waited
        assert all("timed out" not in text.lower() for text in errors.values()), errors
        assert all(log[-1][0] == "ok" and log[-1][1] > first for log in out)
        coord.close()
