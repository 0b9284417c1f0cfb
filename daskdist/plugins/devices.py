"""What a Dask worker process was given of its host's GPUs: its ``CUDA_VISIBLE_DEVICES``
and, when that is unset, the host's GPU count. The I/O beside the pure decisions of
:mod:`daskdist.core.gpus`, shared by the worker plugin and the ``gpu_pin`` preload.
Imports neither torch nor CUDA: counting must not initialise CUDA in a worker that
may not use it (``gpu_pin`` runs before CUDA may be initialised).
"""

from __future__ import annotations

import os
import subprocess

from daskdist.core import gpus

VARIABLE = "CUDA_VISIBLE_DEVICES"


def visible() -> str | None:
    """This process's ``CUDA_VISIBLE_DEVICES`` (``None``: unset)."""
    return os.environ.get(VARIABLE)


def host_gpu_count() -> int:
    """The GPUs of this host: NVML's count through ``distributed``, else
    ``nvidia-smi -L``'s; 0 without either."""
    try:
        from distributed.diagnostics import nvml

        count = int(nvml.device_get_count())
    except Exception:  # noqa: BLE001 - no pynvml, no driver: ask nvidia-smi
        count = 0
    if count:
        return count
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def has_gpu(resources: dict | None) -> bool:
    """Whether this worker process has a GPU by the Dask convention
    (:func:`daskdist.core.gpus.has_gpu`); the host is counted only when the variable is
    unset and no ``GPU`` resource is declared."""
    value = visible()
    if value is None and not gpus.declares_gpu(resources):
        return host_gpu_count() > 0
    return gpus.has_gpu(value, resources, 0)
