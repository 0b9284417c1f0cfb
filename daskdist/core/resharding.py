"""Who holds which shard of a sharded commit, and which rows move where to reshard it.

Pure (no torch, no Dask): :class:`daskdist.collective.sharded.state.ShardedState` runs these
rules on what the ranks report, and the property tests run them exhaustively.

A tensor of ``n`` rows (along the dimension it is split on) is cut over ``world`` ranks
by torch's rule (``torch.chunk``, FSDP2's and DTensor ``Shard``'s): ``ceil(n / world)``
rows each, the last ranks fewer or none (:func:`span`). A commit keeps each rank's own
shard and a copy of its ring predecessor's (:func:`ring`: a rank's copy lives on
another host wherever one can). After losses, :func:`holders` says which survivor
serves each shard (or which are gone), and :func:`routes` which rows each survivor
sends to each rank of the new world; :func:`window` cuts those byte streams into rounds
of bounded size.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

ALIGN = 64  # bytes: every tensor starts at a multiple of this in a shard's flat buffer


def span(n: int, world: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``n`` that shard ``index`` of ``world`` holds."""
    if world < 1 or not 0 <= index < world:
        raise ValueError(f"shard index {index} outside a world of {world}")
    c = -(-n // world)
    return min(index * c, n), min((index + 1) * c, n)


def ring(hosts: Sequence[Hashable]) -> list[int]:
    """The ranks (``hosts[r]`` is rank r's host) in ring order: each copies its shard to
    the next. Ranks of one host are spread apart (the largest host's ranks on every
    other place), so a copy is on another host whenever no host has more than half the
    ranks; one host: plain rank order."""
    groups: dict[Hashable, list[int]] = {}
    for r, h in enumerate(hosts):
        groups.setdefault(h, []).append(r)
    if len(groups) == 1:
        return list(range(len(hosts)))
    ordered = [r for g in sorted(groups.values(), key=lambda g: (-len(g), g[0])) for r in g]
    places = list(range(0, len(hosts), 2)) + list(range(1, len(hosts), 2))
    out = [0] * len(hosts)
    for place, r in zip(places, ordered, strict=True):
        out[place] = r
    return out


def predecessors(order: Sequence[int]) -> dict[int, int]:
    """Rank -> the rank whose shard it keeps a copy of (its predecessor in ``order``);
    a world of one keeps none (it maps to itself)."""
    n = len(order)
    return {order[i]: order[i - 1] for i in range(n)}


def successors(order: Sequence[int]) -> dict[int, int]:
    """Rank -> the rank that keeps a copy of its shard (its successor in ``order``)."""
    n = len(order)
    return {order[i]: order[(i + 1) % n] for i in range(n)}


def holders(held: Mapping[int, Iterable[int]], world: int,
            owners: Mapping[int, int] | None = None) -> tuple[dict[int, int], list[int]]:
    """``held``: rank of the new group -> the shard indices (of a commit made by
    ``world`` ranks) it holds. Returns (index -> the rank that serves it, the indices
    nobody holds). A shard is served by the rank that held it as its own if it survived
    (``owners``: rank -> its own index), else by the lowest rank holding a copy."""
    serve: dict[int, int] = {}
    for rank in sorted(held):
        for i in held[rank]:
            if 0 <= i < world and i not in serve:
                serve[i] = rank
    for rank, own in (owners or {}).items():
        if 0 <= own < world and own in set(held.get(rank, ())):
            serve[own] = rank
    return serve, [i for i in range(world) if i not in serve]


@dataclass(frozen=True)
class Report:
    """What a rank holds at ``sync()``: its commits, the generation and world size its
    copies were cut for (0, 0: none), its own index there and the index of the copy it
    keeps (-1: none)."""

    commits: int
    layout: int
    world: int
    own: int
    peer: int


@dataclass(frozen=True)
class Source:
    """Where ``sync()`` takes the state from: ``"memory"`` (the ranks' copies of commit
    ``commits``, cut by ``world`` ranks in generation ``layout``; ``serve``: index -> the
    rank sending it), ``"checkpoint"`` (checkpoint ``commits``), ``"fresh"`` (no commit
    ever happened) or ``"lost"`` (commits happened, and neither the ranks nor a
    checkpoint hold one; ``missing``: the shard indices nobody holds)."""

    kind: str
    commits: int = 0
    layout: int = 0
    world: int = 0
    serve: Mapping[int, int] | None = None
    missing: tuple[int, ...] = ()


def choose(reports: Sequence[Report], checkpoint: int = 0, known: int = 0,
           tentative: Mapping[int, Report] | None = None) -> Source:
    """Where every rank of the new group takes the state from (``reports[r]``: rank r's;
    ``checkpoint``: the newest complete checkpoint's commit, 0: none; ``known``: commits
    the scheduler recorded of the state, for ranks that hold none). The ranks' newest
    commit when every one of its shards is still held (the newest layout that has them
    all), else the newest checkpoint, else ``"lost"``; a newer checkpoint wins.

    ``tentative``: rank -> what it staged for a commit that failed on it (its copy had
    arrived; the commit's allgather failed there, a peer lost meanwhile). It serves
    shards of that commit only when another rank holds the commit: a commit completes
    on some ranks and fails on others when a member dies inside its allgather.
    ``Source.serve`` then names such a rank too: it sends from what it staged."""
    newest = max((r.commits for r in reports), default=0)
    if checkpoint > newest:
        return Source("checkpoint", checkpoint)
    if newest == 0:
        return Source("lost") if known > 0 else Source("fresh")
    layouts = sorted({(r.layout, r.world) for r in reports if r.commits == newest},
                     reverse=True)
    first_missing: tuple[int, ...] = ()
    staged = tentative or {}
    for layout, world in layouts:
        mine = {rank: r for rank, r in enumerate(reports)
                if r.commits == newest and (r.layout, r.world) == (layout, world)}
        mine.update({rank: r for rank, r in staged.items() if rank not in mine
                     and r.commits == newest and (r.layout, r.world) == (layout, world)})
        held = {rank: [i for i in (r.own, r.peer) if i >= 0] for rank, r in mine.items()}
        serve, missing = holders(held, world, {rank: r.own for rank, r in mine.items()})
        if not missing:
            return Source("memory", newest, layout, world, serve)
        if not first_missing:
            first_missing = tuple(missing)
    if checkpoint > 0:
        return Source("checkpoint", checkpoint)
    return Source("lost", newest, missing=first_missing)


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of tensor ``entry`` (along its split dimension), cut from
    old shard ``index``."""

    entry: int
    index: int
    start: int
    stop: int


def pieces(sizes: Sequence[int], old_world: int, new_world: int, dst: int) -> list[Piece]:
    """What rank ``dst`` of ``new_world`` needs of each tensor (``sizes``: its rows), cut
    at the boundaries of the ``old_world`` shards they come from; tensor by tensor."""
    out = []
    for e, n in enumerate(sizes):
        lo, hi = span(n, new_world, dst)
        if lo >= hi:
            continue
        c = -(-n // old_world)
        for index in range(lo // c, min(old_world, -(-hi // c))):
            a, b = span(n, old_world, index)
            a, b = max(a, lo), min(b, hi)
            if a < b:
                out.append(Piece(e, index, a, b))
    return out


def routes(sizes: Sequence[int], old_world: int, new_world: int,
           serve: Mapping[int, int]) -> dict[tuple[int, int], list[Piece]]:
    """(source rank, destination rank) -> the pieces the source sends the destination, in
    the order both sides stream them (``serve``: old index -> the rank that serves it)."""
    out: dict[tuple[int, int], list[Piece]] = {}
    for dst in range(new_world):
        for p in pieces(sizes, old_world, new_world, dst):
            out.setdefault((serve[p.index], dst), []).append(p)
    return out


def stream_bytes(parts: Sequence[Piece], row_bytes: Sequence[int]) -> int:
    """The bytes of a stream of pieces."""
    return sum((p.stop - p.start) * row_bytes[p.entry] for p in parts)


def window(parts: Sequence[Piece], row_bytes: Sequence[int], lo: int,
           hi: int) -> list[tuple[Piece, int, int]]:
    """The bytes ``[lo, hi)`` of the stream of ``parts``: ``(piece, first, last)`` with
    the piece's own bytes ``[first, last)`` that fall in the window, in stream order."""
    out = []
    at = 0
    for p in parts:
        n = (p.stop - p.start) * row_bytes[p.entry]
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((p, a - at, b - at))
        at += n
        if at >= hi:
            break
    return out


def offsets(sizes: Sequence[int], row_bytes: Sequence[int], world: int,
            index: int) -> tuple[list[int], int]:
    """Where each tensor's rows of shard ``index`` start in that shard's flat buffer
    (each at a multiple of :data:`ALIGN`), and the buffer's length."""
    out, at = [], 0
    for n, rb in zip(sizes, row_bytes, strict=True):
        a, b = span(n, world, index)
        out.append(at)
        at += -(-((b - a) * rb) // ALIGN) * ALIGN
    return out, at


def rounds(total: int, bucket: int) -> int:
    """How many rounds of at most ``bucket`` bytes carry ``total`` bytes (at least 1)."""
    return max(1, -(-total // max(1, bucket)))
