"""A commit's copy to a ring neighbour on the same host, as a shared mapping of the shard.

A ``ShardedState`` commit keeps each rank's shard twice: on the rank, and a copy on its
ring successor (``ring.py``, ``copies.py``), so a lost rank's shard is still held. When
the successor runs on the same host, the copy needs no bytes on the wire: the rank packs
its shard into host memory of its own (a ``memfd``, :meth:`SharedShards.empty`) and sends
only a :class:`Handle` to it (a few bytes); the successor maps that memory read-only
(:meth:`SharedShards.view`, through ``/proc/<pid>/fd``) and keeps the mapping as its
copy. A mapping holds the pages as long as it lives: when the rank dies, its shard
stays readable to the successor, and it is freed with the last mapping, never left
behind (no file names: nothing to clean up after a crash).

It is safe because both sides let go of a commit's buffer at the same agreed point:
the rank packs a new commit only into a buffer whose commit every rank has replaced
(the commit after it was promoted everywhere: the State's early confirmation or the
commit's own allgather), which is also when the successor drops its view of it.

Whether a pair of ranks can map each other's memory (same host, same PID namespace,
``/proc`` readable, enabled by ``collective.shard-shared-memory``) is agreed once per
generation: :meth:`SharedShards.offer` goes into ``sync()``'s allgather, the successor
maps its predecessor's probe (a page holding a random number) and checks the number,
and :meth:`SharedShards.agree` gathers who could. Pairs that cannot use the wire
(``wire.py``). CUDA groups use the wire (their copies are pinned buffers).
Owned by the thread that trains (the State's).
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from daskdist import config
from daskdist.collective.group import Group
from daskdist.core.resharding import predecessors


class Offer(NamedTuple):
    """What a rank tells the others at ``sync()``: whether it can share its memory, and
    its probe (its pid, the probe's descriptor and inode, the random number in it)."""

    can: int
    pid: int
    fd: int
    inode: int
    nonce: int

    LEN = 5

    def encode(self) -> list[int]:
        return [int(v) for v in self]

    @classmethod
    def decode(cls, ints: list[int]) -> Offer:
        return cls(*(int(v) for v in ints[:cls.LEN]))


_NONE = Offer(0, 0, 0, 0, 0)


@dataclass(frozen=True)
class Handle:
    """Where a rank's packed shard is: its memory's file descriptor and inode in the
    rank's process, and the shard's bytes in it. Travels as ``LEN`` int64s."""

    fd: int
    inode: int
    offset: int
    nbytes: int

    LEN = 4

    def ints(self) -> list[int]:
        """As ``LEN`` ints (``Handle(*ints)`` is it again)."""
        return [self.fd, self.inode, self.offset, self.nbytes]

    def encode(self) -> torch.Tensor:
        """As bytes on the wire (a uint8 tensor)."""
        return torch.tensor(self.ints(), dtype=torch.int64).view(torch.uint8)

    @classmethod
    def decode(cls, raw: torch.Tensor) -> Handle:
        return cls(*(int(v) for v in raw.view(torch.int64).tolist()))

    @classmethod
    def wire_bytes(cls) -> int:
        return cls.LEN * 8


class _Memory:
    """One ``memfd`` mapped read-write in the process that made it; its descriptor is
    open as long as the mapping lives (the successor opens it by that number). The
    mapping is twice the memory, so the memory grows in place (a group down to half
    its ranks) without a new mapping, whose pages would all fault in again.
    ``fd``: a descriptor of an existing memory to map anew (taken over)."""

    def __init__(self, nbytes: int, fd: int | None = None):
        self.fd = os.memfd_create("daskdist-shard", os.MFD_CLOEXEC) if fd is None else fd
        try:
            os.ftruncate(self.fd, 2 * max(nbytes, 1))
            self.map = mmap.mmap(self.fd, 2 * max(nbytes, 1))
            os.ftruncate(self.fd, max(nbytes, 1))  # bytes past it are never touched
        except BaseException:
            os.close(self.fd)
            raise
        self.inode = os.fstat(self.fd).st_ino
        weakref.finalize(self.map, os.close, self.fd)

    def tensor(self, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(self.map, dtype=torch.uint8)[:nbytes]


class SharedShards:
    """This process's shared shard memory and its views of its predecessors' (see the
    module). One per process (:data:`SHARED`); the training thread uses it."""

    def __init__(self) -> None:
        # storage address -> its memory's (fd, inode, mapped bytes); drops with the mapping
        self._own: dict[int, tuple[int, int, int]] = {}
        self._views: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._view_ptrs: dict[int, int] = {}  # a view's storage address -> its bytes
        self._probe: tuple[int, _Memory, int] | None = None  # (pid, memory, nonce)

    # -- this rank's memory ----------------------------------------------------------
    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of shared memory (zero-filled) as a uint8 tensor to pack into."""
        return self._register(_Memory(nbytes), nbytes)

    def resized(self, t: torch.Tensor | None, nbytes: int) -> torch.Tensor:
        """``nbytes`` of shared memory reusing ``t``'s (a free buffer of :meth:`empty`:
        its pages are already there, a fresh memory's are made on first touch, about a
        millisecond a MB); a new memory when ``t`` is none of ours."""
        if not self.owns(t):
            return self.empty(nbytes)
        fd, _, mapped = self._own[t.untyped_storage().data_ptr()]
        if nbytes <= mapped:
            os.ftruncate(fd, max(nbytes, 1))  # its tail freed (never touched again)
            return t.as_strided((nbytes,), (1,), 0)
        return self._register(_Memory(nbytes, fd=os.dup(fd)), nbytes)

    def _register(self, mem: _Memory, nbytes: int) -> torch.Tensor:
        t = mem.tensor(nbytes)
        ptr = t.untyped_storage().data_ptr()
        self._own[ptr] = (mem.fd, mem.inode, len(mem.map))
        weakref.finalize(mem.map, self._own.pop, ptr, None)
        return t

    def owns(self, t: torch.Tensor | None) -> bool:
        """Whether ``t`` lies in memory made by :meth:`empty`."""
        return t is not None and not t.is_cuda and t.untyped_storage().data_ptr() in self._own

    def handle(self, t: torch.Tensor) -> Handle:
        """Where ``t`` (in memory of :meth:`empty`) is, for the successor to map."""
        fd, inode, _ = self._own[t.untyped_storage().data_ptr()]
        return Handle(fd, inode, t.storage_offset(), t.numel())

    # -- the predecessor's memory ----------------------------------------------------
    def view(self, pid: int, h: Handle) -> torch.Tensor:
        """Process ``pid``'s shard at ``h``, mapped read-only (one mapping per memory,
        reused while any view of it lives)."""
        key = (pid, h.inode)
        base = self._views.get(key)
        if base is None or h.offset + h.nbytes > len(base):  # new, or grown since
            base = self._map(pid, h.fd, h.inode)
            self._views[key] = base
        if h.offset + h.nbytes > len(base):
            raise ValueError(f"shard handle {h} outside process {pid}'s memory "
                             f"({len(base)} bytes)")
        with warnings.catch_warnings():  # read-only by design: nothing writes a copy
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(base, dtype=torch.uint8)
        return t[h.offset:h.offset + h.nbytes]

    def is_view(self, t: torch.Tensor | None) -> bool:
        """Whether ``t`` lies in a predecessor's memory (never to be written)."""
        return t is not None and not t.is_cuda and \
            t.untyped_storage().data_ptr() in self._view_ptrs

    def _map(self, pid: int, fd: int, inode: int) -> mmap.mmap:
        path = f"/proc/{pid}/fd/{fd}"
        mine = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(mine)
            if st.st_ino != inode:
                raise OSError(f"{path} is inode {st.st_ino}, not the shard's {inode}")
            m = mmap.mmap(mine, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(mine)  # the mapping keeps the memory
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ptr = torch.frombuffer(m, dtype=torch.uint8).untyped_storage().data_ptr()
        self._view_ptrs[ptr] = st.st_size
        weakref.finalize(m, self._view_ptrs.pop, ptr, None)
        return m

    # -- agreeing per generation -----------------------------------------------------
    def offer(self, g: Group) -> Offer:
        """What this rank tells the others at ``sync()``: whether it can share, and its
        probe."""
        if not (config.get("collective.shard-shared-memory", True)
                and g.device.type == "cpu" and hasattr(os, "memfd_create")):
            return _NONE
        pid = os.getpid()
        if self._probe is None or self._probe[0] != pid:  # a forked process makes its own
            mem, nonce = _Memory(8), secrets.randbits(62)
            mem.map[:8] = nonce.to_bytes(8, "little")
            self._probe = (pid, mem, nonce)
        _, mem, nonce = self._probe
        return Offer(1, pid, mem.fd, mem.inode, nonce)

    def agree(self, g: Group, order: tuple[int, ...], offers: list[Offer],
              hosts: list[int]) -> frozenset[int]:
        """The ranks whose copy goes to their successor in ``order`` as a mapping (the
        successor mapped the rank's probe and read its number); every rank gets the
        same set. ``offers[r]``: rank r's :meth:`offer`; ``hosts[r]``: its host key."""
        pred = predecessors(order)
        candidates = {r for r in range(g.world_size) if pred[r] != r
                      and offers[r].can and offers[pred[r]].can
                      and hosts[r] == hosts[pred[r]]}
        if not candidates:
            return frozenset()
        me = g.rank
        ok = 0
        if me in candidates:
            probe = offers[pred[me]]
            try:
                m = self._map(probe.pid, probe.fd, probe.inode)
                ok = int(int.from_bytes(m[:8], "little") == probe.nonce)
                del m
            except (OSError, ValueError):
                ok = 0
        flags = g.allgather(torch.tensor([ok], dtype=torch.int64, device=g.wire_device))
        return frozenset(pred[r] for r, f in enumerate(flags) if int(f.item()))


SHARED = SharedShards()
