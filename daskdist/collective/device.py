"""Device binding and backend choice for collective members.

Each worker binds one device: ``cuda:0`` when CUDA is visible (dask-cuda sets the
worker's ``CUDA_VISIBLE_DEVICES`` so that index 0 is its own GPU), else the CPU.
``backend_for`` is pure: it takes the members' device strings, so it can run
anywhere (client or worker) once the devices are gathered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

BACKENDS = ("auto", "nccl", "gloo")


def bind_device() -> Any:
    """This process's device: ``torch.device('cuda:0')`` with CUDA, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def backend_for(devices: Iterable[Any], backend: str = "auto") -> str:
    """Pick the process-group backend for members on ``devices``.

    ``devices`` holds one device per member (``torch.device`` or its string, e.g.
    ``"cuda:0"`` or ``"cpu"``). ``"auto"`` is NCCL only when every member has CUDA,
    else gloo. An explicit ``"nccl"`` with a CPU member raises ``ValueError``.
    """
    backend = backend.lower()
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    kinds = [str(d).split(":", 1)[0] for d in devices]
    if not kinds:
        raise ValueError("backend_for() needs at least one member device")
    all_cuda = all(k == "cuda" for k in kinds)
    if backend == "auto":
        return "nccl" if all_cuda else "gloo"
    if backend == "nccl" and not all_cuda:
        raise ValueError(f"backend 'nccl' needs CUDA on every member; member devices: {kinds}")
    return backend
