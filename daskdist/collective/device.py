"""Device binding and backend choice for collective members.

Each worker binds one device: ``cuda:0`` when CUDA is visible (dask-cuda sets the
worker's ``CUDA_VISIBLE_DEVICES`` so that index 0 is its own GPU), else the CPU; a
worker whose ``CUDA_VISIBLE_DEVICES`` shows no device (``""``) binds the CPU.
``backend_for`` is pure: it takes the members' device strings, so it can run
anywhere (client or worker) once the devices are gathered; ``gpu_uuid`` is the UUID
torch reports for the device, from which a worker's reported GPU is made
(:func:`daskdist.core.gpus.gpu_identity`) so the scheduler can tell members that share
a GPU apart.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from daskdist.core.backends import backend_for_devices
from daskdist.core.gpus import visible_devices


def bind_device() -> Any:
    """This process's device: ``torch.device('cuda:0')`` with CUDA, else ``cpu`` (also
    when ``CUDA_VISIBLE_DEVICES`` shows no device, whatever the host has)."""
    import torch

    if visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")) == ():
        return torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def backend_for(devices: Iterable[Any], backend: str = "auto") -> str:
    """Pick the process-group backend for members on ``devices``.

    ``devices`` holds one device per member (``torch.device`` or its string, e.g.
    ``"cuda:0"`` or ``"cpu"``). ``"auto"`` is NCCL only when every member has CUDA,
    else gloo. An explicit ``"nccl"`` with a CPU member raises ``ValueError``. Whether
    members *share* a GPU is decided before formation, from their GPU UUIDs
    (:func:`daskdist.core.backends.choose_backend`).
    """
    return backend_for_devices(devices, backend)


def gpu_uuid(device: Any) -> str:
    """The UUID of ``device``'s GPU (``""`` for a CPU device, or when torch cannot tell)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return ""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return "" if uuid is None else str(uuid)
