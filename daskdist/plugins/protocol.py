"""Named message types and constants between client, scheduler plugin and workers (pure).

Each message is a ``NamedTuple``: on the wire (msgpack) it travels as a plain list, and
pickled it stays itself, so it is wire-compatible with the positional tuples it
replaced; a receiver rebuilds it with ``Type._make(item)``. Closure states and error
kinds are defined here once. Imports nothing from Dask, torch or the rest of the package.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# -- closure states (a RemoteValue's status on the client: values.RemoteValueStatus) --
PENDING = "PENDING"
RUNNING = "RUNNING"
READY = "READY"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
FINAL_STATES = frozenset({READY, FAILED, CANCELLED})

# -- error kinds: why a FAILED closure failed (or why a worker gave a closure back) --
USER_ERROR = "user-error"  # the closure's function raised
INPUT_ERROR = "input-error"  # a per-worker resource could not be built on the worker
WORKER_LOST = "worker-lost"  # its workers died ``max_worker_failures`` times
COLLECTIVE_ERROR = "collective"  # a gang member's collective call failed (peer lost, timeout)
HOSTS_UPDATED = "hosts-updated"  # elastic State.commit saw membership change
# A worker gives back a prefetched closure it did not start (not an error).
UNSTARTED = "unstarted"


class Submission(NamedTuple):
    """A closure a client queues (``daskdist_put``)."""

    cid: str
    payload: Any  # [function bytes, argument bytes or None]
    retries: int


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
    kind: str | None  # the error kind (USER_ERROR, ...) or UNSTARTED; None if ok
    tokens: list  # consumed lease tokens, acknowledged only if the closure completed


class Delivery(NamedTuple):
    """A closure's final outcome, pushed to its owning client (``daskdist_results``)."""

    cid: str
    state: str  # READY, FAILED or CANCELLED
    payload: Any  # pickled result (READY; a gang: the per-rank list) or error payload
    kind: str | None  # the error kind when FAILED, else None
    attempt: int


LEASE_TOKEN = "lease"  # the tag of a lease token (other tokens are ignored)


class LeaseToken(NamedTuple):
    """Rows of one batch a loader leased (``policy="dynamic"``), recorded by the closure
    that consumed them: acknowledged if it completes, released if it fails."""

    tag: str  # always LEASE_TOKEN
    dataset_id: str
    epoch: int
    ranges: list  # [(start, stop), ...] row intervals

    @classmethod
    def of(cls, dataset_id: str, epoch: int, ranges: list) -> LeaseToken:
        return cls(LEASE_TOKEN, dataset_id, int(epoch), ranges)

    @classmethod
    def parse(cls, tok: object) -> LeaseToken | None:
        """The lease token ``tok`` is (intervals as int pairs), ``None`` for a token of
        another kind; ``ValueError`` for a lease token of the wrong shape (it must not
        be skipped while an acknowledgement reports success)."""
        if not (isinstance(tok, (tuple, list)) and tok and tok[0] == LEASE_TOKEN):
            return None
        try:
            _, dataset_id, epoch, ranges = tok
            pairs = [(int(a), int(b)) for a, b in ranges]
            return cls(LEASE_TOKEN, str(dataset_id), int(epoch), pairs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed lease token {tok!r}: {e}") from None
