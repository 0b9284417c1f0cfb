"""ShardedState on plain processes (no Dask; tests/sharded_members.py): FSDP2 over gloo,
members lost and joining between generations, each sync() compared bit for bit with the
last commit (parameters and both Adam moments):

- 4 ranks lose rank 0: the 3 survivors reshard from their copies, reading no storage
  (copies between the processes are mappings of the shard, and on the wire to and from
  a member that shares no memory);
- two ring neighbours lost: the newest checkpoint (every rank wrote its part), 3 -> 1;
- a fresh member joins: 1 -> 2 from memory; a new group of fresh States (a new job)
  resumes 2 -> 3 from the checkpoint;
- a commit whose allgather fails on one rank only: taken from what that rank staged;
- without a checkpoint, a lost pair of neighbours is a ``CollectiveError``;
- a frozen peer: FSDP2's own collective on the survivors ends with ``CollectiveError``
  within a second of the lost mark, not after the 60 s group timeout.
"""

from __future__ import annotations

import pytest
import torch

from tests import sharded_members
from tests.processes import process_context

pytestmark = pytest.mark.timeout(300)


def run(scenario: list[dict], processes: int, url: str | None) -> list[tuple]:
    """Run ``scenario`` on ``processes`` member processes; every message they sent."""
    ctx = process_context()
    gens = range(1, len(scenario) + 1)
    addrs = {g: ctx.Queue() for g in gens}
    go = {g: ctx.Event() for g in gens}
    out = ctx.Queue()
    procs = [ctx.Process(target=sharded_members.member,
                         args=(pid, scenario, addrs, go, out, url), daemon=True)
             for pid in range(processes)]
    for p in procs:
        p.start()
    seen: list[tuple] = []
    ok = False
    try:
        for gen, step in zip(gens, scenario, strict=True):
            go[gen].set()
            done = set()
            while done != set(step["members"]):
                msg = out.get(timeout=240)
                assert msg[2] != "crash", msg[3]
                seen.append(msg)
                if msg[2] == "done" and msg[0] == gen:
                    done.add(msg[1])
        ok = True
    finally:
        for p in procs:
            p.join(30 if ok else 0)
            if p.is_alive():
                p.kill()
                p.join(30)
    return seen


def fulls(seen: list[tuple], gen: int, kind: str) -> list[dict]:
    return [m[6] for m in seen if m[0] == gen and m[2] == kind]


def one(seen: list[tuple], gen: int, kind: str) -> dict:
    """The one state every rank of ``gen`` reported for ``kind`` (they all agree)."""
    got = fulls(seen, gen, kind)
    assert got and all(f == got[0] for f in got)
    return got[0]


@pytest.mark.slow
def test_losses_joins_and_a_new_job_reshard_the_last_commit_bit_for_bit(tmp_path):
    url = str(tmp_path / "ckpt")
    scenario = [
        # commits 1-4, checkpoints at 2 and 4; process 2 copies on the wire
        {"members": [0, 1, 2, 3], "steps": 4, "wire": [2]},
        {"members": [1, 2, 3], "steps": 2},     # rank 0 lost; commits 5-6, checkpoint 6
        {"members": [3], "steps": 1},           # 1 and 2 lost: neighbours; commit 7
        {"members": [3, 4], "steps": 1},        # a fresh member joins; commit 8, ckpt 8
        {"members": [2, 4, 0], "fresh": True},  # a new job: fresh States, 3 ranks
    ]
    seen = run(scenario, 5, url)
    synced = {(m[0], m[1]): m for m in seen if m[2] == "synced"}
    # one host: a copy is a mapping of the shard, but to and from the wire-only member
    assert {m[7] == [0, 3] for k, m in synced.items() if k[0] == 1} == {True}
    assert {m[7] == [0, 1, 2] for k, m in synced.items() if k[0] == 2} == {True}
    # 4 -> 3 after rank 0's loss: the last commit, from memory (no storage read)
    assert one(seen, 2, "synced") == one(seen, 1, "committed")
    assert {(m[3], m[4], m[5]) for k, m in synced.items() if k[0] == 2} == {(4, 4, 0)}
    # 3 -> 1 after two neighbours: shard 0 had no holder left: the checkpoint of commit 6
    assert one(seen, 3, "synced") == one(seen, 2, "committed")
    assert synced[(3, 3)][3:5] == (6, 6) and synced[(3, 3)][5] > 0
    # 1 -> 2: the newcomer takes its shard from the survivor's commit
    assert one(seen, 4, "synced") == one(seen, 3, "committed")
    assert {m[5] for k, m in synced.items() if k[0] == 4} == {0}
    # a new job of 3 fresh States resumes from the newest checkpoint, resharded 2 -> 3
    assert one(seen, 5, "synced") == one(seen, 4, "committed")
    assert {m[3] for k, m in synced.items() if k[0] == 5} == {8}
    # the optimizer state came with it: both Adam moments of every parameter
    keys = one(seen, 5, "synced").keys()
    assert sum(k.endswith(".exp_avg_sq") for k in keys) == 6


@pytest.mark.slow
def test_a_commit_cut_short_on_one_rank_and_a_lost_pair_of_neighbours():
    """Commit 2's allgather fails on rank 1 after its part went out (as when a peer dies
    inside it): the others commit, rank 1 keeps what it staged. Then rank 2, the only
    other holder of rank 1's shard, is lost: the survivors still take commit 2 from
    memory, rank 1's shard from what it staged. Then two ring neighbours are lost with
    no checkpoint: ``CollectiveError``, never a fresh start."""
    scenario = [{"members": [0, 1, 2, 3], "steps": 2, "cut": 1},
                {"members": [0, 1, 3], "steps": 1},
                {"members": [3]}]
    seen = run(scenario, 4, None)
    assert [m[:3] for m in seen if m[2] == "cut"] == [(1, 1, "cut")]
    assert one(seen, 2, "synced") == one(seen, 1, "committed")
    assert {m[3] for m in seen if m[0] == 2 and m[2] == "synced"} == {2}
    (err,) = [m for m in seen if m[2] == "error"]
    assert err[3] == "CollectiveError" and "no member holds shards [0]" in err[4]


@pytest.mark.slow
def test_a_frozen_peer_ends_fsdp_collectives_within_a_second_of_the_lost_mark():
    ctx = process_context()
    world = 3
    addr_q, ready, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    lost = ctx.Event()
    procs = [ctx.Process(target=sharded_members.freeze_member,
                         args=(r, world, addr_q, ready, lost, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for _ in range(world):
            ready.get(timeout=240)
        lost.set()
        got = sorted(out.get(timeout=60) for _ in range(world - 1))
    finally:
        for p in procs:
            p.kill()
            p.join(30)
    for _rank, kind, seconds in got:
        assert kind == "CollectiveError", got
        assert seconds is not None and seconds < 2.0, got  # the group timeout is 60 s


def test_bad_arguments_say_what_to_pass():
    import daskdist as dd

    with pytest.raises(TypeError, match="takes a function"):
        dd.collective.ShardedState(model=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model= "):
        dd.collective.ShardedState(model=None)
    state = dd.collective.ShardedState(model=lambda: torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="no collective group"):
        state.commit()


def test_a_model_a_commit_is_loaded_into_is_built_on_the_meta_device_when_it_can_be():
    """Built on the meta device, unless the build makes buffers no commit holds."""
    from daskdist.collective.sharded.keeper import ShardKeeper
    from daskdist.collective.state.keeper import Subject

    class Scaled(torch.nn.Linear):
        def __init__(self):
            super().__init__(3, 2)
            self.register_buffer("scale", torch.full((2,), 0.5), persistent=False)

    def keeper(build):  # what a ShardedState keeps its model and copies with
        return ShardKeeper(Subject(None, None, {}), build, None, None)

    plain = keeper(lambda: torch.nn.Linear(3, 2))
    assert plain.built_model(meta=True).weight.is_meta
    assert not plain.built_model(meta=False).weight.is_meta
    scaled = keeper(Scaled).built_model(meta=True)
    assert not scaled.weight.is_meta and scaled.scale.tolist() == [0.5, 0.5]
    with pytest.raises(TypeError, match="returned int"):
        keeper(lambda: 3).built_model(meta=True)
