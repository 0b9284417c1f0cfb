"""Lengths learned and epochs resumed, on a :class:`~daskdist.core.leases.table.LeaseTable`
(pure): a computed partition's length, the lengths a ledger carries, and epochs started
or restored from a ledger's acknowledged rows.

Imports nothing from Dask, torch, pyarrow or the rest of the package.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from daskdist.core.intervals import RowSet, normalize, size_of, subtract
from daskdist.core.leases.epochs import Dataset

if TYPE_CHECKING:
    from daskdist.core.leases.table import LeaseTable

__all__ = ["learn_lengths", "restore_epoch", "set_length", "start_epoch"]


def set_length(table: LeaseTable, session: str, dataset_id: str, epoch: int, unit: int,
               length: int) -> str | None:
    """``session`` read ``unit`` and found ``length`` rows: they are no longer ahead of
    its loader in ``epoch`` (what the tail rule weighs, :mod:`.tail`).

    The first time, ids past its end go from every live epoch (from the free and
    deferred rows and from ``session``'s lease; rows of the tail leased to another
    session go when they come back) and from every epoch started later. A length that
    differs from the one learned (or defined) before fails ``epoch``: its message naming
    the unit is returned (``None`` when all is well). ``ValueError`` for a unit or length
    out of range."""
    ds = table.dataset(dataset_id)
    units = ds.defined
    unit, length, epoch = int(unit), int(length), int(epoch)
    if not 0 <= unit < units.units:
        raise ValueError(f"dataset {table.label_of(dataset_id)} has no partition {unit} "
                         f"(it has {units.units})")
    if length < 0:
        raise ValueError(f"partition {unit}: a length must be >= 0, got {length}")
    old = units.learn(unit, length)
    if old is not None:
        why = (f"partition {unit} of dataset {table.label_of(dataset_id)} has {length} rows "
               f"now and had {old} before: a recomputed partition must be the same "
               f"(partitions must be deterministic); epoch {epoch} cannot complete")
        ep = ds.epochs.get(epoch)
        if ep is not None and ep.failed is None:
            ep.failed = why
        return why
    ep = ds.epochs.get(epoch)
    if ep is not None and ep.ahead:
        a, b = units.bounds(unit)
        tail = units.tail(unit)
        ep.not_ahead(session, a, b if tail is None else tail[1])
    _learned(table, dataset_id, ds, unit, session)
    return None


def _learned(table: LeaseTable, dataset_id: str, ds: Dataset, unit: int,
             session: str | None) -> None:
    """``unit``'s length is known: its tail ids leave every live epoch's pools (and
    ``session``'s lease)."""
    units = ds.defined
    tail = units.tail(unit)
    if tail is None:
        return
    a, b = tail
    for ep_no, ep in list(ds.epochs.items()):
        held = ep.leased.get(session) if session is not None else None
        if session is not None and held is not None and held.intersect(a, b):
            ep.phantom_leased -= units.phantoms([(a, b)])
            ep.drop_rows(held, a, b)
            if not held:
                table.unlease(session, dataset_id, ep_no)
        for pool in (ep.free, ep.deferred):
            ep.drop_rows(pool, a, b)
        if ep.acked.size == ep.total:  # the last rows were ids that do not exist
            table.complete(dataset_id, ds, ep_no)


def learn_lengths(table: LeaseTable, dataset_id: str, runs: Iterable[Sequence[int]]) -> int:
    """Lengths a ledger carries (``LeaseTable.known_lengths`` of an earlier dataset over
    the same collection) become this collection's, as if computed here: a resumed epoch
    leases no id past them, so a partition whose rows were all acknowledged is never
    computed again. ``ValueError`` naming a partition whose length differs from the one
    learned here (nothing changes then), or for runs that do not fit. Costs O(runs +
    partitions of known length). Partitions newly learned."""
    ds = table.dataset(dataset_id)
    units = ds.defined
    runs = [(int(n), int(k)) for n, k in runs]
    if units.length_runs() is None:
        if runs:
            raise ValueError(f"dataset {table.label_of(dataset_id)} has lengths defined; "
                             "a ledger's learned lengths are for a collection of "
                             "partitions of unknown length")
        return 0
    if sum(k for _, k in runs) > units.units or any(
            k < 1 or not (n == -1 or units.fits(n)) for n, k in runs):
        raise ValueError(f"the ledger's partition lengths {runs[:4]}... do not fit "
                         f"dataset {table.label_of(dataset_id)}'s {units.units} partitions")
    todo = []
    u = 0
    for n, k in runs:
        if n >= 0:
            for unit in range(u, u + k):
                old = units.length_of(unit)
                if old >= 0 and old != n:
                    raise ValueError(
                        f"partition {unit} of dataset {table.label_of(dataset_id)} has "
                        f"{old} rows here and {n} in the ledger being restored "
                        "(partitions must be deterministic)")
                if old < 0:
                    todo.append((unit, n))
        u += k
    for unit, n in todo:
        units.learn(unit, n)
        _learned(table, dataset_id, ds, unit, None)
    return len(todo)


def start_epoch(table: LeaseTable, dataset_id: str, epoch: int,
                acknowledged: Iterable[Sequence[int]]) -> None:
    """Start ``epoch`` with ``acknowledged`` rows already acknowledged (resuming from an
    exported ledger); ``ValueError`` if the epoch has started already. Costs
    O(intervals), whatever the rows."""
    ds = table.dataset(dataset_id)
    epoch = int(epoch)
    acknowledged = normalize(acknowledged)
    if ds.defined.total == 0 and not acknowledged:
        return  # an empty dataset: every epoch is complete
    ep = ds.epochs.get(epoch)
    if ds.is_complete(epoch) or (ep is not None and (ep.acked or ep.n_leased)):
        raise ValueError(f"dataset {table.label_of(dataset_id)} epoch {epoch} has started "
                         "already; load a ledger before the epoch's first lease")
    if ep is not None:
        del ds.epochs[epoch]
    ep = ds.new_epoch(epoch, acknowledged, table.label_of(dataset_id), table.max_epochs)
    if ep.acked.size == ep.total:
        table.complete(dataset_id, ds, epoch)


def restore_epoch(table: LeaseTable, dataset_id: str, epoch: int,
                  acknowledged: Iterable[Sequence[int]]) -> int:
    """Make ``acknowledged`` the epoch's acknowledged rows, whatever was acknowledged
    before (an elastic State resumed from a checkpoint: rows acknowledged by commits
    after it were trained by a model that is lost, so they are free again). Leased and
    deferred rows stay as they are; ``ValueError`` if a leased row is among
    ``acknowledged`` (it could be delivered again). Rows now free that were acknowledged
    before."""
    ds = table.dataset(dataset_id)
    epoch = int(epoch)
    name = table.label_of(dataset_id)
    acked = ds.check_rows(normalize(acknowledged), name)
    if ds.is_complete(epoch):  # its table was dropped: every row was acknowledged
        ds.uncomplete(epoch)
        ep = ds.new_epoch(epoch, ds.defined.universe(), name, table.max_epochs)
    else:
        ep = ds.epochs.get(epoch) or ds.new_epoch(epoch, (), name, table.max_epochs)
    held = ds.held_rows(ep)
    clash = ds.clash(ep, acked)
    if clash:
        raise ValueError(f"dataset {name} epoch {epoch}: rows {clash[0]}.. are leased now "
                         "and acknowledged by the ledger being restored; restore it "
                         "before the epoch's first lease")
    freed = subtract(ep.acked.items(), acked)
    ep.acked = RowSet(acked)
    ep.free = RowSet(subtract(subtract(ds.defined.universe(), acked), held))
    if ep.acked.size == ep.total:
        table.complete(dataset_id, ds, epoch)
    return size_of(freed)
