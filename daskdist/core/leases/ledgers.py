"""Dataset ledgers of elastic States: what a checkpoint keeps of the data, and resuming it.

A State's checkpoint (``State.checkpoint_to``) holds, beside the model, the *ledger* of
every ``"dynamic"`` dataset trained under the State, keyed by the dataset's name (its
``name=`` label): the epoch its commits reached, the rows acknowledged by the commits up
to the checkpoint's, the rows and units of the dataset (to tell another dataset apart)
and its shuffle seed; for a Dask collection, the partition lengths learned so far (so a
resumed epoch computes no partition it trained just to learn its length).
:class:`Ledgers` (scheduler side) remembers which datasets each State's commits touched,
exports their ledger, and restores one into the lease table when a State resumes, on a
new cluster too (a dataset of that name defined later gets it when it is defined).
Pure: no Dask, torch or I/O.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from daskdist.core.leases import resume
from daskdist.core.leases.table import LeaseTable, group_tokens

logger = logging.getLogger(__name__)

_FIELDS = ("epoch", "acknowledged", "total", "units", "seed")


class Ledgers:
    """Which datasets each State's commits touched, and ledgers waiting for a dataset."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        # State id -> {dataset id: the newest epoch its commits touched}
        self.touched: OrderedDict[str, dict[str, int]] = OrderedDict()
        self.pending: dict[str, dict] = {}  # dataset name -> a resumed ledger entry

    def note(self, state: str, tokens: Iterable[object]) -> None:
        """A commit part of ``state`` carried ``tokens``: remember their datasets."""
        self.note_tables(state, group_tokens(tokens))

    def note_tables(self, state: str, groups: Iterable[tuple[str, int]]) -> None:
        """A commit of ``state`` touched these ``(dataset id, epoch)`` tables."""
        if not groups:
            return
        seen = self.touched.setdefault(state, {})
        self.touched.move_to_end(state)
        for dataset_id, epoch in groups:
            seen[dataset_id] = max(seen.get(dataset_id, epoch), epoch)
        while len(self.touched) > self.keep:
            self.touched.popitem(last=False)

    def export(self, state: str, table: LeaseTable) -> dict[str, dict]:
        """The ledger of ``state``'s datasets now, by name (a dataset without a name is
        keyed by its id, which a new cluster never matches)."""
        out: dict[str, dict] = {}
        for dataset_id, epoch in self.touched.get(state, {}).items():
            ds = table.datasets.get(dataset_id)
            if ds is None or ds.units is None:
                continue  # forgotten: its handle was dropped
            out[ds.label or dataset_id] = entry = {
                "dataset_id": dataset_id, "epoch": epoch,
                "acknowledged": [list(iv) for iv in table.acknowledged(dataset_id, epoch)],
                "total": ds.units.total, "units": ds.units.units, "seed": ds.seed}
            lengths = table.known_lengths(dataset_id)
            if lengths is not None:  # a collection's lengths learned so far (run-length)
                entry["lengths"] = [list(r) for r in lengths]
        return out

    def restore(self, state: str, ledger: Mapping[str, Any], table: LeaseTable) -> list[str]:
        """``state`` resumed from a checkpoint with ``ledger``: each named dataset's epoch
        goes on from it (:meth:`LeaseTable.restore_epoch`); a name not defined yet waits
        for its dataset (:meth:`defined`). The dataset ids restored now."""
        done = []
        for name, entry in ledger.items():
            entry = _checked(name, entry)
            dataset_id = _named(table, name)
            if dataset_id is None:
                self.pending[name] = entry
                continue
            self._apply(table, dataset_id, entry)
            self.touched.setdefault(state, {})[dataset_id] = entry["epoch"]
            done.append(dataset_id)
        return done

    def defined(self, dataset_id: str, table: LeaseTable) -> bool:
        """A dataset's units were defined: restore a ledger waiting for its name."""
        ds = table.datasets.get(dataset_id)
        if ds is None or not ds.label or "." in dataset_id:
            return False
        entry = self.pending.pop(ds.label, None)
        if entry is None:
            return False
        self._apply(table, dataset_id, entry)
        return True

    @staticmethod
    def _apply(table: LeaseTable, dataset_id: str, entry: dict) -> None:
        ds = table.datasets[dataset_id]
        units = ds.units
        if units is None:
            raise ValueError(f"dataset {dataset_id!r} has no units defined yet")
        if (entry["total"], entry["units"]) != (units.total, units.units):
            raise ValueError(
                f"the checkpoint's ledger of dataset {ds.label!r} is of {entry['total']} "
                f"rows in {entry['units']} units; dataset {dataset_id!r} of that name has "
                f"{units.total} rows in {units.units} units (other files?)")
        if entry["seed"] != ds.seed:
            logger.warning("daskdist: dataset %r resumes with seed %s, its checkpoint was "
                           "trained with seed %s (rows stay exactly once; their order "
                           "differs)", ds.label, ds.seed, entry["seed"])
        if entry["lengths"]:  # learned first: its trained partitions are not recomputed
            resume.learn_lengths(table, dataset_id, entry["lengths"])
        resume.restore_epoch(table, dataset_id, entry["epoch"], entry["acknowledged"])


def _named(table: LeaseTable, name: str) -> str | None:
    """The newest defined dataset labelled ``name`` (a loader's ``"<id>.<k>"`` aside)."""
    found = None
    for dataset_id, ds in table.datasets.items():
        if ds.label == name and ds.units is not None and "." not in dataset_id:
            found = dataset_id
    return found


def _checked(name: Any, entry: Any) -> dict:
    """A ledger entry as the scheduler takes it: ``TypeError`` / ``ValueError`` naming
    what is wrong."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a ledger's dataset name must be a non-empty str, got {name!r:.80}")
    if not isinstance(entry, Mapping) or any(k not in entry for k in _FIELDS):
        raise TypeError(f"the ledger of dataset {name!r} must hold {_FIELDS}")
    acked = entry["acknowledged"]
    if not isinstance(acked, (list, tuple)):
        raise TypeError(f"the ledger of dataset {name!r}: acknowledged must be intervals")
    lengths = entry.get("lengths") or []  # a collection's (checkpoints before had none)
    if not isinstance(lengths, (list, tuple)):
        raise TypeError(f"the ledger of dataset {name!r}: lengths must be runs "
                        "[length, partitions]")
    return {"epoch": int(entry["epoch"]), "total": int(entry["total"]),
            "units": int(entry["units"]), "seed": int(entry["seed"]),
            "acknowledged": [(int(a), int(b)) for a, b in acked],
            "lengths": [(int(n), int(k)) for n, k in lengths]}
