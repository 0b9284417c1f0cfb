"""Synchronous training fault-free and under chaos: daskdist against torchrun.

The same job on both, fault-free and with a worker SIGKILLed every ``--kill-every`` seconds.

The job (the defaults): 240,000 rows in 24 Parquet files (``id``, ``x``: 32 float32,
``y``), an MLP 32-256-256-1 with Adam, 3 ranks on gloo, 64 rows a rank per step and
25 ms of simulated compute a step (a ``time.sleep`` before the forward pass).

- **daskdist**: a ``LocalCluster`` of 3 worker processes (1 thread each, Nannies restart a
  killed worker, forking it from a server that imported torch and daskdist:
  ``daskdist.plugins.fork_server``), a ``"dynamic"`` dataset, a gang closure stepping over
  ``dd.collective.synced(it)`` with the model and optimizer in a ``dd.collective.State``
  (a per-worker resource) committed every ``--commit-every`` steps (default 1, and 10
  reported too), gradients averaged with ``dd.collective.allreduce_gradients``; the driver
  loops ``coord.schedule_on_all`` until ``ds.progress()["complete"]``.
- **torchrun**: ``python -m torch.distributed.run --standalone --nproc-per-node=3
  --max-restarts=100`` running this file's ``--child`` mode: DDP, a static split of the same
  files (rank r reads files r, r+3, ...), rank 0 ``torch.save``-ing model, optimizer and step
  every 20 steps (written aside, then renamed), every rank resuming from it after a restart.
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set: without it, torch 2.13's restarted gloo
  ranks read the killed attempt's addresses from the rendezvous store and every restart
  fails (pytorch/pytorch#167288).

Runs alternate: in each round daskdist and torchrun fault-free, then both under chaos (the
side that goes first alternates between rounds). Under chaos a SIGKILL falls due every
``--kill-every`` seconds from the start of training and hits a random rank while all ranks
are training: daskdist's ``--world`` worker processes have all started the gang closure (a
replacement has joined and holds the committed state), torchrun's ranks of the current
attempt have all loaded the checkpoint and are ready to step. A kill due while not is skipped
and counted: where a restart or a replacement takes longer than ``--kill-every`` (a loaded
machine), torchrun would otherwise never step again and daskdist would lose every holder of
its commits (it keeps them in memory; no ``checkpoint_to`` here). Every rank logs each step
(its end time, its row ids, per-phase times) to a file; the figures come from those logs:

- **epoch**: daskdist: from the driver's first ``schedule_on_all`` (cluster up, group formed)
  until ``progress()`` says complete; torchrun: from the first attempt's rank 0 ready to step
  (group up, data loaded, DDP built) to the end of the last step. **step**: the median time
  between consecutive step ends of a rank (fault-free runs; a run's first step excluded).
- **goodput**: the fault-free epoch time divided by the epoch time under chaos, same side,
  same round, same rows: the share of its fault-free speed a side keeps under chaos.
- **stall per kill**: from the SIGKILL to the first step ended by a survivor in a later
  group (daskdist: a later generation or gang run; torchrun: the next attempt). torchrun's
  **restart**: from the SIGKILL to rank 0 of the next attempt being ready to step (processes
  started, rendezvous, checkpoint loaded); daskdist's **shrink**, the same span: from the
  SIGKILL to rank 0 of the survivors' group ready to step (the group re-formed,
  ``State.sync()`` returned). A stall is the shrink and the step the kill interrupted, run
  again. **formation**: the scheduler's own time for each formation of the run (its calls to
  the members, until every member joined). daskdist's **pause per join**: where a generation
  takes in a new worker without losing one, each incumbent's gap between its last step end
  before and its first step end after (median over incumbents; a normal step is part of it).
  **narrow**: seconds daskdist trained with fewer than all ranks.
- **gang runs**: daskdist: ``schedule_on_all`` calls of the driver for the epoch (and the
  gang's starts, re-runs after a loss included); torchrun: restarts.
- **rows exactly once**: each rank records the row ids of every step before its gradient
  allreduce (daskdist: a step whose allreduce completed is trained, and the survivors of a
  rank killed after it commit it) or before its optimizer step (torchrun). For each step of
  the final model's lineage the last attempt that ran it wins (the steps after the last
  commit or checkpoint are run again); the union of their ids against all ids gives the
  rows trained once, more than once and never.

Targets: fault-free epoch daskdist / torchrun <= 1.05 (at the first
``--commit-every``); daskdist goodput >= 0.9 in every run; daskdist goodput / torchrun's
>= 1.5; a join pauses the incumbents <= 0.3 s; a kill's stall <= 0.15 s for every kill,
beside torchrun's stall (the same span: SIGKILL → a rank's step ended in the next attempt);
the shrink is printed beside torchrun's restart. Each figure is printed beside torchrun's
from the same round, and torchrun runs with no Dask cluster up beside it, on loopback
(``--local-addr=127.0.0.1``, ``GLOO_SOCKET_IFNAME=lo``). Run:

    python benchmarks/bench_goodput.py                      # the job above, 3 rounds
    python benchmarks/bench_goodput.py --rows 48000 --kill-every 5 --quick   # a quick check
    python benchmarks/bench_goodput.py --only daskdist --no-chaos --phases

``--quick``: one round, the first ``--commit-every`` only. ``--phases``: the median and mean
time of each phase of a step (daskdist: batch with ``synced``'s agreement and the leases,
compute, forward and backward, gradient allreduce, optimizer, row record, commit; torchrun:
batch, compute, forward and backward with DDP's allreduce, row record, optimizer,
checkpoint); the mean spreads a commit every 10 steps over the steps.
``--shuffle``: a shuffled epoch (daskdist ``shuffle=True``; each torchrun rank permutes its
rows, the same way in every attempt). ``--json PATH`` writes every run's figures,
``--keep-logs DIR`` the step logs. The daskdist measured is this checkout's (its root goes
first on the path, the workers' too).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from figures import record

ROOT = Path(__file__).resolve().parent.parent
FEATURES, HIDDEN = 32, 256
DD_PHASES = ["batch+agree", "compute", "fwd+bwd", "allreduce", "optimizer", "record", "commit"]
TR_PHASES = ["batch", "compute", "fwd+bwd+allreduce", "record", "optimizer", "checkpoint"]


def mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 1))


def write_data(root: Path, rows: int, files: int, seed: int = 0) -> None:
    """``files`` Parquet files of consecutive row ids: ``id``, ``x`` (32 float32), ``y``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    w = rng.standard_normal(FEATURES).astype(np.float32)
    bounds = np.linspace(0, rows, files + 1).astype(np.int64)
    for f, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        x = rng.standard_normal((b - a, FEATURES)).astype(np.float32)
        y = x @ w + 0.01 * rng.standard_normal(b - a).astype(np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES)
        pq.write_table(pa.table({"id": np.arange(a, b, dtype=np.int64), "x": features,
                                 "y": y}), root / f"part-{f:03d}.parquet")


class StepLog:
    """One JSON line per event, appended to ``<dir>/<pid>.log`` line by line (a SIGKILL
    loses at most the line being written)."""

    def __init__(self, directory: str, **fields):
        self.fields = {"pid": os.getpid(), **fields}
        self.f = open(os.path.join(directory, f"{os.getpid()}.log"), "a", buffering=1)

    def write(self, kind: str, **values) -> None:
        self.f.write(json.dumps({"k": kind, "t": time.monotonic(), **self.fields, **values})
                     + "\n")

    def close(self) -> None:
        self.f.close()


# -- daskdist side (gang closures, run on the workers) --------------------------------------


def dd_make_state(ctx, seed: int):
    import torch

    import daskdist as dd

    torch.manual_seed(seed)
    model = mlp()
    return dd.collective.State(model=model, optimizer=torch.optim.Adam(model.parameters(), 1e-3),
                               step=0)


def dd_train(state, it, log_dir: str, call: int, compute_s: float, commit_every: int):
    """Synchronous steps over ``synced(it)``, a commit every ``commit_every`` steps (and one
    at the end); each step's row ids recorded before its commit."""
    import daskdist as dd

    g = dd.collective.get_group()
    state.sync()
    log = StepLog(log_dir, call=call, gen=g.generation, rank=g.rank, world=g.world_size)
    log.write("S", step=state.step)
    Path(log_dir, f"member.{os.getpid()}").touch()  # a training rank: the chaos may kill it
    model, opt = state.model, state.optimizer

    def commit(kind: str, ph: list) -> None:
        t = time.perf_counter()
        try:
            state.commit()
        except dd.collective.HostsUpdatedInterrupt:  # committed, then interrupted
            log.write(kind, step=state.step, c=1, ph=[*ph, time.perf_counter() - t])
            raise
        log.write(kind, step=state.step, c=1, ph=[*ph, time.perf_counter() - t])

    try:
        t_prev = time.perf_counter()
        for batch in dd.collective.synced(it):
            # recorded before the gradient allreduce: once that call completed on any
            # rank, the step's rows are trained (it carries the commit's heads, so the
            # survivors of a rank killed after it commit the step)
            r0 = time.perf_counter()
            log.write("T", step=state.step + 1, ids=batch["id"].tolist())
            t1 = time.perf_counter()
            time.sleep(compute_s)
            t2 = time.perf_counter()
            x, y = batch["x"], batch["y"]
            opt.zero_grad()
            loss = (model(x).squeeze(-1) - y).pow(2).sum() / max(1, len(y))
            loss.backward()
            t3 = time.perf_counter()
            dd.collective.allreduce_gradients(model)
            t4 = time.perf_counter()
            opt.step()
            t5 = time.perf_counter()
            state.step += 1
            ph = [r0 - t_prev, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t1 - r0]
            if state.step % commit_every == 0:
                commit("E", ph)
            else:
                log.write("E", step=state.step, c=0, ph=[*ph, 0.0])
            t_prev = time.perf_counter()
        if state.step % commit_every:
            commit("F", [])
        return g.rank, state.step
    finally:
        log.close()


def wait_for_workers(client, coord, n: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pids = client.run(os.getpid, on_error="ignore")
        pids = {w: p for w, p in pids.items() if isinstance(p, int)}
        if (len(pids) >= n and len(client.scheduler_info(n_workers=-1)["workers"]) == len(pids)
                and coord.status()["workers"] >= n):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pids)} of {n} workers within {timeout} s")
        time.sleep(0.1)


class Killer(threading.Thread):
    """A SIGKILL at ``t0 + k * every`` (k = 1, 2, ...) to the process ``pick()`` names; a
    time at which it names none within a second (not all ranks training) is skipped."""

    def __init__(self, every: float, pick, seed: int):
        super().__init__(daemon=True)
        self.every, self.pick, self.rng = every, pick, random.Random(seed)
        self.kills: list[tuple[float, int]] = []
        self.skipped = 0
        self.halt = threading.Event()
        self.t0 = 0.0

    def begin(self, t0: float) -> None:
        self.t0 = t0
        self.start()

    def run(self) -> None:
        k = 1
        while not self.halt.wait(max(0.0, self.t0 + k * self.every - time.monotonic())):
            k += 1
            victim, until = None, time.monotonic() + min(1.0, self.every / 4)
            while victim is None and time.monotonic() < until and not self.halt.is_set():
                with contextlib.suppress(Exception):
                    victim = self.pick(self.rng)
                if victim is None:
                    self.halt.wait(0.05)
            if victim is None:
                self.skipped += not self.halt.is_set()
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
                self.kills.append((time.monotonic(), victim))

    def stop(self) -> list[tuple[float, int]]:
        self.halt.set()
        if self.is_alive():
            self.join(30)
        return list(self.kills)


def formation_seconds(dask_scheduler, name: str, since: float) -> list[float]:
    """The scheduler's time for each formation of coordinator ``name`` since ``since``
    (wall clock)."""
    co = dask_scheduler.extensions["daskdist"].coordinators[name]
    return [e.seconds for e in co.stats.events if e.kind == "formed" and e.time >= since]


def run_daskdist(coord, client, data: Path, run_dir: Path, args, commit_every: int,
                 chaos: bool, seed: int) -> dict:
    import daskdist as dd

    run_dir.mkdir(parents=True)
    state = coord.create_per_worker_resource(functools.partial(dd_make_state, seed=args.seed))
    ds = coord.distribute_dataset(str(data / "*.parquet"),
                                  global_batch_size=args.batch * args.world,
                                  policy="dynamic", name=run_dir.name,
                                  shuffle=args.shuffle, seed=args.seed)
    it = iter(ds)

    def pick(rng):
        members = {int(p.name.split(".")[1]) for p in run_dir.glob("member.*")}
        pids = [p for p in client.run(os.getpid, on_error="ignore").values() if p in members]
        return rng.choice(sorted(pids)) if len(pids) >= args.world else None

    killer = Killer(args.kill_every, pick, seed) if chaos else None
    calls, errors, final, first_end = 0, [], 0, None
    wall0, t0 = time.time(), time.monotonic()
    if killer:
        killer.begin(t0)
    try:
        while not ds.progress()["complete"]:
            if calls >= args.max_gangs or time.monotonic() - t0 > args.run_timeout:
                raise RuntimeError(f"daskdist: epoch not complete after {calls} gang runs, "
                                   f"{time.monotonic() - t0:.0f} s: {ds.progress()}")
            try:
                out = coord.fetch(coord.schedule_on_all(
                    dd_train, args=(state, it, str(run_dir), calls, args.compute_ms / 1e3,
                                    commit_every)))
                final = max([final, *(s for _, s in out)])
            except (dd.CollectiveError, dd.WorkerLostError) as e:
                errors.append(f"{type(e).__name__}: {e}"[:200])
                if len(errors) > 20:
                    raise
            calls += 1
            if first_end is None:
                first_end = time.monotonic()
        t_end = time.monotonic()
    finally:
        kills = killer.stop() if killer else []
    progress = ds.progress()
    (run_dir / "kills.json").write_text(json.dumps(kills))
    recs = read_logs(run_dir)
    out = analyse(recs, kills, args.rows, final, args.world)
    formations = client.run_on_scheduler(formation_seconds, name=coord.name, since=wall0)
    out.update(epoch=t_end - t0, calls=calls, skipped=killer.skipped if killer else 0,
               formations=formations,
               tail=t_end - first_end, errors=errors,
               acknowledged=progress["acknowledged"], total=progress["total"],
               starts=len({key(r) for r in recs if r["k"] == "S"}))
    return out


# -- torchrun side (this file's --child mode, run by torch.distributed.run) --------------------


def child(a) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_dir = Path(a.run_dir)
    dist.init_process_group("gloo")
    files = sorted(glob.glob(os.path.join(a.data, "*.parquet")))[rank::world]
    table = pa.concat_tables([pq.read_table(f) for f in files])
    ids = torch.from_numpy(table.column("id").to_numpy().copy())
    x = torch.from_numpy(table.column("x").combine_chunks().flatten().to_numpy()
                         .reshape(-1, FEATURES).copy())
    y = torch.from_numpy(table.column("y").to_numpy().copy())
    if a.shuffle:  # the same order in every attempt: a resumed attempt skips what was trained
        order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(a.seed + rank))
        ids, x, y = ids[order], x[order], y[order]
    steps = torch.tensor([math.ceil(len(ids) / a.batch)])
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)  # every rank the same steps (DDP)
    steps = int(steps)
    torch.manual_seed(a.seed)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    ckpt, start = run_dir / "ckpt.pt", 0
    if ckpt.exists():
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    log = StepLog(a.run_dir, call=0, gen=attempt, rank=rank, world=world)
    log.write("R", step=start)
    (run_dir / f"ready.{attempt}.{rank}").write_text(str(os.getpid()))  # the chaos may kill it
    if rank == 0 and attempt == 0:
        (run_dir / "ready.tmp").write_text(repr(time.monotonic()))
        os.replace(run_dir / "ready.tmp", run_dir / "ready")
    compute_s = a.compute_ms / 1e3
    t_prev = time.perf_counter()
    for s in range(start, steps):
        b = slice(s * a.batch, (s + 1) * a.batch)
        xb, yb, ib = x[b], y[b], ids[b]
        t1 = time.perf_counter()
        time.sleep(compute_s)
        t2 = time.perf_counter()
        opt.zero_grad()
        loss = (ddp(xb).squeeze(-1) - yb).pow(2).sum() / max(1, len(yb))
        loss.backward()
        t3 = time.perf_counter()
        log.write("T", step=s + 1, ids=ib.tolist())
        t4 = time.perf_counter()
        opt.step()
        t5 = time.perf_counter()
        saved = rank == 0 and (s + 1) % a.ckpt_every == 0
        if saved:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": s + 1}, run_dir / "ckpt.tmp")
            os.replace(run_dir / "ckpt.tmp", ckpt)
        t6 = time.perf_counter()
        log.write("E", step=s + 1, c=int(saved),
                  ph=[t1 - t_prev, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5])
        t_prev = time.perf_counter()
    log.close()
    dist.destroy_process_group()


def _descendants(proc) -> list:
    import psutil

    with contextlib.suppress(psutil.Error):
        return psutil.Process(proc.pid).children(recursive=True)
    return []


def _stop_tree(proc) -> None:
    """End torchrun and the rank processes it started (they run in sessions of their own)."""
    import psutil

    kids = _descendants(proc)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.kill()


def run_torchrun(data: Path, run_dir: Path, args, chaos: bool, seed: int) -> dict:
    run_dir.mkdir(parents=True)
    # loopback throughout: the agent's address (--local-addr) and gloo's interface, so no
    # attempt waits on a lookup of this host's name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--local-addr=127.0.0.1", f"--nproc-per-node={args.world}", "--max-restarts=100",
           str(Path(__file__).resolve()),
           "--child", "--data", str(data), "--run-dir", str(run_dir),
           "--batch", str(args.batch), "--compute-ms", str(args.compute_ms),
           "--ckpt-every", str(args.ckpt_every), "--seed", str(args.seed),
           *(["--shuffle"] if args.shuffle else [])]
    # torchrun shares its rendezvous store with the ranks, and a restarted gloo group then
    # reads the killed attempt's addresses from it (Connection refused at every restart,
    # pytorch/pytorch#167288): each attempt's rank 0 hosts a store of its own instead
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **os.environ, "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    out_path = run_dir / "torchrun.out"

    def pick(rng):
        pids = {}
        for p in run_dir.glob("ready.*.*"):
            _, att, rank = p.name.split(".")
            with contextlib.suppress(ValueError):
                pids[(int(att), int(rank))] = int(p.read_text())
        if not pids:
            return None
        latest = max(att for att, _ in pids)
        live = {k.pid for k in _descendants(proc)}
        ranks = [pid for (att, _), pid in pids.items() if att == latest and pid in live]
        return rng.choice(sorted(ranks)) if len(ranks) >= args.world else None

    killer = Killer(args.kill_every, pick, seed) if chaos else None
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + args.run_timeout
        while not (run_dir / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"torchrun did not start:\n{out_path.read_text()[-3000:]}")
            time.sleep(0.02)
        t0 = float((run_dir / "ready").read_text())
        if killer:
            killer.begin(t0)
        try:
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            kills = killer.stop() if killer else []
        if rc != 0:
            raise RuntimeError(f"torchrun failed ({rc}):\n{out_path.read_text()[-3000:]}")
    finally:
        _stop_tree(proc)
    (run_dir / "kills.json").write_text(json.dumps(kills))
    recs = read_logs(run_dir)
    ends = [r for r in recs if r["k"] == "E"]
    last = max(r["gen"] for r in ends)
    final = max(r["step"] for r in ends if r["gen"] == last)
    out = analyse(recs, kills, args.rows, final, args.world)
    out.update(epoch=max(r["t"] for r in ends) - t0, restarts=last,
               skipped=killer.skipped if killer else 0)
    return out


# -- the figures, from the step logs ----------------------------------------------------------


def read_logs(run_dir: Path) -> list[dict]:
    recs = []
    for p in run_dir.glob("*.log"):
        for line in p.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut by a SIGKILL
                recs.append(json.loads(line))
    recs.sort(key=lambda r: r["t"])
    return recs


def key(r: dict) -> tuple[int, int]:
    """An attempt: (daskdist: the driver's call, the group's generation; torchrun: 0, the
    restart count), ordered as they ran."""
    return r["call"], r["gen"]


def analyse(recs: list[dict], kills: list, rows: int, final: int, world: int) -> dict:
    ends = [r for r in recs if r["k"] == "E"]
    runs = defaultdict(list)
    for r in ends:
        runs[(r["pid"], *key(r))].append(r)
    gaps = [b["t"] - a["t"] for rs in runs.values() for a, b in zip(rs, rs[1:], strict=False)]
    phases = [(statistics.median(p), statistics.fmean(p))
              for p in zip(*(r["ph"] for r in ends), strict=False)]

    # rows: for each step of the final lineage, the last attempt that ran it
    trained = [r for r in recs if r["k"] == "T" and r["step"] <= final]
    win: dict[int, tuple] = {}
    for r in trained:
        win[r["step"]] = max(win.get(r["step"], key(r)), key(r))
    ids: list[int] = []
    ranks_of = defaultdict(int)
    for r in trained:
        if key(r) == win[r["step"]]:
            ids.extend(r["ids"])
            ranks_of[r["step"]] += 1
    counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=rows)[:rows] \
        if ids else np.zeros(rows, dtype=np.int64)
    worlds = {key(r): r["world"] for r in recs}
    rows_out = {"once": int((counts == 1).sum()), "more": int((counts > 1).sum()),
                "extra": int((counts[counts > 1] - 1).sum()), "never": int((counts == 0).sum()),
                "steps": final, "steps_unrecorded": final - len(win),
                "steps_short": sum(1 for s, n in ranks_of.items() if n != worlds[win[s]])}

    # kills: the stall until a survivor's step in a later attempt
    kill_out = []
    for t_k, victim in kills:
        before = [key(r) for r in recs if r["t"] < t_k]
        cur = max(before) if before else (-1, -1)
        member = victim in {r["pid"] for r in recs if key(r) == cur}
        nxt = next((r for r in ends if r["t"] > t_k and key(r) > cur and r["pid"] != victim),
                   None)
        ready = next((r for r in recs if r["k"] in "RS" and r["rank"] == 0 and r["t"] > t_k
                      and key(r) > cur), None)
        kill_out.append({"t": t_k, "member": member,
                         "stall": None if nxt is None else nxt["t"] - t_k,
                         "restart": None if ready is None else ready["t"] - t_k})

    # joins: a later attempt taking in a worker without losing one
    order = sorted({key(r) for r in ends})
    pids_of = defaultdict(set)
    for r in ends:
        pids_of[key(r)].add(r["pid"])
    joins, kill_joins = [], 0
    for a, b in zip(order, order[1:], strict=False):
        new, lost = pids_of[b] - pids_of[a], pids_of[a] - pids_of[b]
        if new and lost:
            kill_joins += 1
        elif new:
            gaps_in = [min(r["t"] for r in runs[(p, *b)]) - max(r["t"] for r in runs[(p, *a)])
                       for p in pids_of[a] & pids_of[b]]
            if gaps_in:
                joins.append({"pause": statistics.median(gaps_in), "between_calls": a[0] != b[0]})
    narrow = 0.0
    for k in order:
        if worlds[k] < world:
            starts = [r["t"] for r in recs if key(r) == k and r["k"] in "RS"]
            narrow += max(r["t"] for r in ends if key(r) == k) - min(
                starts or [r["t"] for r in ends if key(r) == k])
    return {"step": statistics.median(gaps) if gaps else float("nan"), "phases": phases,
            "rows": rows_out, "kills": kill_out, "joins": joins, "kill_joins": kill_joins,
            "narrow": narrow}


# -- the report --------------------------------------------------------------------------------


def _ms(x) -> str:
    return "-" if x is None or x != x else f"{x * 1e3:.1f} ms"


def _s(xs, digits: int = 2) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f} s"
    return (f"median {statistics.median(xs):.{digits}f} s ({min(xs):.{digits}f}-"
            f"{max(xs):.{digits}f}, n={len(xs)})")


def _rows(r: dict) -> str:
    ok = "exactly once" if r["once"] and not (r["more"] or r["never"]) else "NOT exactly once"
    text = (f"rows {ok}: {r['once']:,} once, {r['more']:,} more than once (+{r['extra']:,}), "
            f"{r['never']:,} never ({r['steps']} steps")
    if r["steps_unrecorded"] or r["steps_short"]:
        text += f"; {r['steps_unrecorded']} unrecorded, {r['steps_short']} short of ranks"
    return text + ")"


def describe(name: str, chaos: bool, r: dict, free: dict | None) -> str:
    lines = [f"  {name} {'chaos' if chaos else 'fault-free'}: epoch {r['epoch']:.2f} s, "
             f"step {_ms(r['step'])}"]
    if chaos and free:
        lines[0] += f", goodput {free['epoch'] / r['epoch']:.3f}"
    if "calls" in r:
        lines.append(f"    gang runs {r['calls']} (gang starts {r['starts']}), tail after the "
                     f"first run {r['tail']:.2f} s")
        if r["errors"]:
            lines.append(f"    failed gang runs {len(r['errors'])}: {r['errors'][0]}")
    else:
        lines.append(f"    restarts {r['restarts']}")
    if chaos:
        kills = [k for k in r["kills"] if k["member"]]
        skipped = (f", {r['skipped']} skipped: not all ranks training" if r["skipped"]
                   else "")
        lines.append(f"    kills {len(r['kills'])} ({len(kills)} of a training rank{skipped}): "
                     f"stall {_s([k['stall'] for k in kills])}")
        if "calls" in r:
            lines.append(f"    shrink (kill -> rank 0 synced in the survivors' group) "
                         f"{_s([k['restart'] for k in kills], 3)}; formations "
                         f"{_s(r['formations'], 3)}")
            pure = [j["pause"] for j in r["joins"]]
            lines.append(f"    joins {len(pure)}: incumbents' pause {_s(pure)}"
                         + (f"; {r['kill_joins']} re-formation(s) lost and took in a worker at once"
                            if r["kill_joins"] else "") + f"; narrow {r['narrow']:.2f} s")
        else:
            lines.append(f"    restart (kill -> rank 0 ready again) "
                         f"{_s([k['restart'] for k in kills])}")
    lines.append("    " + _rows(r["rows"]))
    if "acknowledged" in r:
        lines[-1] += f"; acknowledged {r['acknowledged']:,} of {r['total']:,}"
    return "\n".join(lines)


def summary(results: list[dict], args, variants: list[str]) -> None:
    by: dict[int, dict] = defaultdict(dict)
    for x in results:
        if "r" in x:
            by[x["round"]][(x["side"], x["chaos"])] = x["r"]
    failed = [x for x in results if "error" in x]
    if failed:
        print(f"\n{len(failed)} run(s) FAILED: " + "; ".join(
            f"round {x['round'] + 1} {x['side']} {'chaos' if x['chaos'] else 'fault-free'}"
            for x in failed))
    print(f"\n{args.rows:,} rows in {args.files} files, MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1 "
          f"Adam, {args.world} ranks gloo, {args.batch} rows a rank a step, {args.compute_ms:g} "
          f"ms compute a step" + ("" if args.no_chaos else
                                   f"; chaos: a SIGKILL every {args.kill_every:g} s") + ":")

    def goodput(runs, side):
        free, chaos = runs.get((side, False)), runs.get((side, True))
        return free["epoch"] / chaos["epoch"] if free and chaos else None

    def med(xs):
        xs = [x for x in xs if x is not None]
        return f"{statistics.median(xs):.2f}" if xs else "-"

    print(f"  {'round side':24s}{'epoch s':>9s}{'step ms':>9s}{'chaos s':>9s}{'goodput':>9s}"
          f"{'kills':>7s}{'stall s':>9s}{'join s':>8s}{'gangs':>9s}  rows once")
    for rnd, runs in sorted(by.items()):
        for side in ["torchrun", *variants]:
            free, chaos = runs.get((side, False)), runs.get((side, True))
            if not free and not chaos:
                continue
            any_run = free or chaos
            kills = [k for k in chaos["kills"] if k["member"]] if chaos else []
            if "calls" in any_run:
                gangs = "/".join(str(r["calls"]) if r else "-" for r in (free, chaos))
            else:
                gangs = f"{chaos['restarts']}r" if chaos else "-"
            rows_ok = all(r["rows"]["once"] and not (r["rows"]["more"] or r["rows"]["never"])
                          for r in (free, chaos) if r)
            g = goodput(runs, side)
            cells = [f"{free['epoch']:.2f}" if free else "-",
                     f"{free['step'] * 1e3:.1f}" if free else "-",
                     f"{chaos['epoch']:.2f}" if chaos else "-",
                     f"{g:.3f}" if g is not None else "-",
                     str(len(kills)) if chaos else "-",
                     med([k["stall"] for k in kills]),
                     med([j["pause"] for j in chaos["joins"]]) if chaos else "-"]
            print(f"  {f'{rnd + 1} {side}':24s}" + "".join(
                f"{c:>{w}s}" for c, w in zip(cells, [9, 9, 9, 9, 7, 9, 8], strict=True))
                  + f"{gangs:>9s}  {'yes' if rows_ok else 'NO'}")
    print("  (stall, join: medians; gangs: daskdist's schedule_on_all calls fault-free/chaos, "
          "torchrun's restarts under chaos 'r')")
    tr_good = [g for runs in by.values() if (g := goodput(runs, "torchrun")) is not None]
    if tr_good:
        print(f"  torchrun goodput: {_list(tr_good)}")
    tr_kills = [k for runs in by.values() if ("torchrun", True) in runs
                for k in runs[("torchrun", True)]["kills"] if k["member"]]
    tr_stalls = [k["stall"] for k in tr_kills if k["stall"]]
    tr_restarts = [k["restart"] for k in tr_kills if k["restart"]]
    for i, v in enumerate(variants):
        free_ratio, step_ratio, good, good_ratio, pauses, stalls, shrinks = ([] for _ in
                                                                            range(7))
        for runs in by.values():
            tf, df, dc = runs.get(("torchrun", False)), runs.get((v, False)), runs.get((v, True))
            if tf and df:
                free_ratio.append(df["epoch"] / tf["epoch"])
                step_ratio.append(df["step"] / tf["step"])
            if dc:
                pauses += [j["pause"] for j in dc["joins"]]
                stalls += [k["stall"] for k in dc["kills"] if k["member"] and k["stall"]]
                shrinks += [k["restart"] for k in dc["kills"] if k["member"] and k["restart"]]
            if (g := goodput(runs, v)) is not None:
                good.append(g)
                if (t := goodput(runs, "torchrun")) is not None:
                    good_ratio.append(g / t)
        held = i == 0
        print(f"  {v}{' (held to the targets)' if held else ''}, one figure a round, "
              f"against torchrun's of the same round:")
        rows = [("fault-free epoch / torchrun's", free_ratio, lambda xs: max(xs) <= 1.05,
                 "<= 1.05"),
                ("step / torchrun's", step_ratio, None, ""),
                ("goodput", good, lambda xs: min(xs) >= 0.9, ">= 0.9 every run"),
                ("goodput / torchrun's", good_ratio, lambda xs: min(xs) >= 1.5, ">= 1.5"),
                ("join pause (s)", pauses, lambda xs: max(xs) <= 0.3, "<= 0.3 s"),
                ("kill stall (s)", stalls, lambda xs: max(xs) <= 0.15, "<= 0.15 s"),
                ("torchrun's stall (s)", tr_stalls, None, ""),
                ("kill shrink (s)", shrinks, None, ""),
                ("torchrun's restart (s)", tr_restarts, None, "")]
        for label, xs, ok, target in rows:
            if not xs:
                continue
            line = f"    {label + ':':31s}{_list(xs)}"
            if held and ok is not None:
                line += f"   target {target}: {'met' if ok(xs) else 'NOT met'}"
            print(line)
        record_variant(v, held, by, args)


def record_variant(v: str, held: bool, by: dict, args) -> None:
    """The variant's figures for ``docs/benchmarks.md``, each the median over the rounds
    beside torchrun's from the same rounds (targets on the held variant, judged as the
    lines above judge them: on every round)."""
    job = f"{args.world} ranks gloo, MLP, {args.rows:,} rows"
    free = [(r[(v, False)], r[("torchrun", False)]) for r in by.values()
            if (v, False) in r and ("torchrun", False) in r]
    goods = [(r[("torchrun", False)]["epoch"] / r[("torchrun", True)]["epoch"],
              r[(v, False)]["epoch"] / r[(v, True)]["epoch"]) for r in by.values()
             if all(k in r for k in [(v, False), (v, True), ("torchrun", False),
                                     ("torchrun", True)])]

    def target(text: str, ok: bool) -> dict:
        return {"target": text, "met": ok} if held else {}

    if free:
        ratios = [d["epoch"] / t["epoch"] for d, t in free]
        record(None, what=f"fault-free synced epoch, {v} ({job})",
               ours=statistics.median(d["epoch"] for d, _ in free), unit="s",
               anchor="torchrun elastic, DDP, a checkpoint every 20 steps",
               anchor_value=statistics.median(t["epoch"] for _, t in free),
               **target("≤ 1.05x torchrun's", max(ratios) <= 1.05))
        record(None, what=f"fault-free step, {v}",
               ours=statistics.median(d["step"] for d, _ in free) * 1e3, unit="ms",
               anchor="torchrun elastic's step",
               anchor_value=statistics.median(t["step"] for _, t in free) * 1e3)
    if goods:
        theirs, ours = [t for t, _ in goods], [g for _, g in goods]
        record(None, what=f"goodput under a SIGKILL every {args.kill_every:g} s, {v}",
               ours=statistics.median(ours), unit="", anchor="torchrun elastic's goodput",
               anchor_value=statistics.median(theirs),
               **target("≥ 0.9 every run and ≥ 1.5x torchrun's",
                        min(ours) >= 0.9 and min(g / t for t, g in goods) >= 1.5))
        chaos = [r[(v, True)] for r in by.values() if (v, True) in r]
        stalls = [k["stall"] for c in chaos for k in c["kills"] if k["member"] and k["stall"]]
        shrinks = [k["restart"] for c in chaos for k in c["kills"]
                   if k["member"] and k["restart"]]
        tr_kills = [k for r in by.values() if ("torchrun", True) in r
                    for k in r[("torchrun", True)]["kills"] if k["member"]]
        restarts = [k["restart"] for k in tr_kills if k["restart"]]
        tr_stalls = [k["stall"] for k in tr_kills if k["stall"]]
        if stalls and tr_stalls:
            # like with like: a survivor's step ended in the next group, on both sides
            record(None, what=f"kill stall: SIGKILL → a survivor's step ended in the next "
                              f"group, {v}",
                   ours=statistics.median(stalls), unit="s",
                   anchor="torchrun: SIGKILL → a rank's step ended in the next attempt",
                   anchor_value=statistics.median(tr_stalls),
                   **target("≤ 0.15 s every kill", max(stalls) <= 0.15))
        if shrinks and restarts:
            record(None, what=f"kill shrink: SIGKILL → the survivors' rank 0 ready to step, {v}",
                   ours=statistics.median(shrinks), unit="s",
                   anchor="torchrun: SIGKILL → the next attempt's rank 0 ready to step",
                   anchor_value=statistics.median(restarts))
        pauses = [j["pause"] for c in chaos for j in c["joins"]]
        if pauses and restarts:
            record(None, what=f"incumbents' pause for a joining worker, {v}",
                   ours=statistics.median(pauses), unit="s",
                   anchor="torchrun: every rank restarted (kill → rank 0 training again)",
                   anchor_value=statistics.median(restarts),
                   **target("≤ 0.3 s", max(pauses) <= 0.3))


def _list(xs: list[float]) -> str:
    if len(xs) > 6:
        return (f"median {statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f}, "
                f"n={len(xs)})")
    return ", ".join(f"{x:.3f}" for x in xs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=240_000)
    p.add_argument("--files", type=int, default=24)
    p.add_argument("--world", type=int, default=3, help="ranks (workers)")
    p.add_argument("--batch", type=int, default=64, help="rows a rank a step")
    p.add_argument("--compute-ms", type=float, default=25.0)
    p.add_argument("--commit-every", type=int, nargs="+", default=[1, 10],
                   help="daskdist variants; the first one is held to the targets")
    p.add_argument("--ckpt-every", type=int, default=20, help="torchrun's checkpoint")
    p.add_argument("--kill-every", type=float, default=10.0)
    p.add_argument("--shuffle", action="store_true",
                   help="daskdist: shuffle=True; torchrun: each rank's rows permuted")
    p.add_argument("--only", choices=["daskdist", "torchrun"])
    p.add_argument("--no-chaos", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="one round, the first --commit-every only")
    p.add_argument("--phases", action="store_true", help="median time of each phase of a step")
    p.add_argument("--max-gangs", type=int, default=10_000,
                   help="daskdist: the driver's budget of schedule_on_all calls for an epoch")
    p.add_argument("--run-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument("--keep-logs", metavar="DIR", help="keep every run's step logs here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return
    # a SIGTERM ends the run as Ctrl-C does: clusters, torchrun and temporary files go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # this checkout's daskdist, here and in the worker processes (they start with our path)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                              os.environ.get("PYTHONPATH")]))
    if args.quick:
        args.rounds, args.commit_every = 1, args.commit_every[:1]
    variants = [] if args.only == "torchrun" else [f"daskdist c{c}" for c in args.commit_every]
    sides = ([] if args.only == "daskdist" else ["torchrun"]) + variants
    tmp = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    try:
        data = tmp / "data"
        data.mkdir()
        write_data(data, args.rows, args.files, args.seed)
        with DaskSide(args, tmp) as dask_side:
            results = _rounds(args, sides, data, tmp, dask_side)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary(results, args, variants)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


class DaskSide:
    """daskdist's cluster, up only while daskdist runs: torchrun's runs have the machine to
    themselves (no idle Dask scheduler or workers beside them). Started (with an untimed
    warm-up) when a daskdist run needs it, closed before a torchrun run."""

    def __init__(self, args, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.stack: contextlib.ExitStack | None = None
        self.client = self.coord = None
        self.starts = 0

    def __enter__(self) -> DaskSide:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        stack, self.stack = self.stack, None
        self.client = self.coord = None
        if stack is not None:
            stack.close()

    def ensure(self):
        """The client and coordinator, the cluster started first if it is down."""
        if self.stack is None:
            self.stack = contextlib.ExitStack()
            try:
                self.client, self.coord = self._start(self.stack)
            except BaseException:
                self.stop()
                raise
        wait_for_workers(self.client, self.coord, self.args.world)
        return self.client, self.coord

    def _start(self, stack: contextlib.ExitStack):
        import logging

        import cloudpickle
        import dask
        from distributed import Client, LocalCluster

        import daskdist as dd

        args, tmp = self.args, self.tmp
        if __name__ != "__main__":  # the gang closures travel by value
            cloudpickle.register_pickle_by_value(sys.modules[__name__])
        if not self.starts:
            print(f"daskdist from {Path(dd.__file__).parent}", flush=True)
        self.starts += 1
        # a Nanny whose worker is killed again and again keeps restarting it
        stack.enter_context(dask.config.set({"distributed.deploy.lost-worker-timeout": "600s"}))
        # a replacement forks from a server that imported torch and daskdist (docs/elastic.md)
        stack.enter_context(dask.config.set({"distributed.nanny.preload":
                                             ["daskdist.plugins.fork_server"]}))
        cluster = stack.enter_context(LocalCluster(
            n_workers=args.world, threads_per_worker=1, processes=True,
            dashboard_address=":0", silence_logs=logging.ERROR))
        client = stack.enter_context(Client(cluster))
        coord = dd.Coordinator(client, name="bench-goodput", max_worker_failures=1000,
                               torch_threads=1)
        stack.callback(coord.close)
        wait_for_workers(client, coord, args.world)
        coord.collective_group(backend="gloo", timeout=60)
        # warm-up: imports, the group, a loader and a State on every worker (not timed)
        warm = tmp / f"warm-{self.starts}"
        warm.mkdir()
        write_data(warm, args.batch * args.world * 4, 1, args.seed)
        warm_args = argparse.Namespace(**{**vars(args), "rows": args.batch * args.world * 4})
        run_daskdist(coord, client, warm, tmp / "runs" / f"warm-up-{self.starts}", warm_args,
                     1, False, 0)
        return client, coord


def _rounds(args, sides: list[str], data: Path, tmp: Path,
            dask_side: DaskSide) -> list[dict]:
    results: list[dict] = []
    for rnd in range(args.rounds):
        order = sides if rnd % 2 == 0 else sides[::-1]
        fault_free: dict[str, dict] = {}
        for chaos in [False] if args.no_chaos else [False, True]:
            for side in order:
                name = f"r{rnd}-{side.replace(' ', '-')}-{'chaos' if chaos else 'free'}"
                run_dir = tmp / "runs" / name
                seed = args.seed * 1000 + rnd
                t = time.monotonic()
                try:
                    if side == "torchrun":
                        dask_side.stop()  # torchrun has the machine to itself
                        r = run_torchrun(data, run_dir, args, chaos, seed)
                    else:
                        client, coord = dask_side.ensure()
                        r = run_daskdist(coord, client, data, run_dir, args,
                                         int(side.split("c")[-1]), chaos, seed)
                except (RuntimeError, TimeoutError) as e:  # the run failed: say so, go on
                    results.append({"round": rnd, "side": side, "chaos": chaos,
                                    "error": f"{type(e).__name__}: {e}"})
                    print(f"round {rnd + 1}/{args.rounds}: {side} "
                          f"{'chaos' if chaos else 'fault-free'} FAILED after "
                          f"{time.monotonic() - t:.0f} s: {type(e).__name__}: "
                          f"{str(e)[-1500:]}", flush=True)
                    continue
                finally:
                    if args.keep_logs:
                        shutil.copytree(run_dir, Path(args.keep_logs) / run_dir.name,
                                        ignore=shutil.ignore_patterns("*.pt"),
                                        dirs_exist_ok=True)
                    shutil.rmtree(run_dir, ignore_errors=True)
                if not chaos:
                    fault_free[side] = r
                results.append({"round": rnd, "side": side, "chaos": chaos, "r": r})
                print(f"round {rnd + 1}/{args.rounds} ({time.monotonic() - t:.0f} s):\n"
                      + describe(side, chaos, r, fault_free.get(side)), flush=True)
                if args.phases:
                    labels = TR_PHASES if side == "torchrun" else DD_PHASES
                    print("    phases, median/mean ms a step: " + ", ".join(
                        f"{n} {m * 1e3:.1f}/{a * 1e3:.1f}"
                        for n, (m, a) in zip(labels, r["phases"], strict=False)))
    return results


if __name__ == "__main__":
    main()
