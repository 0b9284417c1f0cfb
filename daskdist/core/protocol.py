"""What crosses the wire between client, scheduler plugin and workers (pure): the named
messages, the checks of whole messages as they arrive, and how a handler's message
reaches its book.

Each message is a ``NamedTuple``: on the wire (msgpack) it travels as a plain list, and
pickled it stays itself; a receiver rebuilds it with ``Type._make(item)``. Closure states
and error kinds are defined here once. The checks of single arguments and settings, and
the wire's size limits, are :mod:`daskdist.core.checks`; the checks here build on them
(a worker's results, a member's window, a client's submissions), each with a fast path
that builds no message for a good one.

Each book of a coordinator declares its handlers in one table of :class:`Route` entries
(``CLOSURE_ROUTES``, ``GROUP_ROUTES``, ``LEASE_ROUTES``, ...); :func:`book_handler` is
what the scheduler plugin registers for each: it finds the book of the coordinator the
message names, checks the caller (a worker session, a client's owner) and calls the
route's method.

Imports nothing from Dask, torch or the rest of the package but the checks.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from daskdist.core import checks

# -- closure states (a RemoteValue's status on the client: closures.RemoteValueStatus) --
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
    commit's packed parts (:func:`daskdist.core.leases.commits.pack_tokens`) name it in an
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

    ``runs``: the units' row counts, run-length encoded (``[(rows per unit, units),
    ...]`` in the stable order of units: a few runs per file, whatever the number of row
    groups). Without them, ``units`` partitions of unknown length (each gets
    ``core.partitions.STRIDE`` ids; lengths are learned as partitions are read); with
    neither, the owner and label are registered before a worker's loader defines the
    units (``create_per_worker_dataset``). ``shuffle``: units are leased in an order
    seeded by ``(seed, epoch)``; ``whole``: a unit is leased whole, never split (a
    partition read in part is computed whole); ``holders``: per unit, the Dask key of
    data the user persisted for it (or ``None``): leased first to the member holding it.
    """

    dataset_id: str
    label: str
    runs: list | None
    seed: int = 0  # the loaders' shuffle seed (kept in a checkpoint's ledger)
    units: int | None = None
    shuffle: bool = False
    whole: bool = False
    holders: list | None = None


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


class InferenceJobDef(NamedTuple):
    """A batch-inference job as its client starts it (``daskdist_infer_start``): its name
    and output, its source's fingerprint, the source's units as the lease table defines
    them (a :class:`DatasetDef`), the id and factory of its per-worker engine and the
    payloads of the job's two closures (opaque to the scheduler), and
    what the output's ledger holds from earlier runs."""

    name: str
    output: str
    fingerprint: str
    dataset: Any  # a DatasetDef (a list on the wire)
    resource: str  # the engine's per-worker resource id
    engine: bytes  # the engine's ResourceSpec, pickled
    run: Any  # [function bytes, argument bytes]: one unit
    finish: Any  # [function bytes, argument bytes]: the output's manifest and _SUCCESS
    committed: list  # [(start, stop), ...] rows committed by earlier runs
    lengths: list | None  # partitions' lengths they learned, as EpochLedger.lengths
    units: int  # units committed by earlier runs
    out_rows: int  # and the rows of their output


class UnitReport(NamedTuple):
    """A unit a job's closure ran (``daskdist_infer_unit``): its output staged (or, for a
    job whose output is returned in memory, as Arrow IPC ``data``), asking to be
    committed, or its failure (``error``)."""

    job: str
    attempt: str  # "<closure id>#<attempt>"
    tokens: list  # the unit's lease tokens: a commit acknowledges them
    staged: str  # where its output is staged ("" when it failed)
    out_rows: int
    lengths: list  # [(partition, rows), ...] learned by reading it
    unit: str  # how the unit is named: its file (row groups) or partition, and rows
    error: str = ""  # why it failed ("" when staged)
    data: bytes = b""  # the output itself, when the job returns it in memory


class Preemption(NamedTuple):
    """A worker will be taken away: ``deadline`` (epoch seconds, ``time.time()``) and
    why (``"SIGTERM"``, ``"SIGUSR1"``, ``"aws-spot"``, ``"notify_preemption"``, ...).
    What ``dd.get_worker_context().preemption`` gives, what a worker reports to the
    scheduler (``daskdist_preemption``) and what ``coord.status()`` lists."""

    deadline: float
    reason: str


def preemption(deadline: Any, reason: Any, what: str) -> Preemption:
    """A :class:`Preemption` from the wire, checked (its deadline a finite number of
    epoch seconds, its reason a short text); the error names ``what``."""
    return Preemption(checks.number(deadline, f"{what}: deadline", 0.0, 1e12),
                      checks.text(reason, f"{what}: reason"))


class RankWindow(NamedTuple):
    """One gang member's window of steps (``daskdist-rank-window``, on the worker's
    stream to the scheduler): sent once a window while a gang closure runs, the last one
    with ``ended`` when it returns. Phases and step-time buckets are those of
    ``core.steptimes``."""

    session: str
    gang: str  # the gang closure's id (its members' ids without the run)
    generation: int
    rank: int
    index: int  # the window: wall-clock seconds // the window's length
    steps: int  # steps that ended in it
    seconds: float  # their wall time
    phases: list  # their seconds in each phase: data, collective, commit, compute
    rows: int  # rows the rank's loaders handed them
    hist: list  # [(bucket, count), ...]: their step times
    total: int  # steps since the gang closure started
    since_step: float  # seconds since its last step (or since it started, before one)
    partitions: list  # [seconds Dask computed partitions waited for, seconds reading them]
    ended: bool = False


def submission_ok(item: Any, prefix: str) -> bool:
    """Whether ``item`` is a well-formed :class:`Submission` whose id starts with
    ``prefix`` (the fast path of ``daskdist_put``: its checks build messages only for
    a bad one)."""
    return (type(item) in (list, tuple) and 3 <= len(item) <= 4
            and checks.is_text(item[0]) and item[0].startswith(prefix)
            and type(item[1]) in (list, tuple) and len(item[1]) == 2
            and type(item[1][0]) is bytes and (item[1][1] is None or type(item[1][1]) is bytes)
            and type(item[2]) is int and 0 <= item[2] <= checks.MAX_RETRIES
            and (len(item) == 3
                 or (type(item[3]) is str and len(item[3]) <= checks.MAX_TEXT)))


def submissions(op: str, owner: str, closures: Any) -> list[Submission]:
    """A client's closures (each a :class:`Submission`, its dataset optional), checked as
    a whole: each id must be ``owner``'s (``owner-...``), so no client can queue under
    another's ids (``PermissionError``)."""
    prefix = f"{owner}-"
    subs = []
    for i, item in enumerate(checks.items(closures, f"{op}: closures")):
        if submission_ok(item, prefix):
            subs.append(Submission(*item))  # without its dataset: ""
            continue
        if isinstance(item, (list, tuple)) and len(item) == 3:
            item = (*item, "")
        sub = Submission._make(checks.record(item, f"{op}: closures[{i}]",
                                             len(Submission._fields)))
        if not checks.text(sub.cid, f"{op}: closures[{i}].cid").startswith(prefix):
            raise PermissionError(f"{op}: closure id {sub.cid!r} is not one of owner "
                                  f"{owner!r}'s")
        payload(sub.payload, f"{op}: closures[{i}].payload")
        checks.integer(sub.retries, f"{op}: closures[{i}].retries", 0, checks.MAX_RETRIES)
        checks.text(sub.dataset, f"{op}: closures[{i}].dataset", empty=True)
        subs.append(sub)
    return subs


def payload(value: Any, what: str) -> list | tuple:
    """A closure's payload: ``[function bytes, argument bytes or None]``."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not isinstance(value[0], bytes)
            or not (value[1] is None or isinstance(value[1], bytes))):
        raise TypeError(f"{what} must be [function bytes, argument bytes or None], got "
                        f"{checks.shown(value)}")
    return value


# -- what workers send ----------------------------------------------------------------------

WORKER_STATES = frozenset({READY, FAILED, PENDING})  # what a worker may report


def _is_outcome(item: Any) -> bool:
    """Whether ``item`` passes :func:`outcomes`' checks (the fast path, no messages)."""
    return (type(item) in (list, tuple) and len(item) == _OUTCOME_FIELDS
            and checks.is_text(item[0]) and type(item[1]) is str and item[1] in WORKER_STATES
            and (item[3] is None or checks.is_text(item[3]))
            and type(item[4]) is int and 0 <= item[4] <= 2**31
            and type(item[6]) in (list, tuple) and len(item[6]) <= checks.MAX_ITEMS)


_OUTCOME_FIELDS = len(Outcome._fields)


def outcomes(op: str, results: Any) -> list[Outcome]:
    """A worker's results, checked as a whole (nothing is applied if one is malformed)."""
    out = []
    for i, item in enumerate(checks.items(results, f"{op}: results")):
        if _is_outcome(item):
            out.append(Outcome._make(item))
            continue
        o = Outcome._make(checks.record(item, f"{op}: results[{i}]", len(Outcome._fields)))
        checks.text(o.cid, f"{op}: results[{i}].cid")
        if o.state not in WORKER_STATES:
            raise ValueError(f"{op}: results[{i}].state must be one of "
                             f"{sorted(WORKER_STATES)}, got {o.state!r}")
        checks.optional(checks.text, o.kind, f"{op}: results[{i}].kind")
        checks.integer(o.attempt, f"{op}: results[{i}].attempt", 0, 2**31)
        checks.items(o.tokens, f"{op}: results[{i}].tokens")
        out.append(o)
    return out


def observed(op: str, held: Any, started: Any) -> tuple[list[str] | None, list[str]]:
    """What a worker says it holds and which of those started."""
    held = checks.optional(checks.texts, held, f"{op}: held")
    return held, checks.texts(started if started is not None else [], f"{op}: started")


# -- what a gang member measures -------------------------------------------------------
MAX_WINDOW_BUCKETS = 512  # step-time buckets in one window (core.steptimes: at most 321)
MAX_SECONDS = 1e9  # any duration a window reports


_WINDOW_FIELDS = len(RankWindow._fields)
_WINDOW_INTS = (2, 3, 4, 5, 8, 10)  # generation, rank, index, steps, rows, total


def _seconds_ok(v: Any) -> bool:
    return type(v) is float and 0.0 <= v <= MAX_SECONDS


def _window_ok(w: Any) -> bool:
    """Whether ``w`` passes :func:`rank_window`'s checks (the fast path: a member's
    report every window; no message is built)."""
    if not (type(w) in (list, tuple) and len(w) == _WINDOW_FIELDS and checks.is_text(w[0])
            and checks.is_text(w[1]) and type(w[13]) is bool):
        return False
    if not all(type(w[i]) is int and 0 <= w[i] <= 2**62 for i in _WINDOW_INTS):
        return False
    ph, parts, hist = w[7], w[12], w[9]
    return (_seconds_ok(w[6]) and _seconds_ok(w[11])
            and type(ph) in (list, tuple) and len(ph) == 4 and all(map(_seconds_ok, ph))
            and type(parts) in (list, tuple) and len(parts) == 2
            and all(map(_seconds_ok, parts))
            and type(hist) in (list, tuple) and len(hist) <= MAX_WINDOW_BUCKETS
            and all(type(p) in (list, tuple) and len(p) == 2 and type(p[0]) is int
                    and type(p[1]) is int and -MAX_WINDOW_BUCKETS <= p[0] <= 2**62
                    and 0 <= p[1] <= 2**62 for p in hist))


def rank_window(value: Any, op: str) -> RankWindow:
    """A :class:`RankWindow` as it arrived, every field checked (its histogram's pairs
    as tuples)."""
    if _window_ok(value):
        w = RankWindow._make(value)
        return w._replace(phases=list(w.phases), partitions=list(w.partitions),
                          hist=[tuple(p) for p in w.hist])
    w = checks.named(value, f"{op}: window", RankWindow)
    checks.text(w.session, f"{op}: window.session")
    checks.text(w.gang, f"{op}: window.gang")
    for name in ("generation", "rank", "index", "steps", "rows", "total"):
        checks.integer(getattr(w, name), f"{op}: window.{name}",
                       0 if name != "index" else -2**62, 2**62)
    for name in ("seconds", "since_step"):
        checks.number(getattr(w, name), f"{op}: window.{name}", 0.0, MAX_SECONDS)
    phases = checks.items(w.phases, f"{op}: window.phases", 4)
    parts = checks.items(w.partitions, f"{op}: window.partitions", 2)
    if len(phases) != 4 or len(parts) != 2:
        raise ValueError(f"{op}: window.phases must hold 4 numbers and window.partitions "
                         f"2, got {len(phases)} and {len(parts)}")
    for i, v in enumerate([*phases, *parts]):
        checks.number(v, f"{op}: window phase or partition time [{i}]", 0.0, MAX_SECONDS)
    hist = checks.pairs(w.hist, f"{op}: window.hist", MAX_WINDOW_BUCKETS,
                        lo=-MAX_WINDOW_BUCKETS, hi=2**62)
    if any(n < 0 for _, n in hist):
        raise ValueError(f"{op}: window.hist counts must not be negative")
    checks.flag(w.ended, f"{op}: window.ended")
    return w._replace(phases=[float(v) for v in phases],
                      partitions=[float(v) for v in parts], hist=hist)


# -- handlers: a message to its coordinator's book ---------------------------------------
CLOSED = object()  # a route's default reply to a gone coordinator: KeyError naming it

ANY, SESSION, OWNER, OWNER_OR_SESSION = "any", "session", "owner", "owner-or-session"


class Route(NamedTuple):
    """One scheduler handler of a coordinator's book, as its book's table declares it.

    ``closed``: the reply when the named coordinator is gone (:data:`CLOSED`: a
    ``KeyError`` naming it). ``caller``: who may call it, checked before the method
    runs, the one place a caller is checked: :data:`SESSION` (its ``session`` is a live
    worker session of the coordinator, whose lease the message renews; an ended one gets
    ``ended``), :data:`OWNER` (its ``owner`` and secret ``token``), either of the two
    (:data:`OWNER_OR_SESSION`: a session when it names one), or :data:`ANY` (read-only
    routes, and those that answer a gone owner themselves)."""

    method: Callable[..., Any]
    closed: Any = CLOSED
    caller: str = ANY
    ended: Any = SESSION_ENDED


def book_handler(states: dict[str, Any], book: str, op: str, route: Route
                 ) -> Callable[..., Any]:
    """Handler ``op`` (what the plugin registers): ``route.method`` called on the book
    ``book`` (``""``: the coordinator itself) of the coordinator (in ``states``, by
    name) the message names, once its caller passed ``route.caller``'s check (its
    session renewed by the coordinator's membership, or its owner's token checked by the
    coordinator's ``check_owner``). A method whose first parameter (after ``self``) is ``comm`` gets
    Dask's comm."""
    method, closed, caller, ended = route

    def book_of(name: Any, kwargs: dict) -> tuple[Any, Any]:
        """(the book, None), or (None, the reply) when the call stops here."""
        co = states.get(checks.text(name, f"{op}: name"))
        if co is None:
            if closed is not CLOSED:
                return None, closed
            if caller == SESSION:  # its coordinator is gone, so is every session of it
                return None, ended
            raise KeyError(f"no daskdist coordinator named {name!r} on this scheduler")
        if caller == SESSION or (caller == OWNER_OR_SESSION
                                 and kwargs.get("session") is not None):
            # a live member's message renews its lease
            if not co.members.renew(checks.text(kwargs.get("session"), f"{op}: session"),
                                    time.monotonic()):
                return None, ended
        elif caller in (OWNER, OWNER_OR_SESSION):  # PermissionError unless it is
            co.check_owner(checks.text(kwargs.get("owner"), f"{op}: owner"),
                           checks.text(kwargs.get("token"), f"{op}: token"))
        return (getattr(co, book) if book else co), None

    if list(inspect.signature(method).parameters)[1:2] == ["comm"]:
        async def handler(comm, name: str, **kwargs: Any) -> Any:
            b, reply = book_of(name, kwargs)
            return reply if b is None else await method(b, comm, **kwargs)
    elif asyncio.iscoroutinefunction(method):
        async def handler(name: str, **kwargs: Any) -> Any:  # type: ignore[misc]
            b, reply = book_of(name, kwargs)
            return reply if b is None else await method(b, **kwargs)
    else:
        def handler(name: str, **kwargs: Any) -> Any:  # type: ignore[misc]
            b, reply = book_of(name, kwargs)
            return reply if b is None else method(b, **kwargs)

    handler.__name__ = method.__name__
    return handler
