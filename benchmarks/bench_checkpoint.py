"""Durable commits: what an async checkpoint every 20 steps costs a training
loop, and how long a new cluster takes to resume.

A 100 MB model (a stack of Linear layers, float32) trains on 2 workers (gloo, one
thread each), one commit per step. Two runs, interleaved, of the same loop:

- anchor: ``State(...)`` with no checkpoint;
- ours: ``State(...).checkpoint_to(dir, every=20)`` (rank 0 writes in the background).

Printed: the mean step and the mean ``commit()`` of each, and the extra time per step
that checkpointing costs, as a fraction of the anchor's step (target ≤ 5%). Then the
whole cluster is closed, a new one (2 fresh workers, a new client) is started, and the
seconds from its start to its first committed step after resuming from the newest
checkpoint are printed, split at the group's formation.

    python benchmarks/bench_checkpoint.py [--mb 100] [--steps 60] [--every 20]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time

import torch
from distributed import Client, LocalCluster
from figures import record

import daskdist as dd


def make_model(mb: int) -> torch.nn.Module:
    width = 2048
    layers = max(1, int(mb * 2**20 / 4 / (width * width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                 for _ in range(layers)])


class MakeState:
    def __init__(self, mb: int, url: str | None, every: int):
        self.mb, self.url, self.every = mb, url, every

    def __call__(self, ctx):
        torch.manual_seed(0)
        model = make_model(self.mb)
        state = dd.collective.State(model=model,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=1e-4),
                                    step=0)
        return state if self.url is None else state.checkpoint_to(self.url, self.every)


def train(state, steps: int, first_only: bool = False):
    """``steps`` steps, a commit each; per step (seconds, of which commit) after warm-up."""
    state.sync()
    g = dd.collective.get_group()
    x = torch.randn(8, 2048)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state.model(x).square().mean().backward()
        dd.collective.allreduce_gradients(state.model)
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1
        t1 = time.perf_counter()
        state.commit()
        t2 = time.perf_counter()
        out.append((t2 - t0, t2 - t1, time.time()))
        if first_only:
            break
    if state._durable is not None and g.rank == 0:
        state._durable.store.wait()  # the last write completes before the job ends
    return state.step, out


def run(client: Client, name: str, mb: int, url: str | None, every: int, steps: int):
    coord = dd.Coordinator(client, name=name, torch_threads=1)
    try:
        coord.collective_group(backend="gloo", timeout=300)
        state = coord.create_per_worker_resource(MakeState(mb, url, every))
        ranks = coord.fetch(coord.schedule_on_all(train, args=(state, steps)))
        per = ranks[0][1][3:]  # warm-up steps left out
        return (sum(s for s, _, _ in per) / len(per), sum(c for _, c, _ in per) / len(per))
    finally:
        coord.close()


def resume(url: str, mb: int, every: int, workers: int) -> tuple[float, float, int]:
    """A new cluster resumes: (start -> group formed s, start -> first committed step s,
    the resumed step count)."""
    t0 = time.time()
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client, name="resume", torch_threads=1)
        coord.wait_for_workers(workers, timeout=120)
        coord.collective_group(backend="gloo", timeout=300)
        formed = time.time() - t0
        state = coord.create_per_worker_resource(MakeState(mb, url, every))
        step, out = coord.fetch(coord.schedule_on_all(train, args=(state, 1, True)))[0]
        first = out[0][2] - t0
        coord.close()
    return formed, first, step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved runs of each")
    a = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="daskdist-ckpt-")
    try:
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
                Client(cluster) as client:
            plain, ours = [], []
            for r in range(a.rounds):
                plain.append(run(client, f"plain-{r}", a.mb, None, a.every, a.steps))
                ours.append(run(client, f"ckpt-{r}", a.mb, f"{root}/run-{r}", a.every,
                                a.steps))
        p_step = min(s for s, _ in plain)
        p_commit = min(c for _, c in plain)
        o_step = min(s for s, _ in ours)
        o_commit = min(c for _, c in ours)
        print(f"{a.mb} MB model, 2 workers (gloo), a commit per step, best of {a.rounds} "
              f"interleaved runs of {a.steps} steps:")
        print(f"  no checkpoint (anchor)         step {p_step * 1e3:8.1f} ms, commit "
              f"{p_commit * 1e3:7.1f} ms")
        print(f"  checkpoint every {a.every:<3} (ours)    step {o_step * 1e3:8.1f} ms, commit "
              f"{o_commit * 1e3:7.1f} ms")
        extra = max(0.0, o_step - p_step)
        record(f"  extra per step {extra * 1e3:.1f} ms = {extra / p_step:.1%} of the anchor's "
               f"step; commit blocked {max(0.0, o_commit - p_commit) * 1e3:.1f} ms more "
               f"(target <= 5%)",
               what=f"a step with an async checkpoint every {a.every} steps, {a.mb} MB "
               "model, 2 workers", ours=o_step * 1e3, unit="ms",
               anchor="the same step, no checkpoint", anchor_value=p_step * 1e3,
               target="≤ 1.05x", met=extra / p_step <= 0.05)
        formed, first, step = resume(f"{root}/run-{a.rounds - 1}", a.mb, a.every, 2)
        record(f"new cluster -> first resumed step: {first:.2f} s (group formed after "
               f"{formed:.2f} s; resumed at step {step - 1} from the newest checkpoint)",
               what=f"a new cluster's start → its first step resumed from the newest "
               f"checkpoint ({a.mb} MB)", ours=first, unit="s",
               anchor="its group formed", anchor_value=formed)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
