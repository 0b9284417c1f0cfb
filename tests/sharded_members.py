"""Members of a collective group run as plain processes (no Dask), for the ShardedState
tests (tests/test_sharded_state.py): each process runs its part of a scenario, a list of
generations, each naming its members (process ids, in rank order) and what they do."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from typing import Any

import torch

IN, OUT, HIDDEN = 6, 5, 12


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, OUT))


def shard_blocks(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_state(url: str | None):
    import daskdist as dd

    state = dd.collective.ShardedState(
        model=make_model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.01),
        shard=shard_blocks, step=0)
    return state.checkpoint_to(url, every=2) if url else state


def train(state, steps: int, seed: int, cut_short: bool = False) -> bool:
    """``steps`` steps, a commit each; ``cut_short``: the last commit's allgather fails
    on this rank after its part went out (the others complete that commit), as when a
    peer dies inside it. Whether the last commit raised here."""
    g = state_group()
    for i in range(steps):
        torch.manual_seed(seed * 100 + i * 10 + g.rank)
        state.model(torch.randn(4, IN)).pow(2).mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1
        if cut_short and i == steps - 1:
            return _commit_cut_short(state)
        state.commit()
    return False


def _commit_cut_short(state) -> bool:
    from daskdist.collective.group import Group
    from daskdist.errors import CollectiveError

    real = Group.allgather

    def allgather(self, tensor):
        real(self, tensor)
        raise CollectiveError("test: the allgather failed here after its part went out")

    Group.allgather = allgather
    try:
        state.commit()
    except CollectiveError:
        return True
    finally:
        Group.allgather = real
    return False


def state_group():
    from daskdist.collective import get_group

    return get_group()


def member(pid: int, scenario: list[dict], addrs: dict, go: dict, out: Any,
           url: str | None) -> None:
    """Process ``pid``'s part of ``scenario``: each generation it is a member of starts
    when the test sets ``go[gen]`` (the previous one ended everywhere), is formed (rank
    0 opens the store), then its actions run; what it saw goes to ``out``, and
    ``(gen, pid, "done")`` when its part of the generation ended."""
    import dask

    from daskdist.collective import create_store, destroy_member, init_member

    torch.set_num_threads(1)
    state = None
    try:
        for gen, step in enumerate(scenario, start=1):
            members = step["members"]
            if pid not in members:
                continue
            go[gen].wait(120)
            rank, world = members.index(pid), len(members)
            if rank == 0:
                host, port = create_store(gen, "127.0.0.1")
                for _ in range(world - 1):
                    addrs[gen].put((host, port))
            else:
                host, port = addrs[gen].get(timeout=120)
            init_member(rank, world, host, port, "gloo", gen, 60.0)
            if state is None or step.get("fresh"):
                state = make_state(url)
            # a member in "wire" copies its commits on the wire, never by a mapping
            dask.config.set({"daskdist.collective.shard-shared-memory":
                             pid not in step.get("wire", ())})
            reads = _count_reads(state)
            before = reads[0]
            try:
                state.sync()
            except Exception as e:  # noqa: BLE001 - reported to the test
                out.put((gen, pid, "error", type(e).__name__, str(e)))
                out.put((gen, pid, "done"))
                destroy_member()
                return
            full = state.full_state_dict(optimizer=True)
            out.put((gen, pid, "synced", state.commits, state.step, reads[0] - before,
                     {k: v.tolist() for k, v in full.items()}, sorted(state._shards.ring.local[1])))
            if train(state, step.get("steps", 0), seed=gen, cut_short=step.get("cut") == pid):
                out.put((gen, pid, "cut"))
            if step.get("steps"):
                full = state.full_state_dict(optimizer=True)
                out.put((gen, pid, "committed", state.commits, state.step, 0,
                         {k: v.tolist() for k, v in full.items()}))
                # an uncommitted step: the next sync() goes back to the commit
                state.model(torch.randn(4, IN)).sum().backward()
                state.optimizer.step()
            if state._durable is not None:
                state._durable.store.wait()  # its checkpoint parts are written
            out.put((gen, pid, "done"))
        destroy_member()
    except Exception:  # noqa: BLE001 - reported to the test
        out.put((0, pid, "crash", traceback.format_exc()))


def _count_reads(state) -> list[int]:
    """How often ``state``'s checkpoint store was read (a list: counted in place)."""
    count = [0]
    durable = state._durable
    if durable is not None and not hasattr(durable, "_counted"):
        for name in ("read_rest", "read_rows"):
            fn = getattr(durable, name)

            def counted(*a, _fn=fn, **k):
                count[0] += 1
                return _fn(*a, **k)
            setattr(durable, name, counted)
        durable._counted = count
    return getattr(durable, "_counted", count)


def freeze_member(rank: int, world: int, addr_q: Any, ready: Any, lost: Any,
                  out: Any) -> None:
    """A member of one generation training a sharded model; the last rank stops itself
    (SIGSTOP) mid-training, the others report how long their next FSDP collective
    took to fail after the lost mark (what the scheduler's word does)."""
    from daskdist.collective import create_store, init_member, mark_peer_lost

    torch.set_num_threads(1)
    if rank == 0:
        host, port = create_store(1, "127.0.0.1")
        for _ in range(world - 1):
            addr_q.put((host, port))
    else:
        host, port = addr_q.get(timeout=120)
    init_member(rank, world, host, port, "gloo", 1, 60.0)
    state = make_state(None)
    state.sync()
    train(state, 2, seed=1)
    ready.put(rank)
    if rank == world - 1:
        ready.close()
        ready.join_thread()  # the message left before the process stops
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    marked = []

    def mark() -> None:
        """Once the frozen peer stopped and a collective waits on it: the lost mark."""
        from daskdist.collective.bootstrap import PROCESS

        lost.wait(120)
        deadline = time.monotonic() + 60
        while not PROCESS.waiters and time.monotonic() < deadline:
            time.sleep(0.01)
        marked.append(time.monotonic())
        mark_peer_lost(1, "test: a peer froze")

    threading.Thread(target=mark, daemon=True).start()
    try:
        while True:
            state.model(torch.randn(4, IN)).pow(2).mean().backward()
            state.optimizer.step()
            state.optimizer.zero_grad()
    except Exception as e:  # noqa: BLE001 - reported to the test
        t = time.monotonic()
        out.put((rank, type(e).__name__, t - marked[0] if marked else None))
