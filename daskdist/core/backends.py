"""Which process-group backend a set of members can use: a pure decision (SPEC §4).

NCCL needs a GPU of its own for every rank (two ranks on one device is "invalid
usage" to NCCL, or a hang). Members report their device and the GPU they were given
(:func:`daskdist.core.gpus.gpu_identity`: a UUID or MIG id, else an index on their
host) at registration; the scheduler plugin decides here, before any member starts to
form, so a user sees which workers share which GPU instead of a failed formation. No
torch, no Dask: the scheduler imports this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from daskdist.core.gpus import gpu_key

BACKENDS = ("auto", "nccl", "gloo")

HOW_TO_SPLIT = (
    "give each worker its own GPU through its CUDA_VISIBLE_DEVICES (dask-cuda's "
    "LocalCUDACluster and `dask cuda worker` set one per worker; or start workers with "
    "`--preload daskdist.plugins.gpu_pin`), or use backend='gloo'"
)


class BackendError(ValueError):
    """The requested backend cannot serve these members (the message says why and what
    to do)."""


@dataclass(frozen=True)
class MemberDevice:
    """What one member reported: its Dask address, its device and its GPU."""

    address: str
    device: str  # "cpu", "cuda:0", ...
    gpu: str = ""  # its GPU's UUID or MIG id, or its index on the host ("": none given)

    @property
    def kind(self) -> str:
        return self.device.split(":", 1)[0]

    def gpu_key(self) -> str | None:
        """Identifies the physical GPU: its UUID or MIG id, else host + index (``None``:
        not on CUDA)."""
        return gpu_key(host_of(self.address), self.device, self.gpu)


def host_of(address: str) -> str:
    """``"tcp://10.0.0.1:8786"`` -> ``"10.0.0.1"``."""
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


def shared_gpus(members: Iterable[MemberDevice]) -> dict[str, list[str]]:
    """GPUs used by more than one member: ``{gpu: [addresses]}`` (empty if none)."""
    by_gpu: dict[str, list[str]] = {}
    for m in members:
        key = m.gpu_key()
        if key is not None:
            by_gpu.setdefault(key, []).append(m.address)
    return {gpu: addrs for gpu, addrs in by_gpu.items() if len(addrs) > 1}


def describe_sharing(shared: dict[str, list[str]]) -> str:
    """``"workers A, B share GPU X; ..."`` for messages and logs."""
    return "; ".join(f"workers {', '.join(addrs)} share GPU {gpu}"
                     for gpu, addrs in sorted(shared.items()))


def backend_for_devices(devices: Iterable[object], backend: str = "auto") -> str:
    """The backend for members on ``devices`` (device kinds only, one member's check).

    ``"auto"`` is NCCL only when every device is CUDA; an explicit ``"nccl"`` with a
    CPU member raises :class:`BackendError`.
    """
    backend = str(backend).lower()
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    kinds = [str(d).split(":", 1)[0] for d in devices]
    if not kinds:
        raise BackendError("choosing a backend needs at least one member device")
    all_cuda = all(k == "cuda" for k in kinds)
    if backend == "auto":
        return "nccl" if all_cuda else "gloo"
    if backend == "nccl" and not all_cuda:
        raise BackendError(
            f"backend 'nccl' needs CUDA on every member; member devices: {kinds}")
    return backend


def choose_backend(members: Sequence[MemberDevice], backend: str = "auto") -> str:
    """The backend for a group of ``members``: NCCL only when each has its own GPU.

    ``"auto"`` falls back to gloo when any member has no GPU or members share one (the
    caller may log :func:`shared_gpus`); an explicit ``"nccl"`` on shared GPUs raises
    :class:`BackendError` naming the workers and the GPU and how to give each its own.
    """
    chosen = backend_for_devices([m.device for m in members], backend)
    if chosen != "nccl":
        return chosen
    shared = shared_gpus(members)
    if not shared:
        return "nccl"
    if str(backend).lower() == "auto":
        return "gloo"
    raise BackendError(
        f"backend 'nccl' needs a GPU of its own for every member, but "
        f"{describe_sharing(shared)}: {HOW_TO_SPLIT}")
