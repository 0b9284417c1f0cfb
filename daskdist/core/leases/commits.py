"""Row acknowledgement at commit granularity (SPEC §4.2), as pure bookkeeping.

In synchronous training a gang closure consumes many batches; the committed model has
trained on exactly the rows consumed up to its last ``State.commit()``. So, with a
``"dynamic"`` dataset inside a gang, rows are acknowledged by commits, not by the
closure's end:

- Every rank keeps the lease tokens it consumed since its last commit (in its closure's
  token list). At ``commit()``, once every rank reached it (the commit's allgather),
  each rank sends its part of the commit (the commit's key, its rank, the world size
  and its tokens) without waiting for the reply: the step goes on.
- A commit's key (:class:`~daskdist.core.protocol.CommitKey`) names the State (an id
  every rank and every replacement mints alike), the group generation and a counter the
  ranks agree on at each commit and never reuse, a refused commit's included: a second
  State on the same group, or the same State going on after a refusal, never meets an
  old key's outcome.
- :class:`CommitBook` (scheduler side) collects the parts of a key and applies the
  commit when all have come, atomically: every rank's session must be a live member of
  the generation and every token's rows still leased to it, else nothing changes. Every
  key ends with a definite outcome, recorded (applied or refused): a member's loss
  refuses the open commits; so does the group timeout passing before every part came,
  and a rank asking about a key still open (:meth:`CommitBook.expire`). A part that
  comes after its key was decided gets that outcome and changes nothing.
- :class:`RankLedger` (rank side) holds the commit in flight: its key, its tokens, the
  state it would commit and the reply to wait for. At the next commit every rank puts
  its view of the outcome in the commit's allgather, so all ranks take the same
  decision: promote the state, or (refused, or unknown on any rank) raise and leave it
  to ``restore()`` or ``sync()``, which ask the book for the key's outcome.
- Rows never acknowledged go back to the pool: a gang member's closure releases (never
  acknowledges) the tokens left in its list when it ends; ``restore()`` releases the
  tokens since the last commit at once; a refused commit's tokens are released; a lost
  member's leases are dropped with it.
- The book also remembers which States committed (:meth:`CommitBook.committed`), so
  ``sync()`` on members that hold no commit can tell a fresh start from a lost state.

Releasing rows that an applied commit acknowledged changes nothing (only leased rows
move), so a rank unsure of an outcome may always give its tokens back.
No Dask, torch or I/O here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from daskdist.core.intervals import normalize
from daskdist.core.leases.table import group_tokens
from daskdist.core.protocol import CommitKey, dataset_key

__all__ = ["CommitBook", "RankLedger", "pack_tokens", "unpack_part", "unpack_parts"]


def pack_tokens(tokens: Iterable[Any]) -> list[int] | None:
    """One rank's lease tokens as int64s for the commit's allgather: per epoch table,
    ``[dataset_key(id), epoch, n, a1, b1, ..., an, bn]`` (its rows as ``n`` sorted,
    disjoint intervals). ``None`` for a malformed lease token (the rank sends its part
    itself then, and the scheduler refuses it)."""
    try:
        groups = group_tokens(tokens)
    except ValueError:
        return None
    out: list[int] = []
    for (dataset_id, epoch), ranges in groups.items():
        pieces = normalize(ranges)
        out += (dataset_key(dataset_id), epoch, len(pieces))
        for a, b in pieces:
            out += (a, b)
    return out


def unpack_part(ints: Sequence[int],
                dataset_of: Callable[[int], str | None]) -> dict[tuple[str, int], list]:
    """A rank's :func:`pack_tokens` ints back as its rows grouped by epoch table (as
    :func:`~daskdist.core.leases.table.group_tokens` gives them), each dataset key named by
    ``dataset_of``; ``ValueError`` if malformed or a key names no dataset."""
    groups: dict[tuple[str, int], list] = {}
    i, end = 0, len(ints)
    while i < end:
        if i + 3 > end:
            raise ValueError(f"a packed part ends inside a table header at {i}")
        key, epoch, n = ints[i], ints[i + 1], ints[i + 2]
        if type(key) is not int or type(epoch) is not int or type(n) is not int or n < 1:
            raise ValueError(f"a packed part's table header at {i} is malformed")
        stop = i + 3 + 2 * n
        if stop > end:
            raise ValueError(f"a packed part's table at {i} holds fewer than {n} intervals")
        flat = ints[i + 3:stop]
        if not all(type(v) is int for v in flat):
            raise ValueError(f"a packed part's intervals at {i} are not integers")
        groups.setdefault((_named(dataset_of, key), epoch), []).extend(
            zip(flat[::2], flat[1::2], strict=True))
        i = stop
    return groups


def unpack_parts(parts: Sequence[Sequence[int]], sessions: Sequence[str],
                 dataset_of: Callable[[int], str | None]) -> dict[tuple[str, int], list]:
    """Every rank's :func:`pack_tokens` ints (``parts``, in rank order) as the lease
    table's :meth:`~daskdist.core.leases.table.LeaseTable.ack_tables` takes them: per epoch
    table, ``(session, rows)`` of each rank that read from it, ``sessions`` naming the
    ranks. ``ValueError`` if there is not one part per rank, or one is malformed.

    A rank's usual part (one table, one run of rows: its batches since the last commit)
    is read at once, its table's list found again without a lookup while the ranks
    share it, so a thousand-rank step costs a few dict and list operations a rank."""
    if len(parts) != len(sessions):
        raise ValueError(f"{len(parts)} packed parts for a group of {len(sessions)} ranks")
    tables: dict[tuple[str, int], list] = {}
    last_key = last_epoch = None
    last: list = []
    for session, ints in zip(sessions, parts, strict=True):
        if not ints:
            continue
        if len(ints) == 5:
            key, epoch, n, a, b = ints
            if (type(n) is int and n == 1 and type(key) is int and type(epoch) is int
                    and type(a) is int and type(b) is int):
                if key != last_key or epoch != last_epoch:
                    last = tables.setdefault((_named(dataset_of, key), epoch), [])
                    last_key, last_epoch = key, epoch
                last.append((session, ((a, b),)))
                continue
        for table, ranges in unpack_part(ints, dataset_of).items():
            tables.setdefault(table, []).append((session, ranges))
    return tables


def _named(dataset_of: Callable[[int], str | None], key: int) -> str:
    dataset_id = dataset_of(key)
    if dataset_id is None:
        raise ValueError(f"a packed part names dataset key {key}, defined nowhere here")
    return dataset_id


class Acknowledger(Protocol):
    """What a commit acknowledges its rows in: a
    :class:`~daskdist.core.leases.table.LeaseTable`, or a coordinator that routes to one."""

    def ack_sessions(self, per_session: Mapping[str, Iterable[object]]) -> bool: ...

    def ack_tables(self, tables: Mapping[tuple[str, int],
                                         Sequence[tuple[str, Sequence]]]) -> bool: ...


@dataclass
class CommitBook:
    """The scheduler's record of commits: open ones (parts so far), decided ones
    (applied or refused; bounded: the newest ``keep`` keys) and the States that
    committed (bounded alike)."""

    keep: int = 4096
    recorded: OrderedDict = field(default_factory=OrderedDict)  # CommitKey -> applied?
    open: dict = field(default_factory=dict)  # CommitKey -> {rank: tokens}
    states: OrderedDict = field(default_factory=OrderedDict)  # state id -> commits known

    def add_part(self, table: Acknowledger, key: CommitKey, rank: int, world: int,
                 tokens: Iterable[Any], sessions: Sequence[str] | None,
                 live: Container[str]) -> bool | None:
        """Rank ``rank``'s part of commit ``key`` (of ``world`` ranks): the outcome once
        every part came (``None`` until then). ``sessions`` is the generation's sessions
        in rank order, ``None`` when the generation is no longer the current one or the
        part is not from its rank's session (the commit is refused). A decided key keeps
        its outcome (never applied twice). O(1) per part, O(world) once per commit."""
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
        ok = (all(s in live for s in sessions)
              and all(0 <= r < world for r in parts)
              and table.ack_sessions({sessions[r]: t for r, t in parts.items() if t}))
        self._record(key, ok)
        if ok:
            self.note_committed(key.state)
        return ok

    def add_all(self, table: Acknowledger, key: CommitKey, world: int,
                tables: Mapping[tuple[str, int], Sequence[tuple[str, Sequence]]],
                sessions: Sequence[str] | None, live: Container[str]) -> bool:
        """Every rank's part of commit ``key`` at once (``tables``: per epoch table, the
        ``(session, rows)`` of each rank that read from it, as :func:`unpack_parts`
        gives them from one part per rank): the outcome, decided now (applied only if
        ``sessions``, the generation's ranks, are the current ones, ``world`` of them,
        all live, and every row still leased to its rank's session). O(parts)."""
        if key in self.recorded:
            return self.recorded[key]
        self.open.pop(key, None)
        ok = (sessions is not None and len(sessions) == world
              and all(s in live for s in sessions)
              and table.ack_tables(tables))
        self._record(key, ok)
        if ok:
            self.note_committed(key.state)
        return ok

    def expire(self, key: CommitKey) -> bool:
        """The outcome of ``key``, deciding it now if it is still undecided: a commit
        whose parts did not all come (within the group timeout, or before a rank needed
        its outcome) is refused, so a part that comes later changes nothing."""
        if key not in self.recorded:
            self.open.pop(key, None)
            self._record(key, False)
        return self.recorded[key]

    def abort_open(self) -> list[CommitKey]:
        """A member left: every open commit is refused. Returns their keys."""
        keys = list(self.open)
        self.open.clear()
        for key in keys:
            self._record(key, False)
        return keys

    def note_committed(self, state: str) -> None:
        """State ``state`` made a commit (applied here, or a plain one it reported)."""
        self.states[state] = self.states.pop(state, 0) + 1
        while len(self.states) > self.keep:
            self.states.popitem(last=False)

    def committed(self, state: str) -> int:
        """How many commits of State ``state`` this book knows of (0: none happened)."""
        return self.states.get(state, 0)

    def _record(self, key: CommitKey, ok: bool) -> None:
        self.recorded[key] = ok
        while len(self.recorded) > self.keep:
            self.recorded.popitem(last=False)


@dataclass
class RankLedger:
    """One rank's commit in flight: its key, its tokens, the state it would commit, and
    the scheduler's reply to wait for (any object with ``result(timeout)``)."""

    key: CommitKey | None = None
    tokens: list = field(default_factory=list)
    state: Any = None
    reply: Any = None

    def begin(self, key: CommitKey, tokens: Iterable[Any], state: Any,
              reply: Any = None) -> None:
        self.key, self.tokens, self.state, self.reply = key, list(tokens), state, reply

    def settle(self, recorded: bool) -> tuple[Any, list]:
        """The outcome is known: ``(state to promote or None, tokens to give back)``."""
        state, tokens = (self.state, []) if recorded else (None, self.tokens)
        self.key, self.tokens, self.state, self.reply = None, [], None, None
        return state, tokens

    @property
    def in_flight(self) -> bool:
        return self.key is not None
