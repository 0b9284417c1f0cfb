"""The Dask GPU convention, as pure decisions: which GPU a worker process was given.

Dask users give a worker its GPU through ``CUDA_VISIBLE_DEVICES``: dask-cuda's
``LocalCUDACluster`` and ``dask cuda worker`` set it per worker, rotated so that the
worker's own device comes first (``"1,2,3,0"``), and declare no ``"GPU"`` resource;
``distributed``'s NVML monitoring takes that first entry (an index, a ``GPU-`` UUID or a
``MIG-`` id) as the worker's GPU. CUDA reads the variable the same way: entries up to the
first that is none of these, and an empty value hides every device. So a worker started
with ``CUDA_VISIBLE_DEVICES=""`` has no GPU, whatever its host has.

These functions decide from the values alone (the environment variable's text, the
declared Dask resources, a device count, the UUID torch reports), so the worker plugin,
the ``gpu_pin`` preload and the scheduler's backend choice share one reading of them.
No torch, no Dask.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

ID_PREFIXES = ("GPU-", "MIG-")  # a device named by its UUID, or a MIG instance's id
_INDEX = re.compile(r"[0-9]+")


def _entry(text: str) -> str | None:
    """One ``CUDA_VISIBLE_DEVICES`` entry as CUDA reads it: an index (``"01"`` is
    ``"1"``), a ``GPU-``/``MIG-`` id, or ``None`` (not a device: the list ends here)."""
    text = text.strip()
    if _INDEX.fullmatch(text):
        return str(int(text))
    if text.startswith(ID_PREFIXES) and len(text) > 4:
        return text
    return None


def visible_devices(value: str | None) -> tuple[str, ...] | None:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value shows, in order; ``None`` when the
    variable is unset (the host's every device).

    ``""`` (or only blanks) shows none. As CUDA does, the list ends at the first entry
    that is neither an index nor a ``GPU-``/``MIG-`` id: ``"0,-1,2"`` shows device 0,
    ``"NoDevFiles"`` (what some Slurm setups set without a GPU) none.
    """
    if value is None:
        return None
    devices = []
    for text in value.split(","):
        device = _entry(text)
        if device is None:
            break
        devices.append(device)
    return tuple(devices)


def given_gpu(value: str | None) -> str | None:
    """The GPU a worker with this ``CUDA_VISIBLE_DEVICES`` was given: its first device
    (what Dask's NVML monitors); ``None`` when unset or when it shows no device."""
    devices = visible_devices(value)
    return devices[0] if devices else None


def declares_gpu(resources: Mapping[str, float] | None) -> bool:
    """Whether a worker declares a Dask ``GPU`` resource (any case, a positive amount),
    as ``dask worker --resources GPU=1`` does."""
    return any(str(k).lower() == "gpu" and float(v) > 0 for k, v in (resources or {}).items())


def has_gpu(visible: str | None, resources: Mapping[str, float] | None,
            device_count: int) -> bool:
    """Whether a worker has a GPU by the Dask convention: the decision of
    ``Coordinator(members="gpu")``.

    ``visible`` is its ``CUDA_VISIBLE_DEVICES`` (``None``: unset), ``resources`` the
    Dask resources it declares, ``device_count`` the GPUs of its host. A set variable
    decides alone: a device named is a GPU, none (``""``) is no GPU, even with a
    declared ``GPU`` resource (that worker would run on the CPU). Unset, a declared
    ``GPU`` resource or any device on the host is one (Dask's NVML takes device 0).
    """
    devices = visible_devices(visible)
    if devices is not None:
        return bool(devices)
    return declares_gpu(resources) or device_count > 0


def gpu_identity(visible: str | None, uuid: str = "", cuda: bool = False) -> str:
    """What a worker reports as its GPU, to tell members that share one apart.

    The ``GPU-``/``MIG-`` id it was given, as given; else, with a CUDA device bound
    (``cuda``), the device's UUID as torch reports it (``GPU-`` added when torch leaves
    it out), which names the physical GPU however it was given; else the index it was
    given (``"0"``: unset, with CUDA); ``""`` when it was given none.
    """
    devices = visible_devices(visible)
    if devices == ():
        return ""
    first = devices[0] if devices else None
    if first is not None and first.startswith(ID_PREFIXES):
        return first
    uuid = uuid.strip()
    if cuda and uuid:
        return uuid if uuid.startswith(ID_PREFIXES) else f"GPU-{uuid}"
    if first is not None:
        return first
    return "0" if cuda else ""


def gpu_key(host: str, device: str, gpu: str) -> str | None:
    """The physical GPU a member on ``device`` (``"cuda:0"``, ``"cpu"``) of ``host``
    uses, from its reported ``gpu`` (:func:`gpu_identity`); ``None`` off CUDA.

    A ``GPU-``/``MIG-`` id names one device anywhere; an index numbers its host's
    devices (``"10.0.0.1/3"``); with nothing reported, the host and the bound device.
    """
    if device.split(":", 1)[0] != "cuda":
        return None
    if gpu.startswith(ID_PREFIXES):
        return gpu
    return f"{host}/{gpu or device}"
