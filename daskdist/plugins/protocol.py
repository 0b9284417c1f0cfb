"""Named message types between the scheduler plugin and the worker plugin (pure).

Each is a ``NamedTuple``: on the wire (msgpack) it travels as a plain list, exactly as
the positional tuples it replaces, so senders and receivers can move to the names one
at a time; a receiver rebuilds it with ``Type._make(item)``. Imports nothing from Dask.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Dispatch(NamedTuple):
    """A closure the scheduler hands to a worker session (``exchange`` reply)."""

    cid: str
    payload: Any  # [function bytes, argument bytes or None]
    attempt: int  # executions started so far, this one included
    gang: bool  # a gang member: runs on the gang slot, never stolen


class Result(NamedTuple):
    """A worker's report of one closure (``exchange`` / ``report`` / ``unregister``)."""

    cid: str
    ok: bool
    value: Any  # pickled result (ok) or error payload
    kind: str | None  # the error kind (queue.USER_ERROR, ...) or UNSTARTED; None if ok
    tokens: list  # consumed lease tokens, acknowledged only if the closure completed
