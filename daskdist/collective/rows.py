"""The scheduler calls elastic state makes from a gang closure's thread (SPEC §4.2).

``commit`` sends one commit (every rank's lease tokens) from rank 0, ``recorded`` asks
whether a commit was applied, ``release`` gives rows back to the pool. Each finds this
worker's daskdist runner (the worker plugin of the closure's coordinator) and calls the
scheduler through it, blocking this thread (never the worker's event loop) until the
reply comes or the comm fails (then the error propagates: the caller treats the commit
as unknown).
"""

from __future__ import annotations

from typing import Any

from daskdist.context import get_worker_context
from daskdist.plugins.leases import _group_tokens


def _runner() -> Any:
    from distributed import Worker

    from daskdist.plugins.worker import _runner as runner_of

    ctx = get_worker_context()
    for w in list(Worker._instances):
        if w.address == ctx.address:
            runner = runner_of(w, ctx.name)
            if runner is not None:
                return runner
    raise RuntimeError(f"no daskdist worker plugin {ctx.name!r} on {ctx.address}")


def commit(generation: int, key: str, tokens: dict[int, list]) -> bool:
    """Rank 0: apply commit ``key`` of ``generation`` (each rank's tokens) atomically."""
    reply = _runner().call("daskdist_gang_commit", generation=int(generation), key=key,
                           tokens={int(r): list(t) for r, t in tokens.items()})
    return bool(reply)


def recorded(key: str) -> bool:
    """Whether the scheduler applied commit ``key``."""
    return bool(_runner().call("daskdist_commit_outcome", key=key))


def release(tokens: list) -> int:
    """Give the rows of ``tokens`` back to the pool (only rows leased to this session
    move; acknowledged rows stay acknowledged). Rows freed."""
    groups = _group_tokens(tokens)
    if not groups:
        return 0
    runner = _runner()
    return sum(
        runner.call("daskdist_lease_release", session=runner.session, dataset_id=ds,
                    epoch=int(epoch), ranges=[(int(a), int(b)) for a, b in ranges])
        for (ds, epoch), ranges in groups.items()
    )
