"""The sharded training the ShardedState cluster tests run (tests/test_sharded.py),
pickled by reference: a model whose parameter ``counts`` gains each step's batch ids
(its gradient is minus their bincount, summed over the group), beside a small MLP with
momentum (so the optimizer holds split state), both sharded with FSDP2.

A step is committed once (``state.step`` counts the committed steps). Every rank writes
its shard of the state it is about to commit (``pre-<step>-g<gen>``) and of the state
each ``sync()`` gave it (``resume-g<gen>``) under a log directory, so a test rebuilds
the whole state of any step a rank resumed at and compares them bit for bit: a commit
can only have happened if every rank of its generation wrote its shard first (the
latest generation that did is the one whose commit it is).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import daskdist as dd

N_ROWS = 2400
BATCH = 48  # rows of a step, over all ranks
FEATURES = 4


class CountNet(torch.nn.Module):
    """``counts`` (a float64 per row id) trained to count the rows it saw, and an MLP."""

    def __init__(self, n: int = N_ROWS):
        super().__init__()
        self.counts = torch.nn.Parameter(torch.zeros(n, dtype=torch.float64))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor, x: torch.Tensor, world: int) -> torch.Tensor:
        # the gradient of counts is -world * bincount(ids); FSDP2 averages it over the
        # world, and SGD at lr 1 adds the group's bincount to counts: exact in float64
        seen = -world * self.counts[ids].sum()
        return seen + self.mlp(x).pow(2).mean().double()


def shard(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.mlp, mesh=mesh)  # one dtype per FSDP module (reduce-scatter)
    fully_shard(model, mesh=mesh)


def optimizer(params) -> torch.optim.Optimizer:
    params = list(params)
    counts, mlp = params[0], params[1:]
    return torch.optim.SGD([{"params": [counts], "lr": 1.0},
                            {"params": mlp, "lr": 0.01, "momentum": 0.9}], lr=1.0)


class MakeState:
    """A per-worker ShardedState of :class:`CountNet` (checkpointed when given a url)."""

    def __init__(self, url: str | None = None, every: int = 3):
        self.url, self.every = url, every

    def __call__(self, ctx):
        state = dd.collective.ShardedState(model=CountNet, optimizer=optimizer, shard=shard,
                                           step=0)
        return state.checkpoint_to(self.url, every=self.every) if self.url else state


def local_shards(state) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter and optimizer state (its FSDP2 shard)."""
    out = {}
    for name, p in state.model.named_parameters():
        out[name] = p.to_local().detach().cpu().clone()
        for k, v in state.optimizer.state.get(p, {}).items():
            if hasattr(v, "to_local"):
                out[f"{name}.{k}"] = v.to_local().detach().cpu().clone()
    return out


def log_shards(logdir: str, tag: str, state) -> None:
    g = dd.collective.get_group()
    path = Path(logdir) / f"{tag}.r{g.rank}-of-{g.world_size}.pt"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"step": state.step, "shards": local_shards(state)}, tmp)
    tmp.replace(path)


def train_rows(state, it, logdir: str, pause: float = 0.0, max_steps: int = 0) -> tuple:
    """A gang closure: a commit per step until the rows run out (or ``max_steps``)."""
    g = dd.collective.get_group()
    state.sync()
    resumed = state.commits
    log_shards(logdir, f"resume-g{g.generation}-s{state.step}", state)
    try:
        return _steps(state, it, logdir, pause, max_steps, g, resumed)
    except BaseException as e:
        with open(Path(logdir) / f"errors.{os.getpid()}", "a") as f:
            import traceback
            f.write(f"{time.time()} {g.generation} {g.rank} {type(e).__name__} {e}\n")
            f.write("".join(traceback.format_tb(e.__traceback__)[-6:]) + "\n")
        raise


def _steps(state, it, logdir, pause, max_steps, g, resumed):
    steps = 0
    for batch in dd.collective.synced(it):
        ids = batch["id"]
        torch.manual_seed(state.step)
        x = torch.randn(len(ids), FEATURES)
        state.model(ids, x, g.world_size).backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1
        steps += 1
        time.sleep(pause)
        log_shards(logdir, f"pre-{state.step}-g{g.generation}", state)
        state.commit()
        if max_steps and steps >= max_steps:
            break
    return g.rank, g.world_size, g.generation, resumed, steps


def final_counts(state) -> tuple[int, list[float]]:
    """The committed number of commits and per-row counts (every rank alike)."""
    state.sync()
    return state.commits, state.full_state_dict()["counts"].tolist()


def whole(logdir: str, tag: str) -> dict[str, torch.Tensor] | None:
    """The whole state the ranks logged under ``tag`` (their shards put back together
    in rank order), or ``None`` when not every rank logged it."""
    files = list(Path(logdir).glob(f"{tag}.r*-of-*.pt"))
    if not files:
        return None
    world = int(files[0].name.rsplit("-of-", 1)[1].split(".")[0])
    parts = {int(f.name.split(".r", 1)[1].split("-of-")[0]): torch.load(f)["shards"]
             for f in files}
    if sorted(parts) != list(range(world)):
        return None
    return {k: torch.cat([parts[r][k] for r in range(world)]) for k in parts[0]}


def committed(logdir: str, step: int, upto: int) -> dict[str, torch.Tensor] | None:
    """The whole state of step ``step`` as the ranks logged it before committing it: the
    latest generation up to ``upto`` in which every rank logged it."""
    gens = sorted({int(f.name.split("-g", 1)[1].split(".")[0])
                   for f in Path(logdir).glob(f"pre-{step}-g*.pt")}, reverse=True)
    for gen in gens:
        if gen <= upto:
            state = whole(logdir, f"pre-{step}-g{gen}")
            if state is not None:
                return state
    return None


def resumes(logdir: str) -> list[tuple[int, int, int, float]]:
    """(generation, world size, step resumed at, when) of every sync rank 0 logged."""
    out = []
    for f in Path(logdir).glob("resume-g*.r0-of-*.pt"):
        gen = int(f.name.split("-g", 1)[1].split("-")[0])
        world = int(f.name.rsplit("-of-", 1)[1].split(".")[0])
        out.append((gen, world, torch.load(f)["step"], f.stat().st_mtime))
    return sorted(out, key=lambda r: r[3])


def last_commit_before(logdir: str, t: float) -> int:
    """The newest step rank 0 had logged (about to commit it) before time ``t``."""
    best = 0
    for f in Path(logdir).glob("pre-*-g*.r0-of-*.pt"):
        c = int(f.name.split("-")[1])
        if c > best and f.stat().st_mtime < t:
            best = c
    return best
