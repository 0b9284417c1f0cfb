"""Row acknowledgement at commit granularity (SPEC §4.2), as pure bookkeeping.

In synchronous training a gang closure consumes many batches; the committed model has
trained on exactly the rows consumed up to its last ``State.commit()``. So, with a
``"dynamic"`` dataset inside a gang, rows are acknowledged by commits, not by the
closure's end:

- Every rank keeps the lease tokens it consumed since its last commit (in its closure's
  token list). At ``commit()`` the ranks gather their tokens to rank 0, which sends ONE
  commit message naming the generation, the commit's key and each rank's tokens.
- :class:`CommitBook` (scheduler side) applies it atomically: every rank's session must
  be a live member of that generation and every token's rows still leased to that
  session, else nothing changes. An applied commit's key is recorded.
- :class:`RankLedger` (rank side) holds the commit in flight: its key and tokens. Once
  the outcome is broadcast the new state is promoted (recorded) or the tokens go back
  to the closure's list (refused). If the broadcast never comes (a member died
  mid-commit), the next ``sync()`` asks the book whether the key was recorded.
- Rows never acknowledged go back to the pool: a gang member's closure releases (never
  acknowledges) the tokens left in its list when it ends; ``restore()`` releases the
  tokens since the last commit at once; a lost member's leases are dropped with it.

Releasing rows that a recorded commit acknowledged changes nothing (only leased rows
move), so a rank unsure of an outcome may always give its tokens back.
No Dask, torch or I/O here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from daskdist.plugins.leases import LeaseTable, _group_tokens

__all__ = ["CommitBook", "RankLedger", "ack_all", "commit_key"]


def commit_key(generation: int, number: int) -> str:
    """The key of commit ``number`` of a state trained on group ``generation``."""
    return f"{int(generation)}:{int(number)}"


def ack_all(table: LeaseTable, per_session: Mapping[str, Iterable[Any]]) -> bool:
    """Acknowledge every session's lease tokens, all or nothing (``False``: no change)."""
    found = []
    for session, tokens in per_session.items():
        if table.is_expired(session):
            return False
        for (dataset_id, epoch), ranges in _group_tokens(tokens).items():
            pieces = table._leased_pieces(session, dataset_id, epoch, ranges)
            if pieces is None:
                return False
            found.append((session, pieces))
    for session, (ep, per_unit) in found:
        table._acknowledge(session, ep, per_unit)
    return True


@dataclass
class CommitBook:
    """The scheduler's record of applied commits (bounded: the newest ``keep`` keys)."""

    keep: int = 4096
    recorded: OrderedDict = field(default_factory=OrderedDict)

    def apply(self, table: LeaseTable, key: str, sessions: Mapping[int, str | None],
              tokens: Mapping[int, Iterable[Any]], live: set[str]) -> bool:
        """Apply commit ``key``: ``sessions`` maps every rank of its generation to its
        session (``None``: unknown); ``tokens`` each rank's tokens. Applied only when
        every session is live and every row leased to it; then ``key`` is recorded.
        A key already recorded is not applied twice (``True``)."""
        if key in self.recorded:
            return True
        if any(s is None or s not in live for s in sessions.values()):
            return False
        if any(r not in sessions for r in tokens):
            return False
        per_session = {sessions[r]: list(t) for r, t in tokens.items() if t}
        if not ack_all(table, per_session):
            return False
        self.recorded[key] = True
        while len(self.recorded) > self.keep:
            self.recorded.popitem(last=False)
        return True

    def outcome(self, key: str) -> bool:
        """Whether commit ``key`` was applied."""
        return key in self.recorded


@dataclass
class RankLedger:
    """One rank's commit in flight: its key, its tokens and the state it would commit."""

    key: str | None = None
    tokens: list = field(default_factory=list)
    state: Any = None

    def begin(self, key: str, tokens: Iterable[Any], state: Any) -> None:
        self.key, self.tokens, self.state = key, list(tokens), state

    def settle(self, recorded: bool) -> tuple[Any, list]:
        """The outcome is known: ``(state to promote or None, tokens to give back)``."""
        state, tokens = (self.state, []) if recorded else (None, self.tokens)
        self.key, self.tokens, self.state = None, [], None
        return state, tokens

    @property
    def in_flight(self) -> bool:
        return self.key is not None
