"""Small ints that ride a step's gradient allreduce: an allgather at no extra call.

A synchronous step already pays one collective, the gradient allreduce
(:func:`~daskdist.collective.replicas.allreduce_gradients`). What every rank must see of
every rank before the next step (``synced``'s "I have the next batch", a
:class:`~daskdist.collective.state.elastic.State`'s commit head) rides in it instead of a
call of its own: each rank writes its ints into its own slots of a segment appended to
the first gradient bucket, zeros elsewhere, so the sum is every rank's ints (an
allgather). Each int64 is cut into chunks small enough for the bucket's float dtype to
hold exactly.

The closure's :class:`~daskdist.collective.step.step.Step` holds the riders registered
for its next gradient allreduce and hands them, in key order, to one call
(:class:`Riding`). Every rank registers the same riders at the same point of the same
code, so the segment has the same layout on every rank; outside a closure nothing rides
and each caller makes its own call.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

__all__ = ["Rider", "Riding"]


class Rider(Protocol):
    """Ints one rank sends in the next gradient allreduce, and what it does with them."""

    key: str  # the order of riders in the segment (the same on every rank)

    def ints(self) -> list[int]:
        """This rank's ints: as many on every rank (asked just before the call)."""
        ...

    def arrived(self, table: list[list[int]], generation: int) -> None:
        """Every rank's ints, in rank order, from the call on group ``generation``."""
        ...

    def failed(self) -> None:
        """The call failed: nothing arrived (its error is raised to the caller)."""
        ...


class Riding:
    """The riders of one call: their ints encoded into a segment of the call's buffer,
    and the summed segment decoded back into every rank's ints."""

    def __init__(self, riders: list[Rider], generation: int) -> None:
        self.riders = riders
        self.generation = generation
        self.widths: list[int] = []
        self.row: list[int] = []

    def encode(self, rank: int, world: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """The segment to append: this rank's ints in its slots, every other slot zero."""
        try:
            for r in self.riders:
                ints = [int(v) for v in r.ints()]
                self.widths.append(len(ints))
                self.row += ints
        except BaseException:
            self.failed()
            raise
        bits = _chunk_bits(dtype)
        n = math.ceil(64 / bits)
        width = len(self.row) * n
        segment = np.zeros(world * width, dtype=np.float64)
        segment[rank * width:(rank + 1) * width] = _chunks(self.row, bits, n)
        return torch.from_numpy(segment).to(dtype=dtype, device=device)

    def decode(self, segment: torch.Tensor, world: int) -> None:
        """The summed segment back into every rank's ints, handed to each rider."""
        bits = _chunk_bits(segment.dtype)
        n = math.ceil(64 / bits)
        parts = np.rint(segment.detach().to(torch.float64).cpu().numpy()).astype(np.int64)
        shifts = np.arange(n, dtype=np.int64) * bits
        table = (parts.reshape(-1, n) << shifts).sum(axis=1).reshape(world, -1).tolist()
        at = 0
        for r, w in zip(self.riders, self.widths, strict=True):
            r.arrived([row[at:at + w] for row in table], self.generation)
            at += w

    def failed(self) -> None:
        for r in self.riders:
            r.failed()


def _chunk_bits(dtype: torch.dtype) -> int:
    """Bits of an int64 per chunk so that a chunk is an exact integer in ``dtype``."""
    mantissa = round(-math.log2(torch.finfo(dtype).eps))  # stored bits: 23 for float32
    return min(32, mantissa)


def _chunks(values: list[int], bits: int, n: int) -> list[int]:
    """Each int64 as ``n`` chunks of ``bits`` bits, lowest first (the last one signed)."""
    mask = (1 << bits) - 1
    top = (n - 1) * bits
    out: list[int] = []
    for v in values:
        out += [(v >> (i * bits)) & mask for i in range(n - 1)]
        out.append(v >> top)
    return out
