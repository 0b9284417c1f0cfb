"""Collective groups on real processes, bootstrapped exactly as the worker plugin does.

A pool of processes forked from the tests' fork server (reused across tests) stands in
for Dask workers: rank 0 runs ``create_store``, the parent passes ``(host, port)``
on, and every member runs ``init_member`` concurrently, each in a fresh thread (as a
worker thread would). gloo backend; NCCL tests are marked ``gpu``.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import signal
import threading
import time
import traceback

import pytest
import torch

from tests.processes import process_context

pytestmark = pytest.mark.timeout(60)

WORLD = 3
# A call that ends because a peer was lost (or a newer generation came) must not wait
# for the group's timeout: these tests give the group a timeout longer than the test's
# own (pytest-timeout, 60 s), so only the lost-peer path can end the call in time, and
# check what it raised, never how fast (a figure of benchmarks/bench_collective.py).
TIMEOUT = 600.0
_generations = itertools.count(1)


# -- the pool ------------------------------------------------------------------------


def _child_main(rank: int, commands, results) -> None:
    torch.set_num_threads(1)
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        call_id, fn, args = cmd
        out: dict = {}

        def run(fn=fn, args=args, out=out):
            try:
                out["ok"] = fn(rank, *args)
            except BaseException as e:  # noqa: BLE001 - shipped to the parent
                out["err"] = e
                out["tb"] = traceback.format_exc()

        t = threading.Thread(target=run, name=f"closure-{call_id}")
        t.start()
        t.join()
        if "err" in out:
            err = out["err"]
            try:
                pickle.dumps(err)
            except Exception:
                err = RuntimeError(repr(err))
            results.put((call_id, rank, False, (err, out["tb"])))
        else:
            results.put((call_id, rank, True, out["ok"]))


class RemoteError(Exception):
    def __init__(self, rank: int, error: BaseException, tb: str):
        super().__init__(f"rank {rank}: {error!r}\n{tb}")
        self.rank = rank
        self.error = error


class Pool:
    """``n`` member processes; ``run`` calls a top-level function on chosen ranks."""

    def __init__(self, n: int):
        self.ctx = process_context()
        self.results = self.ctx.Queue()
        self.procs: list = [None] * n
        self.commands: list = [None] * n
        self.ids = itertools.count()
        for r in range(n):
            self._start(r)

    def _start(self, rank: int) -> None:
        q = self.ctx.Queue()
        p = self.ctx.Process(target=_child_main, args=(rank, q, self.results), daemon=True)
        p.start()
        self.procs[rank], self.commands[rank] = p, q

    def ensure_alive(self) -> None:
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                self._start(r)

    def submit(self, fn, ranks, args=()) -> tuple[int, list[int]]:
        call_id = next(self.ids)
        for r in ranks:
            a = args[r] if isinstance(args, dict) else args
            self.commands[r].put((call_id, fn, tuple(a)))
        return call_id, list(ranks)

    def collect(self, handle, timeout: float = 30.0, raise_errors: bool = True) -> dict:
        call_id, ranks = handle
        got: dict = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(ranks) - set(got))} did not answer")
            try:
                cid, rank, ok, value = self.results.get(timeout=left)
            except queue.Empty:
                continue
            if cid != call_id:
                continue  # a late answer of an earlier call
            got[rank] = (ok, value)
        if raise_errors:
            for rank, (ok, value) in sorted(got.items()):
                if not ok:
                    raise RemoteError(rank, *value)
            return {r: v for r, (_, v) in got.items()}
        return got

    def run(self, fn, ranks=None, args=(), timeout: float = 30.0) -> list:
        ranks = range(len(self.procs)) if ranks is None else ranks
        out = self.collect(self.submit(fn, ranks, args), timeout)
        return [out[r] for r in ranks]

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        deadline = time.monotonic() + 2
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():  # e.g. gloo finishing abandoned work at interpreter exit
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def pool():
    p = Pool(WORLD)
    yield p
    p.close()


def form(pool: Pool, ranks=None, timeout: float = 20.0, backend: str = "gloo") -> int:
    """Bootstrap a group on ``ranks`` (pool indices, in rank order) the plugin's way."""
    pool.ensure_alive()
    ranks = list(range(WORLD) if ranks is None else ranks)
    gen = next(_generations)
    (host, port) = pool.run(_create_store, ranks=[ranks[0]], args=(gen,))[0]
    args = {r: (i, len(ranks), host, port, backend, gen, timeout) for i, r in enumerate(ranks)}
    infos = pool.run(_init_member, ranks=ranks, args=args)
    assert [i["rank"] for i in infos] == list(range(len(ranks)))
    assert all(i["generation"] == gen for i in infos)
    return gen


# -- functions run on the members (top level: pickled by reference) ------------------


def _create_store(_slot, generation):
    from daskdist.collective import create_store

    return create_store(generation, "127.0.0.1")


def _init_member(_slot, rank, world_size, host, port, backend, generation, timeout):
    from daskdist.collective import init_member

    # One GPU per member for the NCCL test (dask-cuda would set CUDA_VISIBLE_DEVICES).
    device = f"cuda:{_slot}" if backend == "nccl" else None
    return init_member(rank, world_size, host, port, backend, generation, timeout, device)


def _destroy(_slot):
    from daskdist.collective import destroy_member

    destroy_member()


def _ops(_slot, dtype_name):
    from daskdist.collective import get_group

    g = get_group()
    dtype = getattr(torch, dtype_name)
    n = g.world_size
    base = [torch.arange(1, 7, dtype=dtype) * (r + 1) - r for r in range(n)]
    stack = torch.stack(base)
    out = {}
    for op in ("sum", "mean", "max", "min", "product"):
        t = base[g.rank].clone()
        res = g.allreduce(t, op=op)
        assert res is t, "allreduce must work in place"
        if op == "sum":
            want = stack.sum(0)
        elif op == "mean":
            s = stack.sum(0)
            want = s / n if dtype.is_floating_point else torch.div(s, n, rounding_mode="trunc")
        elif op == "max":
            want = stack.max(0).values
        elif op == "min":
            want = stack.min(0).values
        else:
            want = stack.prod(0)
        assert t.dtype == dtype
        assert torch.equal(t, want.to(dtype)), (op, t, want)
        out[op] = t.tolist()
    t = base[g.rank].clone()
    g.broadcast(t, src=n - 1)
    assert torch.equal(t, base[n - 1])
    parts = g.allgather(base[g.rank])
    assert len(parts) == n and all(torch.equal(p, b) for p, b in zip(parts, base, strict=True))
    g.barrier()
    with pytest.raises(ValueError, match="contiguous"):
        g.allreduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="unknown reduce op"):
        g.allreduce(torch.ones(2), op="avg")
    with pytest.raises(TypeError):
        g.allreduce([1.0])
    g.barrier()  # the group is still usable after callers' mistakes
    return out


def _objects(_slot):
    from daskdist.collective import get_group
    from daskdist.errors import CollectiveError

    g = get_group()
    mine = {"rank": g.rank, "blob": list(range(g.rank * 1000)), "fn": lambda x: x + g.rank}
    got = g.broadcast_object(mine if g.rank == 1 else None, src=1)
    assert got["rank"] == 1 and got["fn"](1) == 2 and len(got["blob"]) == 1000
    # An object src cannot pickle: every rank raises, nobody waits for the timeout.
    with pytest.raises((TypeError, pickle.PicklingError, CollectiveError)):
        g.broadcast_object(threading.Lock() if g.rank == 2 else None, src=2)
    with pytest.raises((TypeError, pickle.PicklingError, CollectiveError)):
        g.allgather_object(threading.Lock() if g.rank == 0 else 1)
    assert g.broadcast_object("still usable", src=0) == "still usable"
    everyone = g.allgather_object(("r", g.rank, "x" * (g.rank * 7)))
    assert everyone == [("r", r, "x" * (r * 7)) for r in range(g.world_size)]
    from daskdist.collective import bind_device

    # the group's device is the one this member bound (cuda:0 with a GPU), never assumed
    assert str(g.device) == str(bind_device())
    return g.rank, g.world_size, g.generation, g.backend


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )


def _broadcast_params(_slot):
    from daskdist.collective import broadcast_parameters, get_group

    g = get_group()
    m = _model(seed=100 + g.rank)
    m.train()
    m(torch.randn(4, 8))  # moves the BatchNorm running stats (buffers) apart too
    broadcast_parameters(m, src=0)
    return {k: v.clone() for k, v in m.state_dict().items()}


def _ddp_grads(_slot):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from daskdist.collective import get_group

    g = get_group()
    m = _model(seed=7 + g.rank)  # DDP broadcasts rank 0's parameters itself
    ddp = DDP(m)
    torch.manual_seed(1000 + g.rank)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    return [p.grad.clone() for p in m.parameters()]


def _allreduce_grads(_slot):
    from daskdist.collective import allreduce_gradients, broadcast_parameters, get_group

    g = get_group()
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    broadcast_parameters(m)
    torch.manual_seed(50 + g.rank)
    x = torch.randn(5, 8)
    m(x).sum().backward()
    local = [p.grad.clone() for p in m.parameters()]
    allreduce_gradients(m, average=True, bucket_mb=0.0001)  # forces several buckets
    return local, [p.grad.clone() for p in m.parameters()]


def _state_roundtrip(_slot):
    from daskdist.collective import State, get_group

    g = get_group()
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    if g.rank == 0:
        m(torch.randn(2, 3)).sum().backward()
        opt.step()  # rank 0 has momentum buffers, the others none
    state = State(m, opt, step=10 * (g.rank + 1), history=[g.rank])
    state.sync()
    assert state.step == 10 and state.history == [0]
    assert opt.state_dict()["state"], "momentum must arrive from rank 0"
    synced = [p.detach().clone() for p in m.parameters()]
    # Train a step, commit, then wander off and restore.
    state.step += 1
    state.history.append(state.step)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    state.commit()
    committed = [p.detach().clone() for p in m.parameters()]
    state.step = 999
    state.history.append("junk")
    state.extra = "new"
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0)
    opt.state.clear()
    state.restore()
    assert state.step == 11 and state.history == [0, 11]
    assert not hasattr(state, "extra")
    assert all(torch.equal(p, c) for p, c in zip(m.parameters(), committed, strict=True))
    assert opt.state_dict()["state"], "optimizer state must come back"
    state.restore()  # restoring twice gives the same commit
    assert state.step == 11
    return [s.tolist() for s in synced]


def _commit_loop(_slot, bump_at, bump_ranks, steps):
    """Commit every step; bump membership at ``bump_at`` on ``bump_ranks``."""
    from daskdist.collective import HostsUpdatedInterrupt, State, get_group
    from daskdist.session.counters import membership_version, set_membership

    g = get_group()
    state = State(step=0)
    state.sync()
    for step in range(steps):
        state.step = step
        if step == bump_at and g.rank in bump_ranks:
            set_membership(membership_version() + 1)
        try:
            state.commit()
        except HostsUpdatedInterrupt:
            return step
    return None


def _late_peer(_slot):
    """Rank 0 joins late, so the others outlast the fast path and take the slow one."""
    from daskdist.collective import get_group

    g = get_group()
    t = torch.full((1000,), float(g.rank + 1))
    if g.rank == 0:
        time.sleep(0.1)  # not synchronisation: only makes the others wait past 10 ms
    g.allreduce(t)
    objs = g.allgather_object(g.rank)
    return t[0].item(), objs


def _lost_then_call(_slot):
    from daskdist.collective import get_group, mark_peer_lost
    from daskdist.errors import CollectiveError

    g = get_group()
    t = torch.ones(4)
    g.allreduce(t)  # healthy first
    mark_peer_lost(g.generation - 1)  # a stale notice for an older generation: no effect
    g.allreduce(t)
    mark_peer_lost(g.generation, "worker tcp://x left")
    with pytest.raises(CollectiveError, match="left") as first:
        g.allreduce(t)
    with pytest.raises(CollectiveError) as second:
        g.broadcast_object("x")
    return [str(first.value), str(second.value)]


def _mark_lost_while_waiting(wait, generation):
    """Run ``wait()`` in a thread until it waits on its peers, then ``mark_peer_lost``:
    it must end with CollectiveError (its group's timeout is far away). Returns the
    error's text."""
    from daskdist.collective import bootstrap, mark_peer_lost
    from daskdist.errors import CollectiveError

    box: dict = {}

    def run():
        try:
            wait()
        except BaseException as e:
            box["err"] = e
            box["at"] = time.monotonic()

    before = set(bootstrap.PROCESS.waiters)  # a leftover thread's wait is not ours
    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 10
    while not set(bootstrap.PROCESS.waiters) - before and time.monotonic() < deadline:
        time.sleep(0.001)  # condition poll with a deadline: the call is now waiting
    assert set(bootstrap.PROCESS.waiters) - before, "the call never started waiting"
    mark_peer_lost(generation)
    th.join(60)
    assert not th.is_alive()
    assert isinstance(box.get("err"), CollectiveError), box
    return str(box["err"])


def _lost_wakes_inflight(_slot):
    """Rank 0 only: its peers never join the call; mark_peer_lost must end it at once."""
    from daskdist.collective import get_group

    g = get_group()
    return _mark_lost_while_waiting(lambda: g.allreduce(torch.ones(1000)), g.generation)


def _stale_group_refuses(_slot, old_gen):
    from daskdist.collective import get_group
    from daskdist.collective.bootstrap import ProcessMembership
    from daskdist.collective.group import Group
    from daskdist.errors import CollectiveError

    g = get_group()
    assert g.generation > old_gen
    stale = Group(ProcessMembership(g.rank, g.world_size, old_gen, "gloo",
                                    torch.device("cpu"), 5.0))
    with pytest.raises(CollectiveError, match="replaced"):
        stale.allreduce(torch.ones(1))
    t = torch.full((3,), float(g.rank + 1))
    g.allreduce(t)
    return t.tolist(), g.rank, g.world_size


def _get_group_outside(_slot):
    from daskdist.collective import get_group

    with pytest.raises(RuntimeError, match="no collective group"):
        get_group()
    return True


def _allreduce_timed(_slot, hang_rank, kill_rank):
    """Every rank joins a loop of allreduces; ``kill_rank`` dies, ``hang_rank`` idles."""
    from daskdist.collective import get_group
    from daskdist.errors import CollectiveError

    g = get_group()
    t = torch.ones(256)
    g.allreduce(t)
    if g.rank == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    if g.rank == hang_rank:
        return "idle"
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            g.allreduce(t)
    except CollectiveError as e:
        return ("raised", time.monotonic() - t0, str(e)[:200])
    return ("no error", time.monotonic() - t0, "")


def _rendezvous_abort(_slot, host, port, generation):
    """Join a 3-member generation whose third member never comes; abort it."""
    from daskdist.collective import init_member

    return _mark_lost_while_waiting(
        lambda: init_member(_slot, 3, host, port, "gloo", generation, TIMEOUT), generation)


def _rendezvous_timeout(_slot, host, port, generation):
    from daskdist.collective import init_member
    from daskdist.errors import CollectiveError

    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match=r"ranks \[2\] of 3 did not arrive"):
        init_member(_slot, 3, host, port, "gloo", generation, 1.0)
    return time.monotonic() - t0


_KEPT: dict = {}  # per process: the elastic state survives re-formation


def _start_zombie_init(_slot, host, port, generation):
    """Begin joining a 3-member generation whose third member never comes; return."""
    from daskdist.collective import bootstrap, init_member

    box: dict = {}

    def join():
        try:
            init_member(_slot, 3, host, port, "gloo", generation, TIMEOUT)
            box["result"] = "formed"
        except BaseException as e:
            box["result"] = e

    before = set(bootstrap.PROCESS.waiters)  # a leftover thread's wait is not ours
    th = threading.Thread(target=join, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not set(bootstrap.PROCESS.waiters) - before and time.monotonic() < deadline:
        time.sleep(0.001)  # condition poll with a deadline: init waits on its peers
    _KEPT["zombie"] = (th, box)
    return True


def _zombie_outcome(_slot):
    th, box = _KEPT.pop("zombie")
    th.join(5)
    assert not th.is_alive()
    return type(box["result"]).__name__, str(box["result"])


def _elastic_train(_slot, kill_rank, kill_at, steps):
    """Horovod-style loop: step, allreduce gradients, commit; ``kill_rank`` dies."""
    from daskdist.collective import State, allreduce_gradients, get_group
    from daskdist.errors import CollectiveError

    g = get_group()
    if "state" not in _KEPT:
        m = _model(seed=g.rank)
        m.eval()  # BatchNorm on running stats: every rank computes the same function
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        _KEPT["state"] = State(m, opt, step=0)
    state = _KEPT["state"]
    state.sync()
    t0 = None
    try:
        while state.step < steps:
            if g.rank == kill_rank and state.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            torch.manual_seed(state.step * 100 + g.rank)
            state.optimizer.zero_grad()
            t0 = time.monotonic()
            loss = state.model(torch.randn(8, 8)).pow(2).mean()
            loss.backward()
            allreduce_gradients(state.model)
            state.optimizer.step()
            state.step += 1
            state.commit()
    except CollectiveError:
        state.restore()
        return ("interrupted", state.step, time.monotonic() - t0)
    return ("done", state.step, [p.detach().clone() for p in state.model.parameters()])


def _sync_calls(_slot):
    """``sync()`` of the kept State: the collective calls it made, and the parameters."""
    from daskdist.collective import get_group

    cls, calls = type(get_group()), []
    run = cls._run

    def counted(group, what, *args, **kwargs):
        calls.append(what)
        return run(group, what, *args, **kwargs)

    cls._run = counted
    try:
        _KEPT["state"].sync()
    finally:
        cls._run = run
    return calls, [p.detach().clone() for p in _KEPT["state"].model.parameters()]


# -- tests -----------------------------------------------------------------------------


def test_get_group_outside_a_group_is_a_clear_error(pool):
    assert pool.run(_get_group_outside, ranks=[0]) == [True]


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_tensor_ops_every_op_and_dtype(pool, dtype):
    form(pool)
    results = pool.run(_ops, args=(dtype,))
    assert all(r == results[0] for r in results)


def test_object_collectives_and_group_fields(pool):
    gen = form(pool)
    infos = pool.run(_objects)
    assert infos == [(r, WORLD, gen, "gloo") for r in range(WORLD)]


def test_broadcast_parameters_makes_replicas_equal(pool):
    form(pool)
    sds = pool.run(_broadcast_params)
    for sd in sds[1:]:
        assert sd.keys() == sds[0].keys()
        for k in sd:
            assert torch.equal(sd[k], sds[0][k]), k
    fresh = _model(seed=100)
    assert torch.equal(sds[0]["0.weight"], fresh.state_dict()["0.weight"])


def test_ddp_gradients_equal_across_ranks(pool):
    form(pool)
    grads = pool.run(_ddp_grads)
    for gs in grads[1:]:
        for a, b in zip(gs, grads[0], strict=True):
            torch.testing.assert_close(a, b)


def test_allreduce_gradients_averages_in_buckets(pool):
    form(pool)
    out = pool.run(_allreduce_grads)
    locals_ = [lo for lo, _ in out]
    want = [sum(ts) / WORLD for ts in zip(*locals_, strict=True)]
    for _, reduced in out:
        for a, b in zip(reduced, want, strict=True):
            torch.testing.assert_close(a, b)


def test_state_sync_commit_restore(pool):
    form(pool)
    synced = pool.run(_state_roundtrip)
    assert all(s == synced[0] for s in synced)


@pytest.mark.parametrize("bump_ranks", [(0,), (0, 1, 2)], ids=["rank0-only", "all-ranks"])
def test_hosts_updated_interrupt_on_all_ranks_at_same_commit(pool, bump_ranks):
    form(pool)
    steps = pool.run(_commit_loop, args=(3, bump_ranks, 8))
    assert steps == [3, 3, 3]


def test_membership_bump_on_non_root_only_is_ignored(pool):
    # Rank 0's view decides (Horovod broadcasts it), so no rank raises alone.
    form(pool)
    assert pool.run(_commit_loop, args=(2, (1,), 4)) == [None, None, None]


def test_a_call_outlasting_the_fast_path_still_succeeds(pool):
    form(pool)
    assert pool.run(_late_peer) == [(6.0, [0, 1, 2])] * 3


def test_mark_peer_lost_makes_next_call_raise_at_once(pool):
    form(pool, timeout=TIMEOUT)
    for first, second in pool.run(_lost_then_call):
        assert "worker tcp://x left" in first and "timed out" not in first + second


def test_mark_peer_lost_wakes_a_waiting_call(pool):
    form(pool, timeout=TIMEOUT)
    [text] = pool.run(_lost_wakes_inflight, ranks=[0])
    assert "a peer left the group" in text and "timed out" not in text
    pool.run(_destroy)


def test_rendezvous_aborts_when_a_peer_is_lost(pool):
    gen = next(_generations)
    (host, port) = pool.run(_create_store, ranks=[0], args=(gen,))[0]
    texts = pool.run(_rendezvous_abort, ranks=[0, 1], args=(host, port, gen))
    assert all("did not arrive" not in t and "timed out" not in t for t in texts), texts


def test_rendezvous_times_out_naming_the_missing_rank(pool):
    gen = next(_generations)
    (host, port) = pool.run(_create_store, ranks=[0], args=(gen,))[0]
    elapsed = pool.run(_rendezvous_timeout, ranks=[0, 1], args=(host, port, gen))
    assert all(e >= 1.0 for e in elapsed), elapsed  # never gives up before its timeout


def test_newer_generation_supersedes_an_init_still_waiting(pool):
    gen = next(_generations)
    (host, port) = pool.run(_create_store, ranks=[0], args=(gen,))[0]
    pool.run(_start_zombie_init, ranks=[0, 1], args=(host, port, gen))
    form(pool, ranks=[0, 1])  # in the test's time: the stuck init's timeout is 600 s
    for name, msg in pool.run(_zombie_outcome, ranks=[0, 1]):
        assert name == "CollectiveError" and "generation" in msg
    out = pool.run(_stale_group_refuses, ranks=[0, 1], args=(gen,))
    assert [o[1:] for o in out] == [(0, 2), (1, 2)]


def test_reform_new_generation_has_no_stale_state(pool):
    old = form(pool)
    pool.run(_ops, args=("float32",))
    pool.run(_destroy)
    pool.run(_get_group_outside)
    # The next generation on a different membership: ranks 2 and 0 (in that order).
    form(pool, ranks=[2, 0])
    out = pool.run(_stale_group_refuses, ranks=[2, 0], args=(old,))
    assert out == [([3.0, 3.0, 3.0], 0, 2), ([3.0, 3.0, 3.0], 1, 2)]
    pool.run(_destroy, ranks=[2, 0])
    form(pool)  # and all three again
    pool.run(_ops, args=("int64",))


def test_hung_peer_raises_collective_error_by_timeout(pool):
    form(pool, timeout=1.5)
    out = pool.run(_allreduce_timed, args=(2, -1))
    assert out[2] == "idle"
    for status, elapsed, msg in out[:2]:
        assert status == "raised", msg
        assert elapsed >= 1.5 and ("timed out" in msg or "Timed out" in msg), (elapsed, msg)


def test_sigkilled_peer_raises_collective_error_quickly(pool):
    form(pool, timeout=TIMEOUT)
    h = pool.submit(_allreduce_timed, [0, 1, 2], (-1, 2))
    # rank 2 dies without answering: collect the survivors only.
    out = pool.collect((h[0], [0, 1]), timeout=20)
    for r in (0, 1):
        status, _elapsed, msg = out[r]
        assert status == "raised", msg  # within the collect's 20 s: the timeout is 600 s
        assert "timed out" not in msg.lower(), msg
    pool.procs[2].join(10)
    assert not pool.procs[2].is_alive()
    # The survivors re-form as generation + 1 and work.
    form(pool, ranks=[0, 1])
    pool.run(_ops, ranks=[0, 1], args=("float32",))


def test_elastic_loop_survives_a_sigkill_and_resumes_on_the_new_group(pool):
    form(pool, timeout=TIMEOUT)
    h = pool.submit(_elastic_train, [0, 1, 2], (2, 3, 6))
    out = pool.collect((h[0], [0, 1]), timeout=30)
    for r in (0, 1):
        status, step, _elapsed = out[r]
        assert (status, step) == ("interrupted", 3)  # back to the last commit, in time
    pool.procs[2].join(10)
    form(pool, ranks=[0, 1])  # the re-formed group; the same State objects go on
    # the survivors of one generation hold the same commit: their sync() compares heads
    # (one allgather) and broadcasts nothing
    synced = pool.run(_sync_calls, ranks=[0, 1])
    assert [calls for calls, _ in synced] == [["allgather"], ["allgather"]]
    for a, b in zip(synced[0][1], synced[1][1], strict=True):
        assert torch.equal(a, b)
    done = pool.run(_elastic_train, ranks=[0, 1], args=(-1, -1, 6))
    assert [d[:2] for d in done] == [("done", 6), ("done", 6)]
    for a, b in zip(done[0][2], done[1][2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_ops(pool):
    if torch.cuda.device_count() < WORLD:
        pytest.skip("needs one GPU per member")
    form(pool, backend="nccl")
    pool.run(_ops, args=("float32",))
