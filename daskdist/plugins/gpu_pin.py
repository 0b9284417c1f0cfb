"""Worker preload that gives each worker process of a multi-GPU host its own GPU.

``dask worker --preload daskdist.plugins.gpu_pin`` (or a jobqueue's
``worker_extra_args``, or ``LocalCluster(preload=["daskdist.plugins.gpu_pin"])``): the
worker keeps only the GPU of its *rank on its host* in ``CUDA_VISIBLE_DEVICES``, as
dask-cuda does, so ``cuda:0`` is its own device. The rank is the lowest free slot among
the worker processes of this host, held with a lock file for the process's life
(:func:`host_slot`): whatever the workers are named (``LocalCluster`` names them 0, 1,
...; dask-jobqueue ``...-0``, ``...-1``; users anything), and a restarted worker takes
the slot, and the GPU, its predecessor freed. It must run before CUDA is initialised in
the process, which a preload does.
"""

from __future__ import annotations

import os
import tempfile
from typing import IO

_held: list[IO] = []  # the slot locks this process holds (released when it exits)


def local_gpu(slot: int, visible: str | None, count: int) -> str | None:
    """The device id the worker of host slot ``slot`` should see, or ``None`` to leave
    things as they are (no GPU).

    ``visible`` is the current CUDA_VISIBLE_DEVICES (``None``: all ``count`` devices);
    slots beyond the devices wrap around.
    """
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [
        str(i) for i in range(count)]
    if not devices or slot < 0:
        return None
    return devices[slot % len(devices)]


def slots_dir() -> str:
    """Where this host's slot locks live (``daskdist.gpu-pin.slots-dir``, else a
    directory of this user's in the temporary directory)."""
    import dask.config

    return (dask.config.get("daskdist.gpu-pin.slots-dir", None)
            or os.path.join(tempfile.gettempdir(), f"daskdist-gpu-slots-{os.getuid()}"))


def host_slot(directory: str | None = None) -> int:
    """Claim the lowest slot no live process of this host holds, for this process's
    life: 0, 1, ... among the worker processes started here (a lock on ``<slot>.lock``,
    freed by the kernel when the process ends, however it ends)."""
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


def _gpu_count() -> int:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def dask_setup(worker) -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = 0 if visible else _gpu_count()
    if not visible and not count:
        return  # no GPU here: nothing to pin, no slot taken
    device = local_gpu(host_slot(), visible, count)
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
