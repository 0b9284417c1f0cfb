"""ShardedState (SPEC §4.5) against torchrun's restart: commit cost, recovery, memory.

A model of ``--params`` parameters (a stack of 1024-wide Linear layers, each its own
FSDP2 unit, then the root) with AdamW trains on 4 CPU workers (gloo, one thread each),
``--batch`` rows a rank per step, from a ``"dynamic"`` dataset (the rows ride the
commits); the Nannies fork their workers from a process with torch imported (the
``daskdist.plugins.fork_server`` preload, as ``docs/hpc.md`` sets it up), so the killed
worker's replacement does not import torch on the cores the survivors train on. Each
figure beside its anchor, from the same run:

- **a commit's share of a step**: ``ShardedState.commit()`` every step (its shard to its
  ring neighbour, the copy kept, the rows acknowledged) over the step without a commit,
  rounds interleaved; anchor: torchrun's DCP checkpoint every 20 steps, per step.
  Target <= 5 %. Both sides' figures are medians: ours of each round's figure (its
  slowest rank's median step), the anchor's over its steps.
- **SIGKILL -> the survivors' next committed step**, and the steps lost (the last
  step reached before the kill minus the step resumed at): ours reshards the last
  commit among the 3 survivors from memory; anchor: ``python -m torch.distributed.run
  --standalone --nproc-per-node=4 --max-restarts=3`` running the same model with FSDP2
  and ``dcp.save`` every 20 steps, which restarts every rank and loads the newest
  checkpoint (SIGKILL -> its first step after the restart). Target <= 2 s. A commit that
  raises ``HostsUpdatedInterrupt`` (the replacement announced itself) was made: it counts.
- **host memory per rank for commits**: the ShardedState's buffers (its shard, its
  neighbour's, the copy being received, the spare of a commit in flight; a neighbour's
  shard mapped from its memory, as on one host, is counted at that neighbour) against a
  replicated ``State``'s (the whole model and optimizer, and its spare). Target <=
  2.5 / N of it.

    python benchmarks/bench_sharded.py [--params 10_000_000] [--batch 128] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from figures import record

WIDTH = 1024
WORLD = 4
EVERY = 20  # the anchor's checkpoint interval (steps)


def make_model(params: int) -> torch.nn.Module:
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH),
                                                     torch.nn.ReLU())
                                 for _ in range(layers)])


def shard(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def step(model, opt, ids: torch.Tensor, batch: int) -> None:
    """One step on ``batch`` rows made from the step's ids (the same work on every rank)."""
    gen = torch.Generator().manual_seed(int(ids[0]) if len(ids) else 0)
    x = torch.randn(batch, WIDTH, generator=gen)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


# -- ours: a ShardedState on 4 Dask workers ------------------------------------------------


class MakeState:
    def __init__(self, params: int):
        self.params = params

    def __call__(self, ctx):
        import functools

        import daskdist as dd

        return dd.collective.ShardedState(model=functools.partial(make_model, self.params),
                                          optimizer=adamw, shard=shard, step=0)


def loop(state, it, steps: int, batch: int, commit: bool, logdir: str) -> dict:
    """A gang: ``steps`` steps (a commit each, or none); times after the first step."""
    import daskdist as dd

    g = dd.collective.get_group()
    state.sync()
    _log(logdir, "resume", state.step, g)
    work, commits = [], []
    for i, b in enumerate(dd.collective.synced(it)):
        t0 = time.perf_counter()
        step(state.model, state.optimizer, b["id"], batch)
        t1 = time.perf_counter()
        state.step += 1
        if commit:
            try:
                state.commit()
            except dd.collective.HostsUpdatedInterrupt:  # committed, then interrupted
                _log(logdir, "commit", state.step, g)
                raise
            _log(logdir, "commit", state.step, g)
        t2 = time.perf_counter()
        if i:
            work.append(t1 - t0)
            commits.append(t2 - t1)
        if i + 1 >= steps or (logdir and (Path(logdir) / "stop").exists()):
            break
    whole = sum(int(np.prod(e.shape)) * e.dtype.itemsize for e in state._shards.saved.cut.entries)
    return {"work": statistics.median(work), "commit": statistics.median(commits),
            "held": state.commit_bytes, "whole": whole, "rank": g.rank}


def _log(logdir: str, kind: str, step_: int, g) -> None:
    if logdir and g.rank == 0:
        with open(Path(logdir) / "ours.log", "a") as f:
            f.write(f"{time.time()} {kind} {step_} {g.world_size}\n")


def _events(path: Path) -> list[tuple[float, str, int]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        t, kind, s, *_ = line.split()
        out.append((float(t), kind, int(s)))
    return out


def ours(args, tmp: Path) -> dict:
    import dask
    from distributed import Client, LocalCluster

    import daskdist as dd

    rows = 1_000_000
    for f in range(4):
        ids = np.arange(f * rows // 4, (f + 1) * rows // 4, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), tmp / f"p{f}.parquet", row_group_size=4096)
    logdir = tmp / "log"
    logdir.mkdir()
    # a replacement forks from a process with torch imported (the setup docs/hpc.md gives)
    with dask.config.set({"distributed.nanny.preload": ["daskdist.plugins.fork_server"]}), \
            LocalCluster(n_workers=WORLD, threads_per_worker=1, processes=True,
                         dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client, name="bench-sharded")
        coord.wait_for_workers(WORLD, timeout=300)
        coord.collective_group(backend="gloo", timeout=120)
        state = coord.create_per_worker_resource(MakeState(args.params))
        ds = coord.distribute_dataset(str(tmp / "*.parquet"), global_batch_size=WORLD,
                                      policy="dynamic", shuffle=False, prefetch=0)
        it = iter(ds)
        rounds = {"off": [], "on": []}
        for r in range(args.rounds):
            for side in ("off", "on"):
                out = coord.fetch(coord.schedule_on_all(
                    loop, args=(state, it, args.steps, args.batch, side == "on", "")))
                rounds[side].append(out)
            print(f"  round {r + 1}: step {max(o['work'] for o in rounds['off'][-1]):.3f} s "
                  f"without a commit, {max(o['work'] for o in rounds['on'][-1]):.3f} s + "
                  f"commit {max(o['commit'] for o in rounds['on'][-1]):.3f} s with",
                  flush=True)
        # recovery: SIGKILL rank 2 mid-loop (its nanny restarts it: it joins later)
        members = coord._call("daskdist_group_info")["members"]
        victim = client.run(os.getpid, workers=[members[2]])[members[2]]
        gang = coord.schedule_on_all(loop, args=(state, it, 10**6, args.batch, True,
                                                 str(logdir)))
        log = logdir / "ours.log"
        _wait(lambda: sum(e[1] == "commit" for e in _events(log)) >= 4, 600, "ours: steps")
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: _stepped_after(log, t_kill), 600, "ours: a step after the kill")
        (logdir / "stop").touch()
        try:
            coord.fetch(gang)
        except Exception:  # noqa: BLE001 - the gang's runs after the kill: measured above
            pass
        coord.close()
    ev = _events(log)
    before = max(e[2] for e in ev if e[1] == "commit" and e[0] < t_kill)
    resume = next(e for e in ev if e[1] == "resume" and e[0] > t_kill)
    after = next(e for e in ev if e[1] == "commit" and e[0] > resume[0])
    # the median over rounds of each round's figure (its slowest rank's median step), the
    # statistic the anchor's figures take over its steps
    def over_rounds(side: str, field: str) -> float:
        return statistics.median(max(x[field] for x in o) for o in rounds[side])

    return {"step": over_rounds("off", "work"), "step_on": over_rounds("on", "work"),
            "commit": over_rounds("on", "commit"),
            "held": max(x["held"] for o in rounds["on"] for x in o),
            "whole": rounds["on"][0][0]["whole"],
            "recovery": after[0] - t_kill, "synced": resume[0] - t_kill,
            "lost": before + 1 - resume[2]}


def _stepped_after(log: Path, t_kill: float, first: str = "resume",
                   then: str = "commit") -> bool:
    """Whether ``log`` shows a ``first`` after ``t_kill`` and a ``then`` after that."""
    ev = _events(log)
    starts = [e[0] for e in ev if e[1] == first and e[0] > t_kill]
    return bool(starts) and any(e[1] == then and e[0] > starts[0] for e in ev)


def _wait(pred, timeout: float, what: str) -> None:
    """Poll ``pred`` (a file the ranks write) until it holds; fail after ``timeout`` s."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- the anchor: torchrun --max-restarts, FSDP2, DCP every 20 steps -------------------------


def child(params: int, batch: int, ckpt: str, logdir: str) -> None:
    """One torchrun rank: resume from the newest checkpoint, then step, saving every
    EVERY steps; rank 0 logs its steps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    # the agent's store outlives a restart: keys of this attempt's own, so the ranks of
    # a restart never read the addresses of the attempt before (gloo: refused)
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}",
                             dist.TCPStore(os.environ["MASTER_ADDR"],
                                           int(os.environ["MASTER_PORT"]), is_master=False))
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    (Path(logdir) / f"pid-{rank}").write_text(str(os.getpid()))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model(params)
    shard(model, mesh)
    opt = adamw(model.parameters())
    done = sorted(int(p.parent.name.split("-")[1]) for p in Path(ckpt).glob("step-*/.metadata"))
    start = 0
    if done:
        start = done[-1]
        # a step so the optimizer holds its state, then the checkpoint over it
        step(model, opt, torch.zeros(1, dtype=torch.int64), batch)
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt}/step-{start}")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _tlog(logdir, rank, "resume", start)
    for s in range(start + 1, 10**6):
        step(model, opt, torch.tensor([s]), batch)
        _tlog(logdir, rank, "step", s)
        if s % EVERY == 0:
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt}/step-{s}")
            _tlog(logdir, rank, f"saved:{time.perf_counter() - t0:.4f}", s)


def _tlog(logdir: str, rank: int, kind: str, s: int) -> None:
    if rank == 0:
        with open(Path(logdir) / "anchor.log", "a") as f:
            f.write(f"{time.time()} {kind} {s}\n")


def anchor(args, tmp: Path) -> dict:
    logdir, ckpt = tmp / "alog", tmp / "ackpt"
    logdir.mkdir()
    ckpt.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", "--max-restarts=3", "--monitor-interval=0.1",
           __file__, "--child", "--params", str(args.params), "--batch", str(args.batch),
           "--ckpt", str(ckpt), "--logdir", str(logdir)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    log = logdir / "anchor.log"
    try:
        _wait(lambda: any(e[1] == "step" and e[2] >= EVERY + 5 for e in _events(log))
              or proc.poll() is not None, 1800, "anchor: a checkpoint and 5 steps")
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun ended: {proc.stderr.read().decode()[-3000:]}")
        victim = int((logdir / "pid-2").read_text())
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: _stepped_after(log, t_kill, then="step") or proc.poll() is not None,
              1800, "anchor: a step after the restart")
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun ended: {proc.stderr.read().decode()[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    ev = _events(log)
    steps = [e for e in ev if e[1] == "step" and e[0] < t_kill]
    gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False)
            if b[2] == a[2] + 1 and b[2] % EVERY != 1]
    saves = [float(e[1].split(":")[1]) for e in ev if e[1].startswith("saved:")]
    resume = next(e for e in ev if e[1] == "resume" and e[0] > t_kill)
    after = next(e for e in ev if e[1] == "step" and e[0] > resume[0])
    return {"step": statistics.median(gaps), "save": statistics.median(saves),
            "recovery": after[0] - t_kill, "synced": resume[0] - t_kill,
            "lost": steps[-1][2] + 1 - resume[2]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=128, help="rows a rank per step")
    ap.add_argument("--steps", type=int, default=8, help="steps a round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--logdir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.params, args.batch, args.ckpt, args.logdir)
        return
    torch.set_num_threads(1)
    n = sum(p.numel() for p in make_model(args.params).parameters())
    print(f"{n / 1e6:.1f} M parameters + AdamW, {WORLD} CPU workers (gloo, 1 thread "
          f"each), {args.batch} rows a rank per step; load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print("ours (ShardedState, a commit every step):", flush=True)
        o = ours(args, tmp)
        print("anchor (torchrun --max-restarts, FSDP2, DCP every 20 steps):", flush=True)
        a = anchor(args, tmp)
    share = o["commit"] / o["step_on"]
    anchor_share = a["save"] / EVERY / a["step"]
    mem = o["held"] / (2 * o["whole"])  # a replicated State: the whole, and its spare
    print(f"\nload {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (a shared machine: "
          f"slower and noisier than an idle one)")
    rows = [
        ("step (no commit / no checkpoint)", f"{o['step']:.3f} s", f"{a['step']:.3f} s",
         f"{o['step'] / a['step']:.2f}x"),
        ("commit / checkpoint share of a step", f"{share:.1%} (every step)",
         f"{anchor_share:.1%} (every {EVERY})", "target <= 5%"),
        ("SIGKILL -> next committed step", f"{o['recovery']:.2f} s", f"{a['recovery']:.2f} s",
         f"{o['recovery'] / a['recovery']:.2f}x (target <= 2 s)"),
        ("  of which: SIGKILL -> state loaded", f"{o['synced']:.2f} s", f"{a['synced']:.2f} s",
         f"{o['synced'] / a['synced']:.2f}x (then the step redone)"),
        ("steps lost per failure", f"{o['lost']}", f"{a['lost']}", ""),
        ("host memory per rank for commits", f"{o['held'] / 2**20:.0f} MiB",
         f"{2 * o['whole'] / 2**20:.0f} MiB (a replica, x2)",
         f"{mem:.3f} = {mem * WORLD:.2f}/N (target <= 2.5/N)"),
    ]
    print(f"{'':38}{'ours':>22}{'anchor':>30}  ratio")
    for name, ours_, anchor_, ratio in rows:
        print(f"{name:38}{ours_:>22}{anchor_:>30}  {ratio}")
    size = f"{n / 1e6:.0f} M parameters + AdamW, {WORLD} workers, gloo"
    record(None, what=f"a commit every step, as a share of the step ({size})", ours=share * 100,
           unit="%", anchor=f"torchrun's DCP checkpoint every {EVERY} steps, a step's share",
           anchor_value=anchor_share * 100, target="≤ 5% of the step", met=share <= 0.05)
    record(None, what=f"SIGKILL → the survivors' next committed step, from memory ({size})",
           ours=o["recovery"], unit="s",
           anchor="`torchrun --max-restarts`: every rank restarted, DCP reloaded",
           anchor_value=a["recovery"], target="≤ 2 s", met=o["recovery"] <= 2)
    record(None, what="steps lost per SIGKILL", ours=float(o["lost"]), unit="steps",
           anchor=f"`torchrun --max-restarts`, DCP every {EVERY} steps",
           anchor_value=float(a["lost"]))
    record(None, what=f"host memory per rank for commits ({size})", ours=o["held"] / 2**20,
           unit="MiB", anchor="a replicated `State`'s copies (the whole state, twice)",
           anchor_value=2 * o["whole"] / 2**20, target=f"≤ 2.5/N = {2.5 / WORLD:.3f}x",
           met=mem <= 2.5 / WORLD)
    print(json.dumps({"ours": o, "anchor": a}))


if __name__ == "__main__":
    main()
