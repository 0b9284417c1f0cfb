"""Named message types and constants between client, scheduler plugin and workers (pure).

Each message is a ``NamedTuple``: on the wire (msgpack) it travels as a plain list, and
pickled it stays itself, so it is wire-compatible with the positional tuples it
replaced; a receiver rebuilds it with ``Type._make(item)``. Closure states and error
kinds are defined here once. Imports nothing from Dask, torch or the rest of the package.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

# -- closure states (a RemoteValue's status on the client: values.RemoteValueStatus) --
PENDING = "PENDING"
RUNNING = "RUNNING"
READY = "READY"
FAILED = "FAILED"
CANCELLED = "CANCELLED"

# -- error kinds: why a FAILED closure failed (or why a worker gave a closure back) --
USER_ERROR = "user-error"  # the closure's function raised
INPUT_ERROR = "input-error"  # a per-worker resource could not be built on the worker
WORKER_LOST = "worker-lost"  # its workers died ``max_worker_failures`` times
COLLECTIVE_ERROR = "collective"  # a gang member's collective call failed (peer lost, timeout)
HOSTS_UPDATED = "hosts-updated"  # elastic State.commit saw membership change
# A gang failed the same way (CollectiveError) ``max_worker_failures`` runs in a row with
# no membership change: the value is ``[summary, the first failure's error payload]``.
COLLECTIVE_REPEATED = "collective-repeated"
# A worker gives back a prefetched closure it did not start (not an error).
UNSTARTED = "unstarted"


# The one reply of every handler to a call naming a worker session that ended (fenced,
# expired, its worker gone, its coordinator closed); the handlers' other replies are
# theirs. The worker side recognises it in one place (plugins/worker/services.py
# ``SessionServices``, runner.py through :func:`is_session_ended`). Never mutated.
SESSION_ENDED = {"session_ended": True}


def is_session_ended(reply: object) -> bool:
    """Whether a handler's ``reply`` is :data:`SESSION_ENDED`."""
    return type(reply) is dict and reply.get("session_ended") is True


PLUGIN_NAME = "daskdist-coordinator"  # the scheduler plugin's name (and extension key)


def worker_plugin_name(name: str) -> str:
    """The name the worker plugin of coordinator ``name`` is registered under."""
    return f"daskdist-worker-{name}"


class Submission(NamedTuple):
    """A closure a client queues (``daskdist_put``)."""

    cid: str
    payload: Any  # [function bytes, argument bytes or None]
    retries: int
    # the dynamic dataset whose per-worker iterator is an argument ("": none): at the
    # epoch's tail the scheduler sends it to a worker still holding that dataset's rows
    dataset: str = ""


class Dispatch(NamedTuple):
    """A closure the scheduler hands to a worker session (``exchange`` reply)."""

    cid: str
    payload: Any  # [function bytes, argument bytes or None]
    attempt: int  # executions started so far, this one included
    gang: bool  # a gang member: runs on the gang slot, never stolen
    owner: str = ""  # the owner it belongs to (a worker holds an owner's closures while
    #                  that owner's error is raised)


class Outcome(NamedTuple):
    """A closure's end: the one shape a finished closure has, from the worker that ran
    it (``exchange`` / ``report`` / ``unregister``: with its lease ``tokens``), through
    the queue and the gang book, to the client that owns it (``daskdist_results``).

    ``state`` is READY, FAILED or CANCELLED; a worker reports PENDING (kind UNSTARTED)
    for a closure it hands back without starting it.
    """

    cid: str
    state: str
    value: Any = None  # pickled result (READY; a gang: the per-rank list) or error payload
    kind: str | None = None  # the error kind when FAILED (USER_ERROR, ...), else None
    attempt: int = 0
    owner: str = ""  # the client-side Coordinator it belongs to (scheduler-side routing)
    tokens: tuple | list = ()  # consumed lease tokens: acknowledged only if it completed


class ResourceSpec(NamedTuple):
    """How a worker builds a per-worker resource (``daskdist_add_resource``; pickled by
    the client, opaque to the scheduler): ``factory(ctx)`` for a ``"resource"`` or a
    ``"dataset"``; for an ``"iterator"``, ``factory(parent's component)`` (``iter`` when
    ``None``)."""

    kind: str  # "resource", "dataset" or "iterator"
    factory: Any
    parent: str | None  # an iterator's dataset rid


class ResourceRef(NamedTuple):
    """A per-worker resource (``PerWorkerValues``) as a closure argument on the wire: each
    worker resolves it to its own component."""

    rid: str
    kind: str


class CommitKey(NamedTuple):
    """The identity of one elastic-state commit (``daskdist_gang_commit_part``,
    ``daskdist_commit_outcome``): every rank of the commit sends the same key.

    ``state`` is the State's id (the same on every rank and on a replacement: minted
    from the per-worker resource or gang closure that made it), ``generation`` the
    group generation, ``seq`` a counter of the State's commits that every rank agrees
    on at the commit and that never repeats, refused commits included.
    """

    state: str
    generation: int
    seq: int

    @classmethod
    def parse(cls, wire: object) -> CommitKey:
        """The key ``wire`` is (a list on the wire); ``ValueError`` naming it if malformed."""
        try:
            state, generation, seq = wire  # type: ignore[misc]
            if not isinstance(state, str) or not state:
                raise TypeError("the state id must be a non-empty string")
            return cls(state, int(generation), int(seq))
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed commit key {wire!r}: {e}") from None


LEASE_TOKEN = "lease"  # the tag of a lease token (other tokens are ignored)


def dataset_key(dataset_id: str) -> int:
    """A dataset id as a positive 63-bit integer, the same in every process: how a gang
    commit's packed parts (:func:`daskdist.core.commits.pack_tokens`) name it in an
    int64 tensor; the scheduler's lease table maps it back."""
    digest = hashlib.blake2b(dataset_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


# A commit's allgather carries each rank's packed lease tokens in this many int64 slots
# at first and at most (the ranks agree on the size from the previous commit's heads,
# so these are wire format, alike in every process, not settings): parts that do not
# fit are sent one per rank instead (``daskdist_gang_commit_part``).
COMMIT_SLOTS_MIN = 8
COMMIT_SLOTS_MAX = 1024


# Dask worker statuses of a worker that is leaving (retired, closing, closed): it gets
# no new work, and its group members leave at their next commit
RETIRING = frozenset({"closing_gracefully", "closing", "closed"})


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


class DatasetDef(NamedTuple):
    """A ``"dynamic"`` dataset's units, defined once per dataset
    (``daskdist_dataset_define``): leases, acknowledgements and progress then name only
    the dataset, an epoch and row intervals.

    ``runs`` is the units' row counts, run-length encoded: ``[(rows per unit, units),
    ...]`` in the stable order of units (a few runs per file, whatever the number of
    row groups); ``None`` registers the dataset's owner and label before a worker's
    loader defines its units (``create_per_worker_dataset``).
    """

    dataset_id: str
    label: str
    runs: list | None
    seed: int = 0  # the loaders' shuffle seed (kept in a checkpoint's ledger)


class EpochLedger(NamedTuple):
    """One dataset-epoch's acknowledged rows (``daskdist_dataset_state`` exports it,
    ``daskdist_dataset_start`` starts an epoch from it): what resuming needs."""

    dataset_id: str
    epoch: int
    acknowledged: list  # [(start, stop), ...] row intervals
    total: int  # rows of the epoch
    # a collection's partition lengths learned so far, [(length, partitions), ...] in
    # partition order (-1: unknown); None for files and known lengths
    lengths: list | None = None



class CollectionDef(NamedTuple):
    """A Dask collection's partitions as a ``"dynamic"`` dataset's units
    (``daskdist_collection_define``): ``units`` partitions, with ``runs`` their lengths
    run-length encoded when known (dense row ids, as files), or ``None`` (each partition
    gets ``core.partitions.STRIDE`` ids: its index times STRIDE plus the row's position;
    lengths are learned as partitions are computed). ``shuffle``: partitions are leased
    in an order seeded by ``(seed, epoch)``. ``holders``: per partition, the Dask key of
    the data the user persisted for it (or ``None``): it is leased first to the member
    that holds that key."""

    dataset_id: str
    label: str
    units: int
    runs: list | None
    seed: int = 0
    shuffle: bool = False
    holders: list | None = None
