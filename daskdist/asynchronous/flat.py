"""A model's tensors as one flat run of bytes, and back: what a pull, a push and a
standby copy carry (Dask's comms move ``bytes`` as they are).

A :data:`Layout` lists ``(name, dtype, shape)`` per tensor; each tensor's bytes start at
a multiple of :data:`ALIGN` so the receiver views them in place with their dtype.
:func:`check_layout` compares two layouts and names the first parameter that differs (a
model factory that builds different models on different workers).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

ALIGN = 16
Layout = list  # [(name, dtype name, shape), ...]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def layout_of(named: Iterable[tuple[str, torch.Tensor]]) -> Layout:
    """The layout of ``named`` tensors, in order."""
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in named]


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def nbytes(layout: Layout) -> int:
    """Bytes :func:`pack` makes of tensors of ``layout``."""
    total = 0
    for _, dtype, shape in layout:
        n = 1
        for s in shape:
            n *= int(s)
        total += _padded(n * _dtype(dtype).itemsize)
    return total


def pack(tensors: Iterable[torch.Tensor]) -> bytes:
    """The tensors' bytes (on the CPU), each from an aligned offset."""
    parts = []
    for t in tensors:
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        pad = _padded(raw.numel()) - raw.numel()
        parts.append(raw)
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
    if not parts:
        return b""
    return torch.cat(parts).numpy().tobytes()


def unpack(data: bytes, layout: Layout) -> list[torch.Tensor]:
    """Tensors of ``layout`` viewing a copy of ``data`` (they may be written to)."""
    if not layout:
        return []
    if len(data) != nbytes(layout):
        raise ValueError(f"{len(data)} bytes do not hold tensors of layout "
                         f"{layout[:3]}... ({nbytes(layout)} bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a copy follows: the buffer is never written
        flat = torch.frombuffer(data, dtype=torch.uint8).clone()
    out, at = [], 0
    for _, dtype, shape in layout:
        dt = _dtype(dtype)
        n = 1
        for s in shape:
            n *= int(s)
        size = n * dt.itemsize
        out.append(flat[at:at + size].view(dt).reshape(tuple(shape)))
        at += _padded(size)
    return out


def check_layout(expected: Layout, got: Layout, what: str) -> None:
    """``ValueError`` naming the first parameter where ``got`` differs from
    ``expected`` (missing, extra, another shape or dtype)."""
    exp = {name: (dtype, tuple(shape)) for name, dtype, shape in expected}
    have = {name: (dtype, tuple(shape)) for name, dtype, shape in got}
    for name, dtype, shape in expected:
        if name not in have:
            raise ValueError(f"{what}: parameter {name!r} of the global model is missing "
                             "from this worker's model: the model factory builds "
                             "different models on different workers")
        if have[name] != (dtype, tuple(shape)):
            raise ValueError(f"{what}: parameter {name!r} is {have[name][0]} "
                             f"{list(have[name][1])} on this worker and {dtype} "
                             f"{list(shape)} in the global model: the model factory "
                             "builds different models on different workers")
    for name, _, _ in got:
        if name not in exp:
            raise ValueError(f"{what}: parameter {name!r} of this worker's model is not "
                             "in the global model: the model factory builds different "
                             "models on different workers")
    if [n for n, _, _ in expected] != [n for n, _, _ in got]:
        raise ValueError(f"{what}: the parameters come in another order on this worker "
                         "than in the global model: the model factory builds different "
                         "models on different workers")
