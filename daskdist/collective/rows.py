"""The scheduler calls elastic state makes from a gang closure's thread (SPEC §4.2).

``send_part`` sends this rank's part of a commit without waiting (a future of the
commit's outcome), ``recorded`` asks whether a commit was applied, ``release`` gives
rows back to the pool. Each finds this worker's daskdist runner (the worker plugin of
the closure's coordinator) and calls the scheduler on the worker's event loop;
``recorded`` and ``release`` block this thread (never the loop) until the reply comes or
the comm fails (then the error propagates: the caller treats the commit as unknown).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from daskdist.context import get_worker_context
from daskdist.errors import CollectiveError
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
    # the plugin was torn down (the worker is retiring or closing): a membership change
    raise CollectiveError(f"worker {ctx.address} left coordinator {ctx.name!r}")


def send_part(generation: int, key: str, rank: int, world: int, tokens: list,
              timeout: float) -> concurrent.futures.Future:
    """Send this rank's part of commit ``key``; a future of the commit's outcome."""
    runner = _runner()
    coro = runner.worker.scheduler.daskdist_gang_commit_part(
        name=runner.name, generation=int(generation), key=key, rank=int(rank),
        world=int(world), tokens=list(tokens), timeout=float(timeout))
    return asyncio.run_coroutine_threadsafe(coro, runner.worker.loop.asyncio_loop)


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
