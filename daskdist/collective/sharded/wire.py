"""Moving shard bytes between ranks: a commit's copy to its ring successor, and the rows a
re-formed group reshards from the copies its ranks hold.

A :class:`Run` is a run of bytes read or written as one (pieces of tensors at offsets
within it: a shard's flat buffer, rows of several tensors, or a tensor's local shard).
:func:`transfer` sends each rank's runs to their destinations through the group
(``Group.all_to_all_single``: a lost peer ends it with ``CollectiveError``), in rounds of
at most ``chunk`` bytes per pair of ranks so the buffers on the wire stay bounded;
a rank's runs to itself are copied locally. Every rank must call it with the same
number of rounds (each computes it from the same global plan). :func:`gather_whole`
gathers every rank's shards whole on every rank (``ShardedState.full_state_dict``);
:func:`copy_run` and :func:`landing_run` say which bytes of held copies a reshard sends
and where they land.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from daskdist.collective.group import Group
from daskdist.collective.sharded.copies import ShardCopy
from daskdist.collective.sharded.layout import Live, placed_at, sizes
from daskdist.core.resharding import rounds as rounds_of
from daskdist.core.resharding import span


class Run:
    """``nbytes`` bytes made of ``parts``: ``(offset, uint8 tensor)``, in order, not
    overlapping (bytes between parts are padding: read as whatever, written nowhere)."""

    def __init__(self, nbytes: int, parts: list[tuple[int, torch.Tensor]] | None = None):
        self.nbytes = int(nbytes)
        self.parts: list[tuple[int, torch.Tensor]] = parts or []

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> Run:
        """The tensors' bytes one after the other."""
        parts, at = [], 0
        for t in tensors:
            parts.append((at, t))
            at += t.numel()
        return cls(at, parts)

    def _cut(self, lo: int, hi: int):
        for off, t in self.parts:
            a, b = max(lo, off), min(hi, off + t.numel())
            if a < b:
                yield t[a - off:b - off], a - lo
            if off >= hi:
                break

    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Bytes ``[lo, hi)`` into ``out`` (``hi - lo`` bytes)."""
        for piece, at in self._cut(lo, hi):
            out[at:at + piece.numel()].copy_(piece, non_blocking=True)

    def write(self, lo: int, hi: int, src: torch.Tensor) -> None:
        """``src`` (``hi - lo`` bytes) into bytes ``[lo, hi)``."""
        for piece, at in self._cut(lo, hi):
            piece.copy_(src[at:at + piece.numel()], non_blocking=True)

    def whole(self, lo: int, hi: int, device: torch.device) -> torch.Tensor | None:
        """Bytes ``[lo, hi)`` as one tensor of the run on ``device`` (to receive into
        directly), or ``None`` when they span parts or padding."""
        for off, t in self.parts:
            if off <= lo and hi <= off + t.numel() and t.device == device:
                return t[lo - off:hi - off]
        return None


def pair_rounds(sizes: Mapping[tuple[int, int], int], chunk: int) -> int:
    """Rounds that carry every pair's bytes (``sizes``: (src, dst) -> bytes; pairs of a
    rank with itself travel no wire), 0 when nothing crosses the wire."""
    wire = [n for (s, d), n in sizes.items() if s != d and n > 0]
    return max((rounds_of(n, chunk) for n in wire), default=0)


def transfer(g: Group, sends: Mapping[int, Run], recvs: Mapping[int, Run], rounds: int,
             chunk: int, scratch: dict[str, torch.Tensor] | None = None) -> Any:
    """Send ``sends[dst]`` to each rank ``dst`` and receive ``recvs[src]`` from each rank
    ``src`` (sizes agree pairwise), ``chunk`` bytes per pair and round, in ``rounds``
    rounds. ``scratch`` keeps the wire buffers between calls (a commit reuses them).
    Copies from or to CUDA are queued on the current stream: returns the CUDA event to
    wait for before host bytes received are read (``None`` on the CPU)."""
    me = g.rank
    if me in sends:  # to itself: a copy, no wire
        _local(sends[me], recvs[me])
    dev = g.wire_device
    if rounds:
        _rounds(g, sends, recvs, rounds, chunk, {} if scratch is None else scratch, dev)
    if dev.type != "cuda" and not any(t.is_cuda for r in recvs.values() for _, t in r.parts):
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def _rounds(g: Group, sends: Mapping[int, Run], recvs: Mapping[int, Run], rounds: int,
            chunk: int, scratch: dict, dev: torch.device) -> None:
    me, world = g.rank, g.world_size
    for k in range(rounds):
        lo, hi = k * chunk, (k + 1) * chunk
        out_sizes = [0 if s == me or s not in recvs else _clip(recvs[s].nbytes, lo, hi)
                     for s in range(world)]
        in_sizes = [0 if d == me or d not in sends else _clip(sends[d].nbytes, lo, hi)
                    for d in range(world)]
        inp = _buffer(scratch, "in", sum(in_sizes), dev)
        at = 0
        for d in range(world):
            if in_sizes[d]:
                sends[d].read(lo, lo + in_sizes[d], inp[at:at + in_sizes[d]])
                at += in_sizes[d]
        sources = [s for s in range(world) if out_sizes[s]]
        direct = None
        if len(sources) == 1:
            s = sources[0]
            direct = recvs[s].whole(lo, lo + out_sizes[s], dev)
        out = direct if direct is not None else _buffer(scratch, "out", sum(out_sizes), dev)
        g.all_to_all_single(out, inp, out_sizes, in_sizes)
        if direct is None:
            at = 0
            for s in range(world):
                if out_sizes[s]:
                    recvs[s].write(lo, lo + out_sizes[s], out[at:at + out_sizes[s]])
                    at += out_sizes[s]


def _clip(n: int, lo: int, hi: int) -> int:
    return max(0, min(n, hi) - lo)


def _local(src: Run, dst: Run) -> None:
    """``src`` copied into ``dst`` (the same rank), part by part."""
    for off, t in src.parts:
        dst.write(off, off + t.numel(), t)


def _buffer(scratch: dict[str, Any], name: str, n: int, device: torch.device) -> torch.Tensor:
    """``n`` wire bytes from the scratch buffer ``name`` (grown when too small)."""
    buf = scratch.get(name)
    if buf is None or buf.numel() < n or buf.device != device:
        buf = torch.empty(max(n, 1), dtype=torch.uint8, device=device)
        scratch[name] = buf
    return buf[:n]


def gather_whole(live: Live, g: Group, order: list[str]) -> dict[str, torch.Tensor]:
    """Every rank's ``live`` shards gathered whole, as CPU tensors on every rank (a
    collective), keyed as a state dict (``order`` first), optimizer states under
    ``optimizer.<parameter>.<name>``."""
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, e in enumerate(live.entries):
        by_dtype.setdefault(e.dtype, []).append(i)
    dev = g.wire_device
    for dtype, idx in by_dtype.items():
        padded = []
        for i in idx:
            e, t = live.entries[i], live.locals[i]
            c = -(-e.rows // g.world_size)
            rows = t.movedim(e.dim, 0)
            pad = torch.zeros((c - rows.shape[0],) + tuple(rows.shape[1:]), dtype=dtype,
                              device=rows.device)
            padded.append(torch.cat([rows, pad]).reshape(-1))
        flat = torch.cat(padded).to(dev) if padded else torch.empty(0, dtype=dtype)
        parts = [p.cpu() for p in g.allgather(flat.contiguous())]
        at = 0
        for i in idx:
            e = live.entries[i]
            c = -(-e.rows // g.world_size)
            other = tuple(s for j, s in enumerate(e.shape) if j != e.dim)
            n = c * (torch.Size(other).numel() if other else 1)
            pieces = []
            for r, part in enumerate(parts):
                a, b = span(e.rows, g.world_size, r)
                pieces.append(part[at:at + n].view((c,) + other)[:b - a])
            kind, name = e.key.split("|", 1)
            key = name if kind == "p" else "optimizer." + name.replace("|", ".")
            out[key] = torch.cat(pieces).movedim(0, e.dim).contiguous()
            at += n
    for name, t in {**live.rest["params"], **live.rest["buffers"]}.items():
        out[name] = t.detach().cpu().clone()
    return {k: out[k] for k in order if k in out} | {k: v for k, v in out.items()
                                                     if k not in order}


def copy_run(held: ShardCopy, entries: tuple, world: int, parts: list) -> Run:
    """The bytes of ``parts`` (pieces of held shards), read straight from the copies."""
    rows, rb = sizes(entries)
    out = []
    for p in parts:
        flat = held.flat(p.index)
        offs, _ = placed_at(entries, world, p.index)
        a = offs[p.entry] + (p.start - span(rows[p.entry], world, p.index)[0]) * rb[p.entry]
        out.append(flat[a:a + (p.stop - p.start) * rb[p.entry]])
    return Run.of(out)

def landing_run(entries: tuple, dst: list, g: Group, parts: list, moved: list) -> Run:
    """Where ``parts`` land: this rank's local shards (rows of a tensor split along
    a later dimension arrive in a buffer of their own, moved in afterwards)."""
    rows, rb = sizes(entries)
    out = []
    flat_of: dict[int, torch.Tensor] = {}
    for p in parts:
        e = entries[p.entry]
        t = flat_of.get(p.entry)
        if t is None:
            local = dst[p.entry]
            if e.dim == 0:
                t = local.reshape(-1).view(torch.uint8)
            else:
                tmp = torch.empty_like(local.movedim(e.dim, 0).contiguous())
                moved.append((local, tmp, e.dim))
                t = tmp.reshape(-1).view(torch.uint8)
            flat_of[p.entry] = t
        start = span(rows[p.entry], g.world_size, g.rank)[0]
        a = (p.start - start) * rb[p.entry]
        out.append(t[a:a + (p.stop - p.start) * rb[p.entry]])
    return Run.of(out)
