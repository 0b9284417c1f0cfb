"""Worker preload that gives each worker process of a multi-GPU job its own GPU.

``dask worker --preload daskdist.plugins.gpu_pin`` (or a jobqueue's
``worker_extra_args``): a worker named ``...-N`` (dask-jobqueue and ``dask worker
--nworkers`` append ``-0``, ``-1``, ...) keeps only the N-th visible GPU in
``CUDA_VISIBLE_DEVICES``, as dask-cuda does, so ``cuda:0`` is its own device. It must
run before CUDA is initialised in the process, which a preload does.
"""

from __future__ import annotations

import os
import re


def local_gpu(name: str, visible: str | None, count: int) -> str | None:
    """The device id worker ``name`` should see, or ``None`` to leave things as they are.

    ``visible`` is the current CUDA_VISIBLE_DEVICES (``None``: all ``count`` devices).
    """
    m = re.search(r"-(\d+)$", str(name))
    if m is None:
        return None
    devices = [d for d in visible.split(",") if d.strip()] if visible else [
        str(i) for i in range(count)]
    if not devices:
        return None
    return devices[int(m.group(1)) % len(devices)].strip()


def _gpu_count() -> int:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def dask_setup(worker) -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    device = local_gpu(worker.name, visible, 0 if visible else _gpu_count())
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
