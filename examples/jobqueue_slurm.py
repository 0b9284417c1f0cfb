"""daskdist on a SLURM cluster through dask-jobqueue: one Dask worker per GPU.

    pip install dask-jobqueue
    python examples/jobqueue_slurm.py --jobs 4 --gpus-per-job 4

Each job starts one worker process per GPU (``processes=gpus``, one thread each); the
preload in ``job_script_prologue`` pins every worker to its own GPU through
CUDA_VISIBLE_DEVICES (what dask-cuda does), so ``ctx.device`` is ``cuda:0`` in each
and ``collective_group(backend="auto")`` picks NCCL. The scheduler gets the daskdist
plugin by preload, so the client needs no right to register plugins.
"""

from __future__ import annotations

import argparse

import torch
from distributed import Client

import daskdist as dd


def make_model(ctx):
    return torch.nn.Linear(1024, 1024).to(ctx.device)


def step(model):
    g = dd.collective.get_group()
    x = torch.randn(64, 1024, device=g.device)
    model(x).square().mean().backward()
    dd.collective.allreduce_gradients(model)
    return g.rank, str(g.device), g.backend


def main() -> None:
    from dask_jobqueue import SLURMCluster

    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--gpus-per-job", type=int, default=4)
    ap.add_argument("--walltime", default="01:00:00")
    args = ap.parse_args()
    gpus = args.gpus_per_job
    cluster = SLURMCluster(
        cores=gpus, processes=gpus, memory=f"{16 * gpus}GB", walltime=args.walltime,
        job_extra_directives=[f"--gres=gpu:{gpus}"],
        # worker i of a job sees only GPU i (SLURM_LOCALID is not per worker process,
        # so use the worker name's suffix that dask-jobqueue appends: -0, -1, ...)
        worker_extra_args=["--preload", "daskdist.plugins.gpu_pin"],
        scheduler_options={"preload": ["daskdist.plugins.scheduler"]},
    )
    cluster.scale(jobs=args.jobs)
    with Client(cluster) as client:
        client.wait_for_workers(args.jobs * gpus)
        coord = dd.Coordinator(client)
        group = coord.collective_group(backend="auto")
        print(group)
        model = coord.create_per_worker_resource(make_model)
        print(coord.fetch(coord.schedule_on_all(step, args=(model,))))


if __name__ == "__main__":
    main()
