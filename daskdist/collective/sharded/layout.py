"""What a sharded model and its optimizer hold on one rank, as a commit keeps it.

The tensors FSDP2 splits over the group (parameters and the optimizer's per-parameter
state: Adam's moments, SGD's momentum) are *entries*: a key, a dtype, the whole
tensor's shape and the dimension it is split along, the same on every rank. Each rank
holds rows ``core.resharding.span(rows, world, rank)`` of each entry, and a commit packs them
into one flat byte buffer (:func:`pack`: entry after entry, each moved to have its split
dimension first, at the offsets ``core.resharding.offsets`` gives), so a shard is one buffer
and any rows of it one contiguous range. Everything else (buffers, parameters left
unsharded, the optimizer's step counters and hyperparameters) is the *rest*, the same on
every rank, kept whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from daskdist.core.resharding import offsets, span

_PARAM, _OPTIM = "p", "o"


@dataclass(frozen=True)
class Entry:
    """A tensor split over the group: ``key`` names it (``p|<fqn>`` a parameter,
    ``o|<fqn>|<name>`` an optimizer state of one), ``shape`` is the whole tensor's."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int

    @property
    def rows(self) -> int:
        return self.shape[self.dim]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along the split dimension."""
        others = math.prod(s for i, s in enumerate(self.shape) if i != self.dim)
        return others * self.dtype.itemsize


@dataclass
class Live:
    """A rank's sharded tensors now: ``entries`` and their local shards (``locals``, in
    their own layout), and the ``rest`` (references, not copies)."""

    entries: tuple[Entry, ...]
    locals: list[torch.Tensor]
    rest: dict


def capture(model: torch.nn.Module, optimizer: Any, rank: int, world: int) -> Live:
    """The entries, local shards and rest of ``model`` and ``optimizer`` on ``rank``."""
    return Capture()(model, optimizer, rank, world)


class Capture:
    """:func:`capture`, its checks and lookups done once per layout (a generation's
    model and optimizer, with the optimizer states they hold): later calls read the
    current local shards and rest through the tensors found then (a commit runs every
    step, and a model has hundreds of tensors)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._entries: tuple[Entry, ...] = ()
        self._sources: list[tuple[Any, Any]] = []  # (parameter, optimizer state name)
        self._params: list[tuple[str, Any]] = []  # unsharded parameters
        self._buffers: list[tuple[str, Any]] = []
        self._state: list[tuple[str, Any, list]] = []  # (fqn, parameter, other names)
        self._groups: list[list[str]] = []

    def __call__(self, model: torch.nn.Module, optimizer: Any, rank: int,
                 world: int) -> Live:
        key = (id(model), id(optimizer), rank, world, _states(optimizer))
        if key != self._key:
            self._plan(model, optimizer, rank, world)
            self._key = key
        local = []
        for p, k in self._sources:
            t = p if k is None else optimizer.state[p][k]
            local.append(t._local_tensor.detach())
        rest: dict[str, Any] = {
            "params": {n: p.detach() for n, p in self._params},
            "buffers": dict(self._buffers),
            "state": {fqn: {k: _plain(optimizer.state[p][k]) for k in names}
                      for fqn, p, names in self._state},
            "groups": [] if optimizer is None else [
                {**{k: v for k, v in group.items() if k != "params"}, "params": fqns}
                for group, fqns in zip(optimizer.param_groups, self._groups, strict=True)]}
        return Live(self._entries, local, rest)

    def _plan(self, model: torch.nn.Module, optimizer: Any, rank: int, world: int) -> None:
        names = _names(model)
        entries: list[Entry] = []
        sources: list[tuple[Any, Any]] = []
        self._params, self._state, self._groups = [], [], []
        for fqn, p in model.named_parameters():
            if _entry(entries, f"{_PARAM}|{fqn}", p, rank, world):
                sources.append((p, None))
            else:
                self._params.append((fqn, p))
        persistent = _persistent(model)
        self._buffers = [(n, b) for n, b in model.named_buffers() if n in persistent]
        if optimizer is not None:
            for fqn, p in model.named_parameters():
                state = optimizer.state.get(p)
                if not state:
                    continue
                others = []
                for k in sorted(state, key=str):
                    if _entry(entries, f"{_OPTIM}|{fqn}|{k}", state[k], rank, world):
                        sources.append((p, k))
                    else:
                        others.append(k)
                self._state.append((fqn, p, others))
            for group in optimizer.param_groups:
                try:
                    self._groups.append([names[id(p)] for p in group["params"]])
                except KeyError:
                    raise ValueError("ShardedState: the optimizer holds a tensor that is "
                                     "not a parameter of the model (make it from the "
                                     "params the optimizer factory is given)") from None
        self._entries, self._sources = tuple(entries), sources


def _states(optimizer: Any) -> tuple[int, int]:
    """How many parameters have optimizer state, and how many states in all (a new one
    changes the layout)."""
    if optimizer is None:
        return 0, 0
    return len(optimizer.state), sum(len(v) for v in optimizer.state.values())


def _plain(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _entry(entries: list, key: str, value: Any, rank: int, world: int) -> bool:
    """Whether ``value`` is split over the group (then appended to ``entries``)."""
    if not isinstance(value, DTensor):
        return False
    shape = tuple(value.shape)
    mine, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                         value.placements)
    dims = {p.dim for p in value.placements if p.is_shard()}
    ok = len(dims) == 1
    if ok:
        (dim,) = dims
        a, b = span(shape[dim], world, rank)
        ok = (mine[dim] == b - a and (a == b or offset[dim] == a)
              and all(mine[i] == shape[i] for i in range(len(shape)) if i != dim))
    if not ok:
        raise ValueError(
            f"ShardedState reshards tensors split over the group's {world} ranks along one "
            f"dimension, as FSDP2's fully_shard over its mesh cuts them; {key} has "
            f"placements {value.placements} on rank {rank} (local {tuple(mine)} at "
            f"{tuple(offset)} of {shape})")
    entries.append(Entry(key, value.dtype, shape, dim))
    return True


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): fqn for fqn, p in model.named_parameters()}


def _persistent(model: torch.nn.Module) -> set[str]:
    """Names of the buffers a state dict holds (not the non-persistent ones)."""
    out = set()
    for prefix, m in model.named_modules():
        for name in m._buffers:
            if name not in m._non_persistent_buffers_set:
                out.add(f"{prefix}.{name}" if prefix else name)
    return out


def sizes(entries: tuple[Entry, ...]) -> tuple[list[int], list[int]]:
    """Rows and row bytes of each entry (what ``core.resharding`` plans with)."""
    return [e.rows for e in entries], [e.row_bytes for e in entries]


_placed: dict[tuple[int, int, int], tuple[tuple, tuple[list[int], int]]] = {}
_PLACED_MAX = 256


def placed_at(entries: tuple[Entry, ...], world: int, index: int) -> tuple[list[int], int]:
    """Where each entry starts in shard ``index``'s flat buffer, and its length
    (``core.resharding.offsets``, remembered for the same ``entries`` object: a commit asks
    every step, and hashing hundreds of entries would cost more than the answer)."""
    key = (id(entries), world, index)
    hit = _placed.get(key)
    if hit is not None and hit[0] is entries:
        return hit[1]
    rows, rb = sizes(entries)
    out = offsets(rows, rb, world, index)
    if len(_placed) >= _PLACED_MAX:
        _placed.clear()
    _placed[key] = (entries, out)  # holds entries: its id is not reused meanwhile
    return out


def flat_size(entries: tuple[Entry, ...], world: int, index: int) -> int:
    """Bytes of shard ``index``'s flat buffer."""
    return placed_at(entries, world, index)[1]


def as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its split dimension first, as bytes, one row per row (a view when the
    split dimension is already first; a copy otherwise)."""
    t = t.movedim(dim, 0).contiguous() if dim else t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def views(flat: torch.Tensor, entries: tuple[Entry, ...], world: int,
          index: int) -> list[torch.Tensor]:
    """Each entry's rows of shard ``index`` in ``flat`` (its packed buffer), as tensors
    of their own layout (views of the buffer)."""
    offs, _ = placed_at(entries, world, index)
    out = []
    for e, o in zip(entries, offs, strict=True):
        a, b = span(e.rows, world, index)
        n = (b - a) * e.row_bytes
        moved = (b - a,) + tuple(s for i, s in enumerate(e.shape) if i != e.dim)
        out.append(flat[o:o + n].view(e.dtype).view(moved).movedim(0, e.dim))
    return out


def pack(local: list[torch.Tensor], entries: tuple[Entry, ...], world: int, index: int,
         flat: torch.Tensor) -> None:
    """Copy the local shards into ``flat`` (shard ``index``'s buffer; from CUDA into a
    pinned buffer: queued on the current stream, not waited for)."""
    offs, _ = placed_at(entries, world, index)
    for t, e, o in zip(local, entries, offs, strict=True):
        src = as_rows(t, e.dim)
        flat[o:o + src.numel()].copy_(src, non_blocking=flat.is_pinned())


def segments(local: list[torch.Tensor], entries: tuple[Entry, ...], world: int,
             index: int) -> list[tuple[int, torch.Tensor]]:
    """``(offset in the flat buffer, bytes)`` of each local shard: the flat buffer's
    content without building it (a commit streams it to its copy in rounds)."""
    offs, _ = placed_at(entries, world, index)
    return [(o, as_rows(t, e.dim)) for t, e, o in zip(local, entries, offs, strict=True)]


# -- loading a commit into a freshly sharded model ---------------------------------------


def targets(model: torch.nn.Module, optimizer: Any, entries: tuple[Entry, ...], rank: int,
            world: int) -> list[torch.Tensor]:
    """The local shards of ``entries`` in ``model`` and ``optimizer``, to be written in
    place. The optimizer's states a commit holds are made here, so a loaded optimizer
    holds them before its first step (made like the parameter: zeros until written)."""
    params = dict(model.named_parameters())
    out = []
    for e in entries:
        kind, fqn, *name = e.key.split("|", 2)
        p = params.get(fqn)
        if p is None:
            raise ValueError(f"ShardedState: the committed state holds {fqn!r}, which the "
                             f"model has not (the model factory must build the same model "
                             f"on every rank and in every generation)")
        if kind == _PARAM:
            t = p
        else:
            if optimizer is None:
                raise ValueError("ShardedState: the committed state holds optimizer state "
                                 "and the State has no optimizer")
            state = optimizer.state[p]
            t = state.get(name[0])
            if t is None:
                t = _like(p, e)
                state[name[0]] = t
        if not isinstance(t, DTensor) or tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise ValueError(f"ShardedState: {e.key} is {type(t).__name__} "
                             f"{tuple(t.shape)} {t.dtype} now, the commit holds "
                             f"{e.shape} {e.dtype} split over the group")
        local = t.to_local().detach()
        a, b = span(e.rows, world, rank)
        if local.shape[e.dim] != b - a:
            raise ValueError(f"ShardedState: {e.key} holds {local.shape[e.dim]} rows on rank "
                             f"{rank}, not the {b - a} of FSDP2's cut over {world} ranks")
        out.append(local)
    return out


def _like(p: DTensor, e: Entry) -> DTensor:
    """A new optimizer state tensor for parameter ``p``, split as ``e`` is."""
    if tuple(p.shape) == e.shape and p.dtype == e.dtype:
        return torch.zeros_like(p, memory_format=torch.preserve_format).detach()
    from torch.distributed.tensor import Shard

    placements = tuple(Shard(e.dim) if pl.is_shard() else pl for pl in p.placements)
    shape, _ = compute_local_shape_and_global_offset(torch.Size(e.shape), p.device_mesh,
                                                     placements)
    local = torch.zeros(shape, dtype=e.dtype, device=p.to_local().device)
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False,
                              shape=torch.Size(e.shape),
                              stride=torch.empty(e.shape, device="meta").stride())


def apply_rest(model: torch.nn.Module, optimizer: Any, rest: dict) -> None:
    """The rest of a commit (tensors already where they belong) into ``model`` and
    ``optimizer``: buffers and unsharded parameters copied in place, the optimizer's
    other state and its hyperparameters taken."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for fqn, v in rest.get("params", {}).items():
            params[fqn].copy_(v)
        for fqn, v in rest.get("buffers", {}).items():
            buffers[fqn].copy_(v)
    if optimizer is None:
        return
    for fqn, kept in rest.get("state", {}).items():
        state = optimizer.state[params[fqn]]
        for k, v in kept.items():
            state[k] = v.clone() if isinstance(v, torch.Tensor) else v
    groups = rest.get("groups", [])
    if not groups:
        return
    names = _names(model)
    now = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if now != [g["params"] for g in groups]:
        raise ValueError("ShardedState: the optimizer's parameter groups differ from the "
                         "committed ones (the optimizer factory must group the same "
                         "parameters in the same order)")
    for group, kept in zip(optimizer.param_groups, groups, strict=True):
        for k, v in kept.items():
            if k != "params":
                group[k] = v


class _On:
    """A tensor on its way between ranks: its bytes on the CPU and the kind of device it
    lives on (a CUDA tensor lands on the receiving rank's own device)."""

    __slots__ = ("kind", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.kind = t.device.type
        self.t = t.detach().to("cpu", copy=True)

    def __reduce__(self):
        return _on, (self.t, self.kind)


def _on(t: torch.Tensor, kind: str) -> _On:
    o = _On.__new__(_On)
    o.t, o.kind = t, kind
    return o


def portable(value: Any) -> Any:
    """``value`` with each tensor as CPU bytes plus its device kind (to pickle)."""
    from daskdist.core.nest import map_instances

    return map_instances(_On, value, torch.Tensor)


def placed(value: Any, device: torch.device) -> Any:
    """A :func:`portable` value with its tensors back: CPU ones on the CPU, the others
    on ``device`` (this rank's)."""
    from daskdist.core.nest import map_instances

    return map_instances(lambda o: o.t if o.kind == "cpu" else o.t.to(device), value, _On)
