"""What crosses the wire for an asynchronously trained model (pure): the named messages
between the scheduler's book, the worker holding the global model, its standby and the
workers pushing deltas, and the checks of what arrives.

Each message is a ``NamedTuple``, a plain list on the wire (msgpack), rebuilt with
``Type._make`` by :func:`daskdist.core.checks.named` (which names the type and its
fields when one does not fit). Imports nothing from Dask, torch or the rest of the
package but :mod:`daskdist.core.checks`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from daskdist.core import checks

# -- a worker's role for one model ------------------------------------------------------
HOLDER = "holder"  # serves pulls and applies pushes
STANDBY = "standby"  # keeps the copy the holder sends it
NONE = "none"  # holds nothing of it (dropped)
ROLES = (HOLDER, STANDBY, NONE)

# -- where a new holder's model comes from --------------------------------------------
FRESH = "fresh"  # the model factory (nothing was ever applied)
COPY = "copy"  # its standby copy (the holder before it was lost)
CHECKPOINT = "checkpoint"  # the newest complete checkpoint under the model's URL
SAME = "same"  # the holder goes on as it is (a new standby, a checkpoint setting)
SOURCES = (FRESH, COPY, CHECKPOINT, SAME)

MAX_STALENESS = 1 << 30
MAX_BYTES = 1 << 40  # bytes a round or a model reports


class AsyncRole(NamedTuple):
    """What a worker is for one model (scheduler → worker, ``daskdist-async-role``)."""

    model: str
    session: str  # the worker session the role is given to (its reports name it)
    role: str  # HOLDER, STANDBY or NONE
    incarnation: int  # bumps at every recovery of the global model
    version: int  # a new holder's version (its content: from ``source``)
    spec: bytes  # the pickled model spec (b"": the worker has it)
    standby: str  # a holder's standby address ("": none)
    source: str  # FRESH, COPY, CHECKPOINT or SAME
    checkpoint: list  # [url, every, lineage] ([]: none; lineage: the checkpoints a
    #                   recovery may load, ModelLedger.lineage(), None: any)


class Ready(NamedTuple):
    """A holder serves (holder → scheduler, ``daskdist-async-ready``): built, promoted
    from its copy, or loaded from a checkpoint; ``error`` when it could not."""

    model: str
    session: str
    incarnation: int
    version: int  # the version it serves
    origin: int  # the version its content came from (a copy's, a checkpoint's; 0 fresh)
    source: str
    nbytes: int  # the parameters' bytes (what a pull moves)
    ledger: dict  # a loaded checkpoint's dataset ledger ({} otherwise)
    loaded: list  # the loaded checkpoint's writer: [model id, incarnation] ([]: none)
    error: str = ""


class Decision(NamedTuple):
    """A push decided by the holder (holder → scheduler, ``daskdist-async-decided``):
    applied as ``version``, or refused (``reason``); with the bytes the round moved."""

    model: str
    session: str  # the holder's
    incarnation: int
    pid: str
    applied: bool
    version: int
    staleness: int
    reason: str
    round_bytes: int  # bytes the round moved: the pull's fetch and the push


class Copied(NamedTuple):
    """A standby holds a copy (standby → scheduler, ``daskdist-async-copied``): the
    holder's state at ``version``, and the pushes applied since the copy before it."""

    model: str
    session: str  # the standby's
    incarnation: int
    version: int
    applied: list  # [(pid, version), ...]


class Checkpointed(NamedTuple):
    """A complete checkpoint of the global model (holder → scheduler,
    ``daskdist-async-checkpointed``)."""

    model: str
    session: str
    version: int
    url: str
    seconds: float
    nbytes: int


class Stage(NamedTuple):
    """A push the holder received, before it applies it (holder → scheduler,
    ``daskdist_async_stage``): the rows it consumed move from the pusher's session to
    the model's, so losing the pusher no longer gives them back. With the round's
    measures: its worker's pace (dynamic local updates), answered with the push."""

    model: str
    incarnation: int
    pid: str
    pusher: str  # the pushing closure's worker session
    address: str  # its worker
    tokens: list  # its lease tokens
    base: int  # the version it pulled
    steps: int  # inner steps of the round (optimizer steps since its pull)
    seconds: float  # the round's wall time (pull to push)


class Push(NamedTuple):
    """A delta for the holder (worker → worker, ``daskdist_async_push``): parameters only
    (the weights pulled minus the weights now), flat; the buffers as they are."""

    model: str
    pid: str  # the same on a retry: applied at most once
    pusher: str
    address: str
    base: int  # the version pulled
    incarnation: int  # of the holder it was pulled from (a new holder's versions differ)
    layout: list  # [(name, dtype, shape), ...] of the parameters (checked by name)
    params: bytes
    buffers: bytes
    tokens: list
    steps: int
    seconds: float
    round_bytes: int
    workers: int  # workers of the coordinator when pushed (averaging, delayed steps)


class Pulled(NamedTuple):
    """A pull's reply (holder → worker): the global model at ``version``, flat, or only
    its identity when the puller already has it (``current``)."""

    model: str
    incarnation: int
    version: int
    current: bool
    layout: list  # [(name, dtype, shape), ...] of the parameters, then of the buffers
    nparams: int  # how many of ``layout`` are parameters
    params: bytes
    buffers: bytes


# -- checks --------------------------------------------------------------------------------

def max_staleness(value: Any, what: str = "max_staleness") -> int:
    """``max_staleness``: an int ``>= 0`` (versions applied since a delta's pull)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int >= 0 (versions applied since a delta's "
                        f"pull), got {type(value).__name__} {value!r:.60}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0 (versions applied since a delta's pull), "
                         f"got {value}")
    return checks.integer(value, what, 0, MAX_STALENESS)


def every(value: Any, what: str = "every") -> int:
    """A checkpoint's ``every``: a positive int (versions between checkpoints)."""
    return checks.integer(value, what, 1, 1 << 40)


def decision(value: Any, op: str) -> Decision:
    d = checks.named(value, f"{op}: decision", Decision)
    checks.text(d.pid, f"{op}: pid")
    checks.flag(d.applied, f"{op}: applied")
    checks.integer(d.version, f"{op}: version", 0, 1 << 62)
    checks.integer(d.staleness, f"{op}: staleness", 0, 1 << 62)
    checks.text(d.reason, f"{op}: reason", 4096, empty=True)
    checks.integer(d.round_bytes, f"{op}: round_bytes", 0, MAX_BYTES)
    return d


def copied(value: Any, op: str) -> Copied:
    c = checks.named(value, f"{op}: copy", Copied)
    checks.integer(c.version, f"{op}: version", 0, 1 << 62)
    applied = []
    for i, item in enumerate(checks.items(c.applied, f"{op}: applied")):
        pair = checks.record(item, f"{op}: applied[{i}]", 2)
        applied.append((checks.text(pair[0], f"{op}: applied[{i}].pid"),
                        checks.integer(pair[1], f"{op}: applied[{i}].version", 0, 1 << 62)))
    return c._replace(applied=applied)


def ready(value: Any, op: str) -> Ready:
    r = checks.named(value, f"{op}: ready", Ready)
    checks.integer(r.version, f"{op}: version", 0, 1 << 62)
    checks.integer(r.origin, f"{op}: origin", 0, 1 << 62)
    if r.source not in SOURCES:
        raise ValueError(f"{op}: source must be one of {SOURCES}, got {r.source!r:.40}")
    checks.integer(r.nbytes, f"{op}: nbytes", 0, MAX_BYTES)
    if not isinstance(r.ledger, dict):
        raise TypeError(f"{op}: ledger must be a dict, got {type(r.ledger).__name__}")
    checks.text(r.error, f"{op}: error", 16384, empty=True)
    loaded = checks.items(r.loaded, f"{op}: loaded", 2)
    if loaded:
        checks.record(loaded, f"{op}: loaded", 2)
        loaded = [checks.text(loaded[0], f"{op}: loaded model"),
                  checks.integer(loaded[1], f"{op}: loaded incarnation", 0, 1 << 62)]
    return r._replace(loaded=list(loaded))


def stage(value: Any, op: str) -> Stage:
    s = checks.named(value, f"{op}: stage", Stage)
    checks.text(s.pid, f"{op}: pid")
    checks.text(s.pusher, f"{op}: pusher")
    checks.text(s.address, f"{op}: address")
    checks.items(s.tokens, f"{op}: tokens")
    checks.integer(s.base, f"{op}: base", 0, 1 << 62)
    checks.integer(s.incarnation, f"{op}: incarnation", 0, 1 << 62)
    checks.integer(s.steps, f"{op}: steps", 0, 1 << 40)
    checks.number(s.seconds, f"{op}: seconds", 0.0, 1e9)
    return s
