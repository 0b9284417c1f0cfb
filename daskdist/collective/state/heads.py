"""What an elastic State's ranks tell each other, named: a commit's head (each commit's
allgather row, or the gradient allreduce it rides) and a sync's head, each encoding to
and decoding from int64s; and a commit's outcome as one rank saw it.

Every rank runs the same code, so a row's layout is these fields in order; a keeper's
own part of a sync's row follows the :class:`SyncHead` (its keeper decodes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from daskdist.core.protocol import COMMIT_SLOTS_MAX, COMMIT_SLOTS_MIN

# a commit's outcome as a rank saw it: applied, refused, no reply (a comm error, a
# timeout), or a commit rank 0 sent for every rank whose outcome no allgather told yet
OK, REFUSED, UNKNOWN, NONE = 1, 0, -1, 2


class CommitHead(NamedTuple):
    """One rank's part of a commit's allgather, before its packed tokens (``used`` of
    them, in the slots the ranks agreed on)."""

    rows: int  # 1: rows to acknowledge
    version: int  # its worker session's membership counter
    outcome: int  # the previous commit's outcome as this rank saw it
    seq: int  # its commit counter
    # how its worker leaves (``collective.state.deadline``): STAY; RETIRING (it leaves,
    # and the State writes checkpoints); LEAVING on its preemption deadline, at this
    # commit; LEAVING_UNWRITTEN, its write would not end before the deadline
    leaving: int
    joins: int  # its worker session's joins counter
    used: int  # packed ints its tokens take (negative: needed, did not fit the slots)

    LEN = 7

    def encode(self, body: Sequence[int] = (), slots: int = 0) -> list[int]:
        """The row: the head, then ``body`` (the packed tokens) zero-padded to ``slots``."""
        return [int(v) for v in self] + list(body) + [0] * (slots - len(body))

    @classmethod
    def decode(cls, row: Sequence[int]) -> CommitHead:
        return cls(*(int(v) for v in row[:cls.LEN]))

    def part(self, row: Sequence[int]) -> list[int]:
        """This rank's packed tokens in its row (when they fit: ``used >= 0``)."""
        return list(row[self.LEN:self.LEN + self.used])


class SyncHead(NamedTuple):
    """One rank's part of a ``sync()``'s allgather, before its keeper's own part."""

    commits: int  # commits its committed copy holds
    seq: int  # its commit counter
    version: int  # its worker session's membership counter
    joins: int  # its worker session's joins counter
    known: int  # commits the scheduler recorded of the State (asked when it holds none)
    newest: int  # rank 0: the newest complete checkpoint's commit (0: none)
    skip: int  # 1: its last interrupt said skip_sync, and it holds a commit
    lineage: int  # the generation it last took part in (-1: none, or a newcomer)

    LEN = 8

    def encode(self) -> list[int]:
        return [int(v) for v in self]

    @classmethod
    def decode(cls, row: Sequence[int]) -> SyncHead:
        return cls(*(int(v) for v in row[:cls.LEN]))


class ConfirmHead(NamedTuple):
    """One rank's part of the small allgather that confirms a commit in flight before the
    next commit's copy travels (a keeper that announces): its view of the outcome, and
    its keeper's announced ints."""

    outcome: int
    announced: tuple[int, ...]

    def encode(self) -> list[int]:
        return [int(self.outcome), *self.announced]

    @classmethod
    def decode(cls, row: Sequence[int]) -> ConfirmHead:
        return cls(int(row[0]), tuple(int(v) for v in row[1:]))


def slots_for(need: int) -> int:
    """The packed-token slots of the next commit, from the most a rank needed now (a
    power of two; the least when even the most would not fit: those go part by part)."""
    if need > COMMIT_SLOTS_MAX:
        return COMMIT_SLOTS_MIN
    return max(COMMIT_SLOTS_MIN, 1 << max(0, need - 1).bit_length())


class Told:
    """The reply of a commit rank 0 sent for every rank (ranks other than 0): the next
    commit's allgather tells its outcome (``ok``); untold, the rank abstains there and
    ``restore()`` or ``sync()`` ask the scheduler."""

    def __init__(self) -> None:
        self.ok: bool | None = None


def outcome(reply: Any, timeout: float) -> int:
    """Wait for a commit's reply (a future, or :class:`Told`): ``OK``, ``REFUSED`` or
    ``UNKNOWN`` (no reply); ``NONE`` for a commit rank 0 sent whose outcome no
    allgather told yet."""
    if isinstance(reply, Told):
        return NONE if reply.ok is None else (OK if reply.ok else REFUSED)
    try:
        return OK if reply.result(timeout) else REFUSED
    except Exception:  # noqa: BLE001 - a comm error, a timeout: the outcome is unknown
        return UNKNOWN
