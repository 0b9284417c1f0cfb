"""What an asynchronous model's ledger asks of the dynamic datasets' rows, beside the
book: the rows of a push move to the model's own lease-table session when its holder
stages it, then are acknowledged on the pusher's count once the push is durable, or
given back; a checkpoint's datasets' ledger holds the rows of its applied pushes too.
The lease table is the lease book's: these functions reach it through their
coordinator (:class:`ModelRows`). Imports nothing from Dask or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import msgpack

from daskdist.core.asynchronous.ledger import ModelLedger, Settle
from daskdist.core.intervals import normalize, union
from daskdist.core.leases.table import group_tokens
from daskdist.core.membership import Membership

logger = logging.getLogger(__name__)


class ModelRows(Protocol):
    """What a model's rows ask of the coordinator (routed to the lease book)."""

    name: str
    members: Membership  # the shared membership: whether a pusher's session lives

    def hand_rows(self, source: str, target: str, tokens: list) -> bool:
        """Move the rows of lease tokens leased to ``source`` to ``target``'s lease, all
        or none."""

    def ack_sessions(self, per_session: Mapping[str, Iterable[object]]) -> bool:
        """Acknowledge lease tokens, per session, all or none."""

    def rows_forgotten(self, tokens: list) -> bool:
        """Whether every dataset these lease tokens name was forgotten (nothing to
        acknowledge them in)."""

    def release_rows(self, session: str, tokens: list) -> int:
        """Give back the rows of lease tokens leased to ``session``: rows freed."""

    def rows_only_with(self, session: str, tokens: list) -> bool:
        """Whether every epoch these lease tokens name has no row left to read: each
        one not acknowledged is ``session``'s."""

    def note_trained(self, state: str, tokens: Iterable[object]) -> None:
        """``state`` (a model) trained on the datasets these lease tokens name."""

    def export_ledger(self, state: str) -> dict:
        """The datasets' ledger of ``state`` now, by name."""

    def restore_ledger(self, state: str, ledger: dict) -> list:
        """``state`` resumed from a checkpoint's datasets' ledger."""


def wire_size(obj: Any) -> int:
    """Bytes of ``obj`` as msgpack puts it on the wire (what the scheduler moved)."""
    try:
        return len(msgpack.packb(obj, use_bin_type=True, default=str))
    except (TypeError, ValueError):
        return 0


def token_rows(tokens: list) -> int:
    """The rows lease tokens name."""
    return sum(b - a for ranges in group_tokens(tokens).values() for a, b in ranges)


def pseudo(model: str) -> str:
    """The lease-table session that holds a model's staged rows."""
    return f"async:{model}"


def settle_rows(co: ModelRows, model: str, settle: Settle) -> None:
    """Do what a transition of ``model``'s ledger asks of the rows: acknowledge (on the
    pusher's worker's count when its session lives), give back, restore a ledger."""
    if not settle:
        return
    holder = pseudo(model)
    for rec in settle.ack:
        if not rec.tokens:
            continue
        if not (rec.pusher in co.members and co.hand_rows(holder, rec.pusher, rec.tokens)
                and co.ack_sessions({rec.pusher: rec.tokens})):
            if not co.ack_sessions({holder: rec.tokens}) and not co.rows_forgotten(
                    rec.tokens):  # a dropped dataset's rows count nowhere: nothing lost
                logger.warning("daskdist[%s]: the rows of push %s of model %s could not be "
                               "acknowledged", co.name, rec.pid, model)
    for rec in settle.release:
        if rec.tokens:
            co.release_rows(holder, rec.tokens)
    if settle.restore:
        try:
            co.restore_ledger(model, settle.restore)
        except (TypeError, ValueError) as e:
            logger.warning("daskdist[%s]: the datasets' ledger of model %s's checkpoint "
                           "was not restored: %s", co.name, model, e)


def checkpoint_ledger(co: ModelRows, led: ModelLedger, version: int) -> dict:
    """The datasets' ledger of a checkpoint of ``led``'s model at ``version``: the rows
    acknowledged now and those of its pushes applied up to ``version``, not yet durable."""
    out = co.export_ledger(led.model)
    extra = group_tokens([t for r in led.pending_rows(version) for t in r.tokens])
    for entry in out.values():
        more = extra.get((entry["dataset_id"], entry["epoch"]))
        if more:
            entry["acknowledged"] = [list(iv) for iv in union(
                normalize(entry["acknowledged"]), normalize(more))]
    return out
