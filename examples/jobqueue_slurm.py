"""daskdist on a SLURM cluster through dask-jobqueue: one Dask worker per GPU.

    pip install daskdist[hpc]
    python examples/jobqueue_slurm.py --jobs 4 --gpus-per-job 4 --data '/shared/shards/*.parquet'

Each job starts one worker process per GPU (``processes=gpus``, one thread each); the
preload ``daskdist.plugins.gpu_pin`` pins every worker to its own GPU through
CUDA_VISIBLE_DEVICES (what dask-cuda does), so ``ctx.device`` is ``cuda:0`` in each
and ``collective_group(backend="auto")`` picks NCCL. The scheduler gets the daskdist
plugin by preload, so the client needs no right to register plugins.

:func:`train` is what the CI test (``tests/test_slurm.py``) runs on a real one-node
Slurm with CPU workers: closures, a gang step on the collective group, and a dynamic
epoch during which a job may be cancelled (``during_epoch``), every row exactly once.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--gpus-per-job", type=int, default=4)
    ap.add_argument("--walltime", default="01:00:00")
    ap.add_argument("--data", required=True, help="Parquet shards every node can read")
    args = ap.parse_args()
    gpus = args.gpus_per_job
    cluster = SLURMCluster(
        cores=gpus, processes=gpus, memory=f"{16 * gpus}GB", walltime=args.walltime,
        job_extra_directives=[f"--gres=gpu:{gpus}"],
        # worker i of a job sees only GPU i (SLURM_LOCALID is not per worker process,
        # so use the worker name's suffix that dask-jobqueue appends: -0, -1, ...)
        worker_extra_args=["--preload", "daskdist.plugins.gpu_pin"],
        scheduler_options=SCHEDULER_PRELOAD,
    )
    cluster.scale(jobs=args.jobs)
    with Client(cluster) as client:
        out = train(client, args.data, workers=args.jobs * gpus)
        print(out["group"])
        print(out["ranks"])
        print(f"{out['rows']:,} rows, each once: {out['progress']}")


if __name__ == "__main__":
    main()
