"""The tail rule of ``"dynamic"`` leases (pure): how leases shrink and who waits near the
end of an epoch, so every reader has rows to the end instead of one holding a whole unit
while the others idle.

- **Cap**: a lease ends at a unit's end (a unit is read by one worker) unless that would
  more than double it past its share of what is left (``free * weight / 2``); then it
  ends inside the unit, so near the end leases shrink toward the two batches a loader
  asks for at least (a shuffled dataset's units alike: the rest of a unit cut short is
  served once the seeded order is walked). A collection's partitions are never split
  (a partition read in part is computed whole): no cap.
- **Hold-back**: a reader already holding its share of the rows not yet acknowledged
  (``(free + leased) * weight``: leases it asked ahead) gets none while it holds a
  lease's worth or the pool is low; the rows go to the readers holding less. A reader's
  ``weight`` is its share of the readers' consumption (rows a second, as each loader
  measures it; ``1 / readers`` until it has), so a reader three times slower holds a
  third as many rows and every reader runs out at about the same time: a slow worker
  does not keep the epoch's last rows while the others idle. For whole partitions,
  once fewer than two are free per reader (by the mean partition), a reader holding
  two it has not read yet (the one it reads, one computed ahead) waits too; partitions
  it read wait only for their closure's acknowledgement, never for it, so a reader
  with nothing left to read is never held back by this rule (its pass would end with
  the epoch's last partitions left to no one).

Imports nothing from Dask, torch, pyarrow or the rest of the package.
"""

from __future__ import annotations

from daskdist.core.intervals import RowSet
from daskdist.core.leases.units import Units

__all__ = ["TailRule"]


class TailRule:
    """The two decisions of the tail rule (see the module doc); stateless."""

    @staticmethod
    def cap(whole: bool, need: int, share: int) -> int | None:
        """The most rows a lease may take past a unit's end (``None``: no cap)."""
        return None if whole else 2 * max(need, share)

    @staticmethod
    def holds_back(units: Units, whole: bool, held: RowSet | None, n_leased: int,
                   parts: int, need: int, n_free: int, weight: float | None = None,
                   ahead: RowSet | None = None) -> bool:
        """Whether a reader holding ``held`` waits now (``parts`` readers, ``n_free``
        rows free, ``n_leased`` leased to anyone, a lease of ``need`` asked; ``weight``:
        the reader's share of the readers' consumption, ``1 / parts`` if not given;
        ``ahead``: the rows of ``held`` it has not read yet, what the rule for whole
        partitions counts)."""
        if held is None:
            return False
        pending = n_free + n_leased
        over = (held.size * parts >= pending if weight is None
                else held.size >= pending * weight)
        if over and (
                held.size >= need or n_free < parts * need):
            return True
        if not whole or not ahead or units.units_in(n_free) >= 2 * parts:
            return False  # nothing to read, or two partitions or more free per reader
        return units.unit_of(ahead.stops[-1] - 1) > units.unit_of(ahead.starts[0])
