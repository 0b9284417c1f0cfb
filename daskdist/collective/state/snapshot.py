"""HostCopy: a State's committed copy, in host memory, refilled in place at each commit.

Horovod's TorchState keeps ``copy.deepcopy(state_dict())``: a second copy of the model
and the optimizer *on the device*, allocated anew at every commit. A ``HostCopy`` keeps
the tensors of a value (model and optimizer state dicts, named objects) in host buffers
made once and refilled in place (pinned when the tensor is on CUDA, so the copy is
asynchronous: queued on the current stream, in order before the next step's kernels
change the tensors, and waited for only when the copy is read: :meth:`wait`). Nothing
stays on the device. The value's other leaves (ints, a step counter, param_groups) are
deep-copied, which is cheap. Tensors inside objects other than dicts, lists and tuples
are deep-copied as they are.

Reading it back (:meth:`value`) gives either the host buffers themselves (a model's
``load_state_dict`` copies out of them) or fresh tensors on the devices the tensors
were on when the copy was filled (an optimizer's ``load_state_dict`` and the named
objects keep what they get, so they must not alias the buffers).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from daskdist.core.nest import map_instances


class _Slot:
    """Where tensor ``i`` of the value was (a placeholder in the skeleton)."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class HostCopy:
    """One copy of a value's tensors in host memory (see the module doc). Owned by one
    thread at a time (the State's: a closure's thread)."""

    def __init__(self) -> None:
        self.skeleton: Any = None
        self.host: list[torch.Tensor] = []
        self.devices: list[torch.device] = []
        self.grads: list[bool] = []
        self._events: list[Any] = []  # CUDA events of the last fill's copies

    @property
    def nbytes(self) -> int:
        """Host bytes the buffers hold."""
        return sum(t.numel() * t.element_size() for t in self.host)

    def fill(self, value: Any) -> HostCopy:
        """Copy ``value``'s tensors into the buffers (made, or remade for a tensor whose
        shape or dtype changed); returns self."""
        tensors: list[torch.Tensor] = []
        skeleton = _flatten(value, tensors)
        host = []
        cuda: dict[torch.device, None] = {}
        same: list[tuple[torch.Tensor, torch.Tensor]] = []  # host buffer, CPU tensor
        for i, t in enumerate(tensors):
            t = t.detach()
            buf = self.host[i] if i < len(self.host) else None
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            if t.is_cuda:
                cuda[t.device] = None
                buf.copy_(t, non_blocking=buf.is_pinned())
            else:
                same.append((buf, t))
            host.append(buf)
        if same:  # the CPU tensors in one call
            torch._foreach_copy_([b for b, _ in same], [t for _, t in same])
        events = []
        for dev in cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            events.append(ev)
        self.skeleton, self.host, self._events = skeleton, host, events
        self.devices = [t.device for t in tensors]
        self.grads = [t.requires_grad for t in tensors]
        return self

    def wait(self) -> None:
        """Block until the last fill's copies are in the buffers."""
        for ev in self._events:
            ev.synchronize()
        self._events = []

    def value(self, to_devices: bool = False) -> Any:
        """The value: its tensors as the host buffers (``to_devices=False``: read them,
        do not keep them) or as fresh tensors on the devices they came from."""
        self.wait()
        if to_devices:
            tensors = [b.to(d, copy=True).requires_grad_(g and b.is_floating_point())
                       for b, d, g in zip(self.host, self.devices, self.grads, strict=True)]
        else:
            tensors = self.host
        return _build(self.skeleton, tensors)


_ATOMS = (int, float, bool, str, bytes, type(None))  # immutable: kept, not deep-copied


def _flatten(value: Any, out: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a :class:`_Slot` (appended to ``out``) and
    every other leaf deep-copied; dicts keep their type and a state dict's
    ``_metadata`` (``load_state_dict`` reads module versions there), which
    ``core.nest.map_structure`` would drop."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, torch.Tensor):
        out.append(value)
        return _Slot(len(out) - 1)
    if isinstance(value, dict):
        d = type(value)()
        for k, v in value.items():
            d[k] = _flatten(v, out)
        meta = getattr(value, "_metadata", None)
        if meta is not None:
            d._metadata = copy.deepcopy(meta)
        return d
    if isinstance(value, list):
        return [_flatten(v, out) for v in value]
    if isinstance(value, tuple):
        items = [_flatten(v, out) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return copy.deepcopy(value)


def _build(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.i]
    if isinstance(skeleton, dict):
        d = type(skeleton)()
        for k, v in skeleton.items():
            d[k] = _build(v, tensors)
        meta = getattr(skeleton, "_metadata", None)
        if meta is not None:
            d._metadata = meta
        return d
    if isinstance(skeleton, list):
        return [_build(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        items = [_build(v, tensors) for v in skeleton]
        return type(skeleton)(*items) if hasattr(skeleton, "_fields") else tuple(items)
    return copy.deepcopy(skeleton)


def like(loaded: Any, current: Any) -> Any:
    """``loaded`` (read from a checkpoint, its tensors on the CPU) with each tensor moved
    to the device of the tensor at the same place in ``current`` (the State's objects as
    this worker made them): a CUDA-held object stays on CUDA after a resume."""
    if isinstance(loaded, torch.Tensor):
        if isinstance(current, torch.Tensor) and current.device != loaded.device:
            return loaded.to(current.device)
        return loaded
    if isinstance(loaded, dict) and isinstance(current, dict):
        return type(loaded)((k, like(v, current.get(k))) for k, v in loaded.items())
    if isinstance(loaded, (list, tuple)) and isinstance(current, (list, tuple)) \
            and len(loaded) == len(current) and type(loaded) in (list, tuple):
        return type(loaded)(like(a, b) for a, b in zip(loaded, current, strict=True))
    return loaded


def cloned(value: Any) -> Any:
    """``value`` with every tensor cloned (a checkpoint's own copy of host buffers, which
    later commits refill while the write runs)."""
    return map_instances(lambda t: t.clone(), value, torch.Tensor)
