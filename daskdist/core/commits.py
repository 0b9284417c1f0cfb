"""Row acknowledgement at commit granularity (SPEC §4.2), as pure bookkeeping.

In synchronous training a gang closure consumes many batches; the committed model has
trained on exactly the rows consumed up to its last ``State.commit()``. So, with a
``"dynamic"`` dataset inside a gang, rows are acknowledged by commits, not by the
closure's end:

- Every rank keeps the lease tokens it consumed since its last commit (in its closure's
  token list). At ``commit()``, once every rank reached it (the commit's allgather),
  each rank sends its part of the commit (the commit's key, its rank, the world size
  and its tokens) without waiting for the reply: the step goes on.
- :class:`CommitBook` (scheduler side) collects the parts of a key and applies the
  commit when all have come, atomically: every rank's session must be a live member of
  the generation and every token's rows still leased to it, else nothing changes. The
  outcome is recorded (applied or refused); a member's loss refuses the open commits.
- :class:`RankLedger` (rank side) holds the commit in flight: its key, its tokens, the
  state it would commit and the reply to wait for. At the next commit every rank puts
  its view of the outcome in the commit's allgather, so all ranks take the same
  decision: promote the state, or (refused, or unknown on any rank) raise and leave it
  to ``sync()``, which asks the book whether the key was applied.
- Rows never acknowledged go back to the pool: a gang member's closure releases (never
  acknowledges) the tokens left in its list when it ends; ``restore()`` releases the
  tokens since the last commit at once; a refused commit's tokens are released; a lost
  member's leases are dropped with it.

Releasing rows that an applied commit acknowledged changes nothing (only leased rows
move), so a rank unsure of an outcome may always give its tokens back.
No Dask, torch or I/O here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from daskdist.core.leases import LeaseTable

__all__ = ["CommitBook", "RankLedger", "commit_key"]


def commit_key(generation: int, number: int) -> str:
    """The key of commit ``number`` of a state trained on group ``generation``."""
    return f"{int(generation)}:{int(number)}"


@dataclass
class CommitBook:
    """The scheduler's record of commits: open ones (parts so far) and decided ones
    (applied or refused; bounded: the newest ``keep`` keys)."""

    keep: int = 4096
    recorded: OrderedDict = field(default_factory=OrderedDict)  # key -> applied?
    open: dict = field(default_factory=dict)  # key -> {rank: tokens}

    def apply(self, table: LeaseTable, key: str, sessions: Mapping[int, str | None],
              tokens: Mapping[int, Iterable[Any]], live: set[str]) -> bool:
        """Decide commit ``key``: ``sessions`` maps every rank of its generation to its
        session (``None``: unknown); ``tokens`` each rank's tokens. Applied only when
        every session is live and every row leased to it. A decided key keeps its
        outcome (never applied twice)."""
        if key in self.recorded:
            return self.recorded[key]
        ok = (all(s is not None and s in live for s in sessions.values())
              and all(r in sessions for r in tokens)
              and table.ack_sessions({sessions[r]: list(t) for r, t in tokens.items() if t}))
        self._record(key, ok)
        return ok

    def add_part(self, table: LeaseTable, key: str, rank: int, world: int,
                 tokens: Iterable[Any], sessions: Mapping[int, str | None] | None,
                 live: set[str]) -> bool | None:
        """Rank ``rank``'s part of commit ``key`` (of ``world`` ranks): the outcome once
        every part came (``None`` until then). ``sessions`` is the generation's rank ->
        session map, ``None`` when the generation is no longer the current one (the
        commit is refused)."""
        if key in self.recorded:
            return self.recorded[key]
        if sessions is None or len(sessions) != world:
            self.open.pop(key, None)
            self._record(key, False)
            return False
        parts = self.open.setdefault(key, {})
        parts[int(rank)] = list(tokens)
        if len(parts) < world:
            return None
        del self.open[key]
        return self.apply(table, key, sessions, parts, live)

    def abort_open(self) -> list[str]:
        """A member left: every open commit is refused. Returns their keys."""
        keys = list(self.open)
        self.open.clear()
        for key in keys:
            self._record(key, False)
        return keys

    def _record(self, key: str, ok: bool) -> None:
        self.recorded[key] = ok
        while len(self.recorded) > self.keep:
            self.recorded.popitem(last=False)

    def outcome(self, key: str) -> bool:
        """Whether commit ``key`` was applied."""
        return bool(self.recorded.get(key, False))


@dataclass
class RankLedger:
    """One rank's commit in flight: its key, its tokens, the state it would commit, and
    the scheduler's reply to wait for (any object with ``result(timeout)``)."""

    key: str | None = None
    tokens: list = field(default_factory=list)
    state: Any = None
    reply: Any = None

    def begin(self, key: str, tokens: Iterable[Any], state: Any, reply: Any = None) -> None:
        self.key, self.tokens, self.state, self.reply = key, list(tokens), state, reply

    def settle(self, recorded: bool) -> tuple[Any, list]:
        """The outcome is known: ``(state to promote or None, tokens to give back)``."""
        state, tokens = (self.state, []) if recorded else (None, self.tokens)
        self.key, self.tokens, self.state, self.reply = None, [], None, None
        return state, tokens

    @property
    def in_flight(self) -> bool:
        return self.key is not None
