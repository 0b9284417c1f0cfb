"""The loader's device stage: whole blocks to the device through reused pinned buffers.

For a CUDA device, each converted block (a :class:`~daskdist.data.convert.Chunk`) is
*staged* in a staging thread: its tensor columns are copied into one slot of a small
ring (:class:`StagingRing`) of reused host buffers, pinned, **one buffer per dtype**
(segments back to back, each aligned to 128 bytes; the 1-D columns of a dtype are the
rows of one ``[columns, rows]`` segment, so a batch's views of all of them come from
one slice and one ``unbind``, as on the CPU's shuffle path), then each dtype's buffer
goes to the device with **one** asynchronous host-to-device copy on a side stream, and
a CUDA event is recorded after them. The block's columns become views of those device tensors, so
batches cut from it are views too. Strings and other list columns stay on the host.

Overlap: a block is staged (copied into its slot, its copies queued) in a staging thread
while the prefetch thread decodes the next block (:meth:`DeviceStage.stage_all`; the
block goes on pending at once and a consumer waits for its staging, never for the next
block's read: :meth:`DeviceStage.resolve`), and
the copy runs on the side stream while the next block is written into the next slot.
A slot is written again only after the event of the copy out of it has completed
(:meth:`Fence.synchronize`): that wait ends when the copy does.

Consumers (:meth:`DeviceStage.ready`, in the caller's thread, once per block and
stream): the caller's current stream waits for the block's event (a GPU-side wait, no
CPU block) and the device tensors are recorded as used on that stream, so the caching
allocator does not reuse their memory while work queued there may still read it.

Memory bound, in bytes (``daskdist.data.staging-bytes``, default 256 MiB): a block
whose tensors take more than ``staging-bytes / slots`` is staged in row pieces that
each fit (at least one row a piece), so pinned host memory is at most
``staging-bytes`` (plus 128 bytes of alignment per dtype segment; a single row larger
than a slot's share is staged alone), whatever the rows hold (a loader's block is sized
in rows, a lease or a shuffle buffer: 65,536 image rows are ~10 GB). Each slot keeps
its buffers, grown to the largest piece it
held. Device memory holds the pieces not yet dropped: those queued for consumers (about
``prefetch`` batches plus one piece), the one being cut, and the one being staged, plus
whatever batches the user keeps. Host memory beyond the ring: the block being decoded
and the one being staged (the CPU loader's own, plus one block).

Threads: a :class:`StagingRing` is owned by the one staging thread of
:meth:`DeviceStage.stage_all` (one block at a time, in order); :meth:`DeviceStage.ready`
may run in several consumer threads at once.

The copying back end is a :class:`Transfer`: :class:`CudaTransfer` on a GPU; tests use
a stand-in whose "copies" run late, to check that no slot is reused too early.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from daskdist.data.convert import Chunk

__all__ = [
    "CudaTransfer",
    "DeviceStage",
    "Fence",
    "Layout",
    "StagingRing",
    "Transfer",
    "piece_rows",
    "plan_layout",
]

_ALIGN_BYTES = 128


class Fence(Protocol):
    """The completion of a block's copies (a ``torch.cuda.Event`` on a GPU)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Transfer(Protocol):
    """How staged host buffers reach the device."""

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host buffer (pinned on CUDA)."""
        ...

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        """Queue an asynchronous copy of ``host`` to a new device tensor."""
        ...

    def record(self) -> Fence:
        """A fence that completes when every copy queued so far has."""
        ...

    def wait(self, staged: StagedBlock) -> None:
        """Make the caller's current stream wait for ``staged``'s copies."""
        ...


@dataclass(frozen=True)
class Place:
    """Where one tensor of a block lies in its dtype's buffer."""

    dtype: torch.dtype
    offset: int  # elements
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Layout:
    """A block's tensors laid out in one buffer per dtype."""

    stacks: list[Place]  # one per Chunk.stacks entry ([columns, rows] matrices)
    groups: list[tuple[tuple[str, ...], Place]]  # 1-D rest columns of one dtype, stacked
    rest: dict[str, Place]  # the other tensor columns, by name
    sizes: dict[torch.dtype, int]  # elements each dtype's buffer needs


def _align(n: int, dtype: torch.dtype) -> int:
    step = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-n // step) * step


def plan_layout(chunk: Chunk) -> Layout:
    """Offsets of the chunk's tensors in one buffer per dtype (pure bookkeeping)."""
    sizes: dict[torch.dtype, int] = {}

    def place(dtype: torch.dtype, shape: tuple[int, ...]) -> Place:
        off = _align(sizes.get(dtype, 0), dtype)
        p = Place(dtype, off, tuple(shape))
        sizes[dtype] = off + p.numel
        return p

    stacks = [place(m.dtype, tuple(m.shape)) for _keys, m in chunk.stacks]
    by_dtype: dict[torch.dtype, list[str]] = {}
    for k, v in chunk.rest.items():
        if isinstance(v, torch.Tensor) and v.dim() == 1:
            by_dtype.setdefault(v.dtype, []).append(k)
    groups = [(tuple(keys), place(dt, (len(keys), chunk.rows)))
              for dt, keys in by_dtype.items() if len(keys) > 1]
    grouped = {k for keys, _p in groups for k in keys}
    rest = {k: place(v.dtype, tuple(v.shape)) for k, v in chunk.rest.items()
            if isinstance(v, torch.Tensor) and k not in grouped}
    return Layout(stacks, groups, rest, sizes)


def tensor_bytes(chunk: Chunk) -> int:
    """Bytes of the chunk's tensors (what staging copies; lists stay on the host)."""
    tensors = [m for _keys, m in chunk.stacks]
    tensors += [v for v in chunk.rest.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def piece_rows(chunk: Chunk, limit: int) -> int:
    """Rows a staged piece of ``chunk`` may hold for its tensors to take at most
    ``limit`` bytes (at least 1; every row when the whole chunk fits)."""
    total = tensor_bytes(chunk)
    if chunk.rows <= 1 or total <= limit:
        return max(1, chunk.rows)
    return max(1, int(limit // -(-total // chunk.rows)))


def _rows_of(chunk: Chunk, a: int, b: int) -> Chunk:
    """Rows ``[a, b)`` of ``chunk`` as a chunk of views (stacks stay ``[columns, rows]``)."""
    rest = {k: v[a:b] for k, v in chunk.rest.items()}
    stacks = [(keys, m[:, a:b]) for keys, m in chunk.stacks]
    return Chunk(chunk.names, rest, stacks, b - a)


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` on the host, single-threaded with the GIL released.

    NumPy's copy, not ``Tensor.copy_``: torch would open an OpenMP team per copy, and
    teams from the staging, builder and consumer threads at once oversubscribe the
    cores (measured: a staged pipeline 3-30x slower on a loaded 2-core machine). A
    memory-bound copy gains nothing from more threads anyway.
    """
    try:
        np.copyto(dst.numpy(), src.numpy(), casting="no")
    except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16, ...)
        dst.copy_(src)


@dataclass
class StagedBlock:
    """A block's device tensors and the fence of the copies that fill them."""

    fence: Any
    bases: list[torch.Tensor]
    streams: set = field(default_factory=set)  # streams that already waited (Transfer's)


@dataclass
class _Slot:
    host: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    fence: Any = None  # the last copy out of this slot


class StagingRing:
    """``slots`` reused host staging slots, used in turn (see the module doc)."""

    def __init__(self, transfer: Transfer, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"staging slots must be >= 1, got {slots}")
        self.transfer = transfer
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self.reuse_waits = 0  # times a slot's previous copy had not completed yet

    @property
    def host_bytes(self) -> int:
        """Host staging memory held now (the bound's left side)."""
        return sum(b.numel() * b.element_size() for s in self._slots for b in s.host.values())

    def stage(self, chunk: Chunk) -> tuple[Chunk, StagedBlock]:
        """``chunk`` with its tensors as views of device tensors, and their fence."""
        layout = plan_layout(chunk)
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.fence is not None:
            if not slot.fence.query():
                self.reuse_waits += 1
                slot.fence.synchronize()  # the copy out of this slot must be done
            slot.fence = None
        for dtype, n in layout.sizes.items():
            buf = slot.host.get(dtype)
            if buf is None or buf.numel() < n:
                slot.host.pop(dtype, None)  # drop the old buffer before the new one
                slot.host[dtype] = self.transfer.host_buffer(n, dtype)
        for (_keys, m), p in zip(chunk.stacks, layout.stacks, strict=True):
            _host_copy(self._view(slot.host[p.dtype], p), m)
        for keys, p in layout.groups:
            rows = self._view(slot.host[p.dtype], p)
            for j, k in enumerate(keys):
                _host_copy(rows[j], chunk.rest[k])
        for k, p in layout.rest.items():
            _host_copy(self._view(slot.host[p.dtype], p), chunk.rest[k])
        dev = {dt: self.transfer.copy(slot.host[dt][:n]) for dt, n in layout.sizes.items()}
        fence = self.transfer.record()
        slot.fence = fence
        stacks = [(keys, self._view(dev[p.dtype], p))
                  for (keys, _m), p in zip(chunk.stacks, layout.stacks, strict=True)]
        stacks += [(keys, self._view(dev[p.dtype], p)) for keys, p in layout.groups]
        grouped = {k for keys, _p in layout.groups for k in keys}
        rest = {k: self._view(dev[layout.rest[k].dtype], layout.rest[k]) if k in layout.rest
                else v for k, v in chunk.rest.items() if k not in grouped}
        return Chunk(chunk.names, rest, stacks, chunk.rows), StagedBlock(fence, list(dev.values()))

    @staticmethod
    def _view(buf: torch.Tensor, p: Place) -> torch.Tensor:
        return buf[p.offset:p.offset + p.numel].view(p.shape)


class CudaTransfer:
    """Pinned host buffers, copies on a side stream of ``device``, CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        # Allocated on the side stream: the allocator ties the memory to it, so the copy
        # needs no wait on the consumers' stream (consumers record their use in wait()).
        with torch.cuda.stream(self.stream):
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
        return dev

    def record(self) -> Fence:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, staged: StagedBlock) -> None:
        cur = torch.cuda.current_stream(self.device)
        key = cur.cuda_stream
        if key in staged.streams:
            return
        cur.wait_event(staged.fence)
        if key != self.stream.cuda_stream:
            for t in staged.bases:
                t.record_stream(cur)
        staged.streams.add(key)  # after the wait is queued: later work on cur is ordered


class DeviceStage:
    """The step after batching: stage blocks (producer side), ready batches (consumer).

    ``max_bytes`` bounds the ring's pinned memory (``None``: no bound, a slot grows to
    the largest block): blocks above ``max_bytes / slots`` are staged in row pieces."""

    def __init__(self, transfer: Transfer, slots: int = 2,
                 max_bytes: int | None = None) -> None:
        self.ring = StagingRing(transfer, slots)
        self.transfer = transfer
        self.limit = None if max_bytes is None else max(1, int(max_bytes) // max(1, slots))

    def pieces(self, item: Any) -> list[Any]:
        """``item`` cut by rows so that each piece's tensors fit a slot's share of the
        bound (the row ids cut alike); itself when it fits."""
        cols = item.cols
        if self.limit is None or not isinstance(cols, Chunk):
            return [item]
        step = piece_rows(cols, self.limit)
        if step >= cols.rows:
            return [item]
        return [item._replace(cols=_rows_of(cols, a, min(a + step, cols.rows)),
                              ids=None if item.ids is None else item.ids[a:a + step],
                              rows=min(a + step, cols.rows) - a)
                for a in range(0, cols.rows, step)]

    def stage(self, item: Any) -> Any:
        """A ``ChunkItem`` whose ``Chunk`` lives on the device (others pass through)."""
        if not isinstance(item.cols, Chunk):
            return item
        cols, staged = self.ring.stage(item.cols)
        return item._replace(cols=cols, staged=staged)

    def stage_all(self, items: Iterator[Any]) -> Iterator[Any]:
        """Stage ``items`` in order in a thread of its own (which owns the ring) while the
        caller's generator decodes the next block, handing each block on at once as a
        *pending* item (``staged`` holds the staging's future) that a consumer turns
        into the staged block with :meth:`resolve`.

        A block is never held back until the next one is read: from a lazy frame or a
        lease that read can take long (the next partition still computing), and the
        block's rows would wait for it (they did: one block behind, before). At the end
        of ``items``, or when it raises, every block handed on is staged before the
        generator returns (or raises: its consumers get those rows, then the error);
        when it is closed, the blocks not yet staged are dropped (their consumers see
        the loader closed) and the one being staged is finished first."""
        pool = ThreadPoolExecutor(1, "daskdist-stage")
        closed = False
        try:
            for whole in items:
                for item in self.pieces(whole):
                    yield item._replace(staged=pool.submit(self.stage, item))
        except GeneratorExit:
            closed = True
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=closed)
            if isinstance(items, Generator):
                items.close()

    @staticmethod
    def resolve(item: Any) -> Any:
        """The staged block of a pending item of :meth:`stage_all` (an item that is not
        pending as it is), or ``None`` if its staging was dropped by a close. Waits for
        the staging (the host copy into a slot and the copies queued): that wait ends
        when the staging thread gets to it, or at once once the stage was closed."""
        fut = item.staged
        if not isinstance(fut, Future):
            return item
        try:
            return fut.result()
        except CancelledError:
            return None

    def ready(self, items: list[Any]) -> None:
        """Before a batch cut from ``items`` is used on the caller's current stream."""
        for it in items:
            if it.staged is not None:
                self.transfer.wait(it.staged)
