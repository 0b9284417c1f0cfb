"""Replica helpers: make parameters equal, average gradients (SPEC §4); tensors in
nested structures moved to the CPU (``to_cpu``).

``broadcast_parameters`` and ``allreduce_gradients`` flatten many small tensors into a
few large buffers (one per dtype, split at ``bucket_mb``) so a model costs a handful of
collective calls, not one per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from daskdist.collective.group import Group, get_group
from daskdist.collective.step.step import this_step
from daskdist.core.nest import map_instances

_BUCKET_MB = 32.0


def broadcast_parameters(
    model: torch.nn.Module, src: int = 0, group: Group | None = None, bucket_mb: float = _BUCKET_MB
) -> None:
    """Overwrite every parameter and buffer of ``model`` with rank ``src``'s, in place."""
    g = group or get_group()
    tensors = [p.data for p in model.parameters()] + [b for b in model.buffers()]
    for bucket in _buckets(tensors, bucket_mb):
        flat = _on_wire(_flatten_dense_tensors(bucket), g)
        g.broadcast(flat, src)
        if g.rank != src:
            for t, new in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                t.copy_(new)


def allreduce_gradients(
    model: torch.nn.Module,
    average: bool = True,
    group: Group | None = None,
    bucket_mb: float = _BUCKET_MB,
) -> None:
    """Sum (or, with ``average``, average) the gradients of ``model`` over all ranks.

    A parameter that requires grad but has none on this rank counts as a zero
    gradient (and gets one), so every rank issues the same calls. Inside a closure,
    what ``synced`` and ``State`` need of every rank before the next step rides in the
    first bucket (the closure's :class:`~daskdist.collective.step.step.Step`): the step
    makes one call.
    """
    g = group or get_group()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets = list(_buckets([p.grad.data for p in params], bucket_mb))
    step = this_step(create=False) if _current(g) else None
    riding = step.riding(g.generation) if step is not None else None
    if riding is not None and (not buckets or not buckets[0][0].is_floating_point()):
        buckets.insert(0, [])  # nothing to ride on: a float32 call of their own
    for i, bucket in enumerate(buckets):
        flat = (_on_wire(_flatten_dense_tensors(bucket), g) if bucket
                else torch.zeros(0, device=g.wire_device))
        n = flat.numel()
        ride = riding if i == 0 else None  # the first bucket carries the riders
        if ride is not None:
            flat = torch.cat([flat, ride.encode(g.rank, g.world_size, flat.dtype,
                                                flat.device)])
        try:
            g.allreduce(flat, op="sum")
        except BaseException:
            if ride is not None:
                ride.failed()
            raise
        if ride is not None:
            ride.decode(flat[n:], g.world_size)
            flat = flat[:n]
        if not bucket:
            continue
        if average and g.world_size > 1:
            flat.div_(g.world_size)
        for t, new in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            t.copy_(new)


def _current(g: Group) -> bool:
    """Whether ``g`` is the group this process is a member of now (what rides is its)."""
    try:
        return get_group().generation == g.generation
    except RuntimeError:
        return False


def _on_wire(flat: torch.Tensor, g: Group) -> torch.Tensor:
    """``flat`` where ``g``'s backend can send it: NCCL takes CUDA tensors only, so a
    bucket of a model on the CPU in an NCCL group (Lightning moves a module back to the
    CPU when a fit ends) goes through the group's device (``t.copy_`` brings it back)."""
    if g.backend == "nccl" and not flat.is_cuda:
        return flat.to(g.device)
    return flat


def _buckets(tensors: Iterable[torch.Tensor], bucket_mb: float) -> Iterator[list[torch.Tensor]]:
    """Group ``tensors`` by (device, dtype), in order, into buckets of ~``bucket_mb``."""
    limit = max(1, int(bucket_mb * 2**20))
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_sparse:
            raise TypeError("sparse tensors are not supported")
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for group in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the CPU (for pickling across devices)."""
    return map_instances(lambda t: t.detach().cpu(), obj, torch.Tensor)
