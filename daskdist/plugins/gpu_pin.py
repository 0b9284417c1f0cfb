"""Worker preload that gives each worker process of a multi-GPU host its own GPU.

``dask worker --preload daskdist.plugins.gpu_pin`` (or a jobqueue's
``worker_extra_args``, or ``LocalCluster(preload=["daskdist.plugins.gpu_pin"])``): the
worker keeps only the GPU of its *slot* in ``CUDA_VISIBLE_DEVICES``, as dask-cuda does,
so ``cuda:0`` is its own device. The slot is the lowest free one among the worker
processes of the same *job* on this host, held with a lock file for the process's life
(:func:`host_slot`): whatever the workers are named (``LocalCluster`` names them 0, 1,
...; dask-jobqueue ``...-0``, ``...-1``; users anything), and a restarted worker takes
the slot, and the GPU, its predecessor freed.

Slots belong to one job (:func:`job_key`: ``daskdist.gpu-pin.job``, else the batch
system's job id, else the cluster's scheduler address), each job's in a directory of its
own: two jobs sharing a node number their workers apart, each over the devices its own
``CUDA_VISIBLE_DEVICES`` shows. A worker started with ``CUDA_VISIBLE_DEVICES=""`` has no
GPU and is left without one (no slot taken). It must run before CUDA is initialised in
the process, which a preload does.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from typing import IO

from daskdist.core import gpus
from daskdist.plugins import devices

_held: list[IO] = []  # the slot locks this process holds (released when it exits)


def local_gpu(slot: int, visible: str | None, count: int) -> str | None:
    """The device id the worker of slot ``slot`` should see, or ``None`` to leave
    things as they are (no GPU).

    ``visible`` is the current CUDA_VISIBLE_DEVICES (``None``: all ``count`` devices;
    ``""``: none); slots beyond the devices wrap around.
    """
    shown = gpus.visible_devices(visible)
    devices = list(shown) if shown is not None else [str(i) for i in range(count)]
    if not devices or slot < 0:
        return None
    return devices[slot % len(devices)]


def job_key(configured: str | None, environ: Mapping[str, str],
            variables: Sequence[str], scheduler: str) -> str:
    """The job whose workers share slot numbers: ``configured`` when set, else the
    first batch job id among ``variables`` in ``environ`` (``"SLURM_JOB_ID=42"``), else
    the ``scheduler`` address (a cluster outside a batch system is one job)."""
    if configured:
        return str(configured)
    for name in variables:
        value = environ.get(name)
        if value:
            return f"{name}={value}"
    return scheduler or "local"


def slots_dir(job: str = "local") -> str:
    """Where the slot locks of ``job`` live on this host: a directory of its own under
    ``daskdist.gpu-pin.slots-dir``, else under one of this user's in the temporary
    directory."""
    import dask.config

    base = (dask.config.get("daskdist.gpu-pin.slots-dir", None)
            or os.path.join(tempfile.gettempdir(), f"daskdist-gpu-slots-{os.getuid()}"))
    readable = re.sub(r"[^A-Za-z0-9._=-]+", "_", job)[:80]
    digest = hashlib.sha256(job.encode()).hexdigest()[:12]  # keys that read alike differ
    return os.path.join(base, f"{readable}-{digest}")


def host_slot(directory: str | None = None) -> int:
    """Claim the lowest slot no live process holds in ``directory`` (one job's), for
    this process's life: 0, 1, ... among the worker processes started here (a lock on
    ``<slot>.lock``, freed by the kernel when the process ends, however it ends)."""
    import fcntl

    directory = directory or slots_dir()
    os.makedirs(directory, exist_ok=True)
    slot = 0
    while True:
        f = open(os.path.join(directory, f"{slot}.lock"), "a+")  # noqa: SIM115 - held
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            slot += 1
            continue
        _held.append(f)
        return slot


def release_slots() -> None:
    """Give up the slots this process holds (tests; a worker's end does it anyway)."""
    while _held:
        _held.pop().close()


def worker_job(worker) -> str:
    """The job of this worker process (:func:`job_key` from its settings, environment
    and scheduler address)."""
    import dask.config

    return job_key(dask.config.get("daskdist.gpu-pin.job", None), os.environ,
                   dask.config.get("daskdist.gpu-pin.job-variables", None) or (),
                   getattr(getattr(worker, "scheduler", None), "address", "") or "")


def dask_setup(worker) -> None:
    visible = devices.visible()
    shown = gpus.visible_devices(visible)
    if shown == ():
        return  # CUDA_VISIBLE_DEVICES="" (or no device named): no GPU, no slot taken
    count = 0 if shown else devices.host_gpu_count()
    if not shown and not count:
        return  # no GPU here: nothing to pin, no slot taken
    device = local_gpu(host_slot(slots_dir(worker_job(worker))), visible, count)
    if device is not None:
        os.environ[devices.VARIABLE] = device
