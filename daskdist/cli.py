"""The ``daskdist`` command: ``daskdist demo`` trains a small model on an embedded cluster.

The demo writes synthetic Parquet shards, starts a ``LocalCluster`` with worker
processes, then trains a linear regression two ways: asynchronously (closures on
per-worker replicas and per-worker datasets, any worker takes any step) and
synchronously (a gloo collective group, gang closures, averaged gradients, elastic
state). ``--kill`` SIGKILLs a worker mid-run to show recovery (rank 0 of the group in
the synchronous phase). Nothing in the library
imports this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FEATURES = 16


def write_shards(root: Path, rows: int, files: int, seed: int = 0) -> np.ndarray:
    """Synthetic regression shards: y = X @ w + noise. Returns the true weights."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    w = rng.standard_normal(FEATURES).astype(np.float32)
    per_file = rows // files
    for f in range(files):
        x = rng.standard_normal((per_file, FEATURES)).astype(np.float32)
        y = x @ w + 0.01 * rng.standard_normal(per_file).astype(np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES)
        pq.write_table(pa.table({"x": features, "y": y}), root / f"part-{f:03d}.parquet",
                       row_group_size=max(1, per_file // 4))
    return w


def make_replica(ctx):
    import torch

    torch.manual_seed(ctx.worker_index)
    model = torch.nn.Linear(FEATURES, 1).to(ctx.device)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.05)}


def async_step(replica, iterator):
    """One SGD step of this worker's replica on its next batch; the batch's loss."""
    import torch

    try:
        batch = next(iterator)
    except StopIteration:
        return None
    model, opt = replica["model"], replica["opt"]
    loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item(), len(batch["y"])


def make_state(ctx):
    import torch

    import daskdist as dd

    torch.manual_seed(ctx.worker_index)
    model = torch.nn.Linear(FEATURES, 1).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return dd.collective.State(model=model, optimizer=opt, step=0, rows=0)


def sync_steps(state, iterator, steps):
    """Data-parallel SGD on the group: averaged gradients, a commit every step.

    ``sync()`` starts every rank from the newest commit (a fresh replacement never
    overwrites the survivors); each ``commit()`` acknowledges the step's rows, so the
    committed model trains on every row exactly once across kills; ``synced`` ends all
    ranks at the same step when a rank's iterator runs dry.
    """
    import torch

    import daskdist as dd

    state.sync()
    g = dd.collective.get_group()
    losses, rows = [], 0
    for batch in dd.collective.synced(iterator):
        n = len(batch["y"])
        pred = state.model(batch["x"]).squeeze(-1)
        loss = (pred - batch["y"]).pow(2).sum() / max(1, n)  # finite on an empty tail batch
        state.optimizer.zero_grad()
        loss.backward()
        dd.collective.allreduce_gradients(state.model, average=True)
        state.optimizer.step()
        state.step += 1
        total = torch.tensor([n])
        g.allreduce(total)
        state.rows += int(total.item())  # rows in the model (every rank's): committed with it
        state.commit()
        losses.append(loss.item())
        rows += n
        if len(losses) >= steps:
            break
    return losses, rows, g.generation, state.rows


def rank0_pid(coord, client) -> int | None:
    """The process id of rank 0 of the coordinator's collective group."""
    members = coord._call("daskdist_group_info")["members"]
    if not members:
        return None
    pid = client.run(os.getpid, workers=[members[0]], on_error="ignore").get(members[0])
    return pid if isinstance(pid, int) else None


def sync_phase(coord, client, shards, args, tqdm) -> tuple[list, int, float]:
    """Synchronous training until every row of an epoch is committed exactly once.

    The driver loops gang closures until the dynamic dataset's epoch is complete;
    ``--kill`` SIGKILLs rank 0 of the group (the member every other rank synced from
    before) once a third of the rows are trained.
    """
    coord.wait_for_workers(args.workers, timeout=120)  # a killed worker is back
    group = coord.collective_group(backend="auto", timeout=60)
    print(f"group     {group.backend} world_size={group.world_size} "
          f"generation={group.generation}")
    state = coord.create_per_worker_resource(make_state)
    sync_ds = coord.distribute_dataset(shards, global_batch_size=args.batch * args.workers,
                                       shuffle=True, seed=1, policy="dynamic", name="sync")
    sync_it = iter(sync_ds)
    t = time.perf_counter()
    sync_losses, killed, in_model = [], None, 0
    with tqdm(total=shards.num_rows, desc="sync", unit="row", unit_scale=True) as bar:
        done = 0
        while not (p := sync_ds.progress())["complete"]:
            bar.update(p["acknowledged"] - done)
            done = p["acknowledged"]
            gang = coord.schedule_on_all(sync_steps, args=(state, sync_it, 20))
            if args.kill and killed is None and done > shards.num_rows // 3:
                killed = rank0_pid(coord, client)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
                    bar.write(f"killed    rank 0 (pid {killed}, SIGKILL); survivors go on "
                              "from the last commit")
            out = coord.fetch(gang)
            sync_losses += out[0][0]
            in_model = out[0][3]
        bar.update(p["acknowledged"] - done)
    seconds = time.perf_counter() - t
    once = ("each exactly once" if p["acknowledged"] == p["total"] == in_model
            else "MISMATCH")
    print(f"sync      {in_model:,} rows in the committed model ({once}: "
          f"{p['acknowledged']:,} acknowledged of {p['total']:,}) in {seconds:.1f} s; "
          f"generation {coord.status()['group_generation']}")
    return sync_losses, p["acknowledged"], seconds


def kill_one_worker(client) -> int:
    pid = sorted(client.run(os.getpid, on_error="ignore").values())[-1]
    os.kill(pid, signal.SIGKILL)
    return pid


def demo(args: argparse.Namespace) -> int:
    from distributed import Client, LocalCluster
    from tqdm.auto import tqdm

    import daskdist as dd

    data = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="daskdist-demo-"))
    data.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not list(data.glob("*.parquet")):
        write_shards(data, args.rows, args.files)
    shards = dd.data.ArrowShards(str(data / "*.parquet"))
    print(f"data      {shards.num_rows:,} rows in {len(shards.units)} units under {data}")

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client, name="demo")
        coord.wait_for_workers(args.workers, timeout=120)
        print(f"cluster   {args.workers} workers ready in {time.perf_counter() - t0:.1f} s")

        # -- asynchronous training: any worker takes any step of its own replica --------
        replica = coord.create_per_worker_resource(make_replica)
        ds = coord.distribute_dataset(shards, global_batch_size=args.batch * args.workers,
                                      shuffle=True, seed=0, policy="dynamic", name="async")
        it = iter(ds)
        losses, rows, killed = [], 0, None
        t = time.perf_counter()
        with tqdm(total=shards.num_rows, desc="async", unit="row", unit_scale=True) as bar:
            while not ds.progress()["complete"]:
                rvs = [coord.schedule(async_step, args=(replica, it)) for _ in range(32)]
                if args.kill and killed is None and rows > shards.num_rows // 3:
                    killed = kill_one_worker(client)
                    bar.write(f"killed    worker pid {killed} (SIGKILL); its work re-runs")
                for out in coord.fetch(rvs):
                    if out is not None:
                        losses.append(out[0])
                        rows += out[1]
                        bar.update(out[1])
        async_seconds = time.perf_counter() - t
        p = ds.progress()
        once = "each exactly once" if rows == p["acknowledged"] == p["total"] else "MISMATCH"
        print(f"async     {rows:,} rows ({once}: {p['acknowledged']:,} acknowledged of "
              f"{p['total']:,}) in {async_seconds:.1f} s; "
              f"loss {losses[0]:.3f} -> {np.mean(losses[-8:]):.4f}")

        # -- synchronous training: a gloo group, gang closures, elastic state -----------
        sync_losses, sync_rows, sync_seconds = sync_phase(coord, client, shards, args, tqdm)
        status = coord.status()
        print(f"sync      {len(sync_losses)} steps, {sync_rows:,} rows in {sync_seconds:.1f} s; "
              f"loss {sync_losses[0]:.3f} -> {np.mean(sync_losses[-5:]):.4f}")
        print(f"summary   closures done={status['done']} retried={status['retried']} "
              f"recoveries={status['recoveries']} failed={status['failed']} "
              f"workers={status['workers']} total {time.perf_counter() - t0:.1f} s")
        coord.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="daskdist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small model on an embedded LocalCluster")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--rows", type=int, default=200_000)
    d.add_argument("--files", type=int, default=8)
    d.add_argument("--batch", type=int, default=256, help="per-worker batch size")
    d.add_argument("--steps", type=int, default=100, help="synchronous steps")
    d.add_argument("--data", default=None, help="shard directory (default: a temp dir)")
    d.add_argument("--kill", action="store_true", help="SIGKILL a worker mid-run")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
