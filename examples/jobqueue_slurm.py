"""daskdist on a SLURM cluster through dask-jobqueue: one Dask worker per GPU.

    pip install daskdist[hpc]
    python examples/jobqueue_slurm.py --jobs 4 --gpus-per-job 4 --data '/shared/shards/*.parquet'
    python examples/jobqueue_slurm.py --jobs 4 --data '/shared/ids/*.parquet' \\
        --rows 1000000 --checkpoint /shared/run1

Each job starts one worker process per GPU (``processes=gpus``, one thread each); the
preload ``daskdist.plugins.gpu_pin`` pins every worker to its own GPU through
CUDA_VISIBLE_DEVICES (what dask-cuda does), so ``ctx.device`` is ``cuda:0`` in each
and ``collective_group(backend="auto")`` picks NCCL. The scheduler gets the daskdist
plugin by preload, so the client needs no right to register plugins.

:func:`train` is what the CI test (``tests/test_slurm.py``) runs on a real one-node
Slurm with CPU workers: closures, a gang step on the collective group, and a dynamic
epoch during which a job may be cancelled (``during_epoch``), every row exactly once.

With ``--checkpoint URL`` (a directory every node can write, or any fsspec URL) the epoch
survives the end of the whole allocation (walltime, ``scancel``, preemption): the
training state is a ``dd.collective.State(...).checkpoint_to(URL)`` and the dataset has
a ``name=``, so running the same command again, on new jobs with any number of
workers, resumes from the newest complete checkpoint and trains every row of the epoch
exactly once across the two runs (:func:`start_resumable`, :func:`run_epoch`; the CI
test cancels every job of the first run and closes its scheduler). Its shards need an
``id`` column (0 .. rows-1): the state counts how often each row was trained. Its jobs
hold one worker each, started so that Slurm's SIGTERM (``scancel``, or
``--signal=B:TERM@120`` before the walltime) reaches the worker process itself, which
then leaves gracefully (docs/hpc.md, "Preemption notices", says why these settings).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import daskdist as dd

SCHEDULER_PRELOAD = {"preload": ["daskdist.plugins.scheduler"]}


def make_model(ctx):
    import torch

    return torch.nn.Linear(16, 1).to(ctx.device)


def step(model):
    """A gang step: every rank's gradients averaged over the group; what each rank ran on."""
    import torch

    g = dd.collective.get_group()
    x = torch.randn(64, 16, device=g.device)
    model.zero_grad()
    model(x).square().mean().backward()
    dd.collective.allreduce_gradients(model)
    return g.rank, str(g.device), g.backend


def read_batch(it):
    """One batch of the worker's dynamic iterator: its row count (0 once drained)."""
    try:
        return len(next(it)["y"])
    except StopIteration:
        return 0


def hostname_of_worker() -> str:
    import socket

    return socket.gethostname()


def train(client, data: str, workers: int, batch_size: int = 100,
          during_epoch: Callable[[], None] | None = None) -> dict:
    """Closures, a gang step and one dynamic epoch on ``workers`` workers; a summary.

    ``during_epoch`` is called once, a third of the way through the epoch (the test
    cancels a Slurm job there); the epoch still acknowledges every row exactly once.
    """
    coord = dd.Coordinator(client, name="slurm")
    try:
        coord.wait_for_workers(workers, timeout=120)
        hosts = coord.fetch([coord.schedule(hostname_of_worker) for _ in range(4 * workers)])
        group = coord.collective_group(backend="auto", timeout=60)
        model = coord.create_per_worker_resource(make_model)
        ranks = coord.fetch(coord.schedule_on_all(step, args=(model,)))
        ds = coord.distribute_dataset(data, global_batch_size=batch_size * workers,
                                      policy="dynamic", name="slurm-epoch")
        it = iter(ds)
        total = ds.progress()["total"]
        rows, called = 0, during_epoch is None
        while not ds.progress()["complete"]:
            if not called and rows >= total // 3:
                during_epoch()
                called = True
            rows += sum(coord.fetch([coord.schedule(read_batch, args=(it,))
                                     for _ in range(2 * workers)]))
        return {"hosts": hosts, "group": group, "ranks": ranks, "rows": rows,
                "progress": ds.progress(), "status": coord.status()}
    finally:
        coord.close()


class TrainingState:
    """Each worker's training state, checkpointed to ``url`` every ``every`` commits: the
    model, its optimizer, and ``seen``: how many times the committed model trained on
    each row (by the shards' ``id`` column), the epoch's exactly-once record."""

    def __init__(self, url: str, rows: int, every: int = 100):
        self.url, self.rows, self.every = url, rows, every

    def __call__(self, ctx):
        import torch

        model = make_model(ctx)
        state = dd.collective.State(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                    seen=torch.zeros(self.rows, dtype=torch.float64,
                                                     device=ctx.device))
        return state.checkpoint_to(self.url, every=self.every)


def epoch_steps(state, it, pause: float = 0.0) -> tuple[int, int]:
    """A gang closure: ``sync()`` (on a new cluster: load the newest complete checkpoint,
    and the dataset's epoch goes on from its ledger), then one committed SGD step per
    batch of the dynamic iterator. Returns the commit it started from and its steps."""
    import torch

    g = dd.collective.get_group()
    state.sync()
    resumed, steps = state.commits, 0
    for batch in dd.collective.synced(it):
        x, y = batch["x"].to(g.device), batch["y"].to(g.device)
        state.optimizer.zero_grad()
        torch.nn.functional.mse_loss(state.model(x).squeeze(-1), y).backward()
        dd.collective.allreduce_gradients(state.model)
        state.optimizer.step()
        seen = torch.bincount(batch["id"].to(g.device), minlength=state.seen.numel())
        seen = seen.to(torch.float64)
        g.allreduce(seen)  # every rank's rows of this step
        state.seen += seen
        if pause:
            time.sleep(pause)  # the CI test's first run: slow enough to cancel mid-epoch
        state.commit()  # acknowledges the step's rows; every `every`-th is checkpointed
        steps += 1
    return resumed, steps


def committed(state) -> tuple[int, list[float]]:
    """The committed state's commit count and per-row counts (a gang closure)."""
    state.sync()
    return state.commits, state.seen.tolist()


class Resumable:
    """A resumable epoch's handles on the client: the coordinator, the per-worker
    training state, the dataset and its iterator."""

    def __init__(self, coord: dd.Coordinator, state: dd.PerWorkerValues,
                 dataset: dd.DistributedDataset, iterator: object):
        self.coord, self.state, self.dataset, self.iterator = coord, state, dataset, iterator


def start_resumable(client, data: str, workers: int, checkpoint: str, rows: int,
                    every: int = 100, batch_size: int = 30) -> Resumable:
    """Coordinator, group, checkpointed state and the named dynamic dataset: the same
    calls in the first run and in every run that resumes it."""
    coord = dd.Coordinator(client, name="slurm-resumable")
    try:
        coord.wait_for_workers(workers, timeout=120)
        coord.collective_group(backend="auto", timeout=60)
        state = coord.create_per_worker_resource(TrainingState(checkpoint, rows, every))
        ds = coord.distribute_dataset(data, global_batch_size=batch_size * workers,
                                      policy="dynamic", shuffle=True, seed=3, prefetch=0,
                                      name="slurm-resumable-epoch")
        return Resumable(coord, state, ds, iter(ds))
    except BaseException:
        coord.close()
        raise


def run_epoch(run: Resumable, pause: float = 0.0) -> list[list[tuple[int, int]]]:
    """Train until the epoch is complete: per gang run, every rank's (resumed at, steps)."""
    out = []
    while not run.dataset.progress()["complete"]:
        out.append(run.coord.fetch(run.coord.schedule_on_all(
            epoch_steps, args=(run.state, run.iterator, pause))))
    return out


def main() -> None:
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--gpus-per-job", type=int, default=4)
    ap.add_argument("--walltime", default="01:00:00")
    ap.add_argument("--data", required=True, help="Parquet shards every node can read")
    ap.add_argument("--checkpoint", help="resumable epoch: checkpoints here (shards need "
                    "an id column); run again to resume")
    ap.add_argument("--rows", type=int, help="rows of the epoch (with --checkpoint)")
    args = ap.parse_args()
    if args.checkpoint and not args.rows:
        ap.error("--checkpoint needs --rows (the epoch's rows, ids 0 .. rows-1)")
    gpus = args.gpus_per_job
    if args.checkpoint:
        # one worker (one GPU) per job, no nanny, exec'd as the batch shell, told 120 s
        # before the walltime: each worker gets Slurm's SIGTERM itself and leaves
        # gracefully, checkpointing when it holds the last copy (docs/hpc.md)
        cluster = SLURMCluster(
            cores=8, processes=1, memory="64GB", walltime=args.walltime, nanny=False,
            python=f"exec {sys.executable}",
            job_extra_directives=["--gres=gpu:1", "--signal=B:TERM@120"],
            scheduler_options=SCHEDULER_PRELOAD,
        )
        jobs = args.jobs * gpus
    else:
        cluster = SLURMCluster(
            cores=gpus, processes=gpus, memory=f"{16 * gpus}GB", walltime=args.walltime,
            job_extra_directives=[f"--gres=gpu:{gpus}"],
            # each worker process of a job sees only a GPU of its own: gpu_pin gives it
            # the device of its slot among the job's workers on the node
            # (SLURM_LOCALID is not per worker process)
            worker_extra_args=["--preload", "daskdist.plugins.gpu_pin"],
            scheduler_options=SCHEDULER_PRELOAD,
        )
        jobs = args.jobs
    cluster.scale(jobs=jobs)
    with Client(cluster) as client:
        if args.checkpoint:
            run = start_resumable(client, args.data, args.jobs * gpus, args.checkpoint,
                                  args.rows, every=100)
            try:
                runs = run_epoch(run)
                at = runs[0][0][0] if runs else "the end"
                print(f"resumed at commit {at}; {run.dataset.progress()}")
            finally:
                run.coord.close()
            return
        out = train(client, args.data, workers=args.jobs * gpus)
        print(out["group"])
        print(out["ranks"])
        print(f"{out['rows']:,} rows, each once: {out['progress']}")


if __name__ == "__main__":
    main()
