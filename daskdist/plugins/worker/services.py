"""SessionServices: the scheduler calls made on behalf of one worker session.

TensorFlow hands a closure its ``coordinator_context``; daskdist hands each closure
(through :func:`daskdist.context.session_services`) and each per-worker resource built
for a session (``InputContext.leases``) the services of the session it belongs to:
lease acquire, progress and release for the ``"dynamic"`` policy, commit parts and
commit outcomes for elastic state. Every call names that session, so once the session
ended (the scheduler fenced it, or the plugin was torn down) its calls are refused, here
at once and by the scheduler for any already on the way. Data and collective code
never import the worker plugin: they only see this object.

Calls come from closure and producer threads, never the worker's event loop; each
blocks its thread until the scheduler replies (or the comm fails).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from distributed.utils import sync

from daskdist.core.leases import group_tokens
from daskdist.core.protocol import CommitKey, LeaseToken
from daskdist.errors import CollectiveError

Interval = tuple[int, int]


class SessionServices:
    """The scheduler services of one worker session (any thread but the event loop)."""

    def __init__(self, worker: Any, name: str, session: str) -> None:
        self.worker = worker
        self.name = name
        self.session = session
        self.ended = False

    def end(self) -> None:
        """The session ended: every later call is refused without asking the scheduler."""
        self.ended = True

    def _call(self, op: str, **kwargs: Any) -> Any:
        return sync(self.worker.loop, getattr(self.worker.scheduler, op), name=self.name,
                    session=self.session, **kwargs)

    def _ended_error(self) -> CollectiveError:
        # a membership change for elastic state: the gang runs again on a new group
        return CollectiveError(f"worker {self.worker.address} session {self.session[:8]} "
                               f"of coordinator {self.name!r} ended")

    # -- the dynamic policy's lease service (data.dynamic.LeaseService) ------------------
    def acquire(self, dataset_id: str, epoch: int,
                unit_rows: list[int]) -> tuple[int, list[Interval]] | None:
        """Lease the next unit with free rows; ``None`` when none is free now or the
        session ended (its loaders are being closed)."""
        if self.ended:
            return None
        reply = self._call("daskdist_lease_acquire", dataset_id=dataset_id, epoch=int(epoch),
                           unit_rows=[int(n) for n in unit_rows])
        lease = reply.get("lease")
        if lease is None:
            return None
        return int(lease[0]), [(int(a), int(b)) for a, b in lease[1]]

    def progress(self, dataset_id: str, epoch: int, unit_rows: list[int] | None = None) -> dict:
        return sync(self.worker.loop, self.worker.scheduler.daskdist_lease_progress,
                    name=self.name, dataset_id=dataset_id, epoch=int(epoch),
                    unit_rows=None if unit_rows is None else list(unit_rows))

    def release(self, dataset_id: str, epoch: int, ranges: list) -> int:
        """Give back rows leased to this session that no closure consumed; rows freed."""
        return self.release_tokens([LeaseToken.of(dataset_id, epoch, ranges)])

    def release_tokens(self, tokens: list) -> int:
        """Give the rows of lease tokens back to the pool: only rows leased to this
        session move, acknowledged rows stay acknowledged. The one release path of the
        worker side. Rows freed."""
        groups = group_tokens(tokens)
        if not groups or self.ended:
            return 0
        return sum(
            self._call("daskdist_lease_release", dataset_id=ds, epoch=int(epoch),
                       ranges=[(int(a), int(b)) for a, b in ranges])
            for (ds, epoch), ranges in groups.items())

    # -- elastic commits (collective.elastic) ----------------------------------------
    def send_commit_part(self, key: CommitKey, rank: int, world: int, tokens: list,
                         timeout: float) -> concurrent.futures.Future:
        """Send this rank's part of commit ``key`` without waiting: a future of the
        commit's outcome (``True``: applied)."""
        if self.ended:
            raise self._ended_error()
        coro = self.worker.scheduler.daskdist_gang_commit_part(
            name=self.name, session=self.session, key=list(key), rank=int(rank),
            world=int(world), tokens=list(tokens), timeout=float(timeout))
        return asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop)

    def commit_outcome(self, key: CommitKey) -> bool:
        """Whether the scheduler applied commit ``key`` (deciding it, if still open)."""
        if self.ended:
            raise self._ended_error()
        return bool(self._call("daskdist_commit_outcome", key=list(key)))

    def state_commits(self, state: str, committed: bool = False) -> int:
        """How many commits of State ``state`` the scheduler knows of; ``committed``
        reports one more (a State's first plain commit on this rank)."""
        if self.ended:
            raise self._ended_error()
        return int(self._call("daskdist_state_commits", state=state, committed=committed))

    # -- durable commits (collective.checkpoint) ---------------------------------------
    @property
    def leaving(self) -> bool:
        """This worker is leaving: retiring, closing, or told to leave (a preemption
        notice). A State checkpoints the commit it leaves at when no member stays."""
        return self.worker.status.name in ("closing_gracefully", "closing", "closed")

    def dataset_ledger(self, state: str) -> dict:
        """The ledger of State ``state``'s ``"dynamic"`` datasets as the scheduler holds
        it now, by dataset name: epoch, acknowledged rows, seed, rows and units."""
        if self.ended:
            raise self._ended_error()
        return self._call("daskdist_dataset_ledger", state=state)

    def restore_ledger(self, state: str, ledger: dict) -> None:
        """A State resumed from a checkpoint: its datasets' epochs go on from ``ledger``
        (rows it acknowledged stay acknowledged, every other row is delivered again)."""
        if self.ended:
            raise self._ended_error()
        self._call("daskdist_restore_ledger", state=state, ledger=ledger)

    def checkpoint_written(self, state: str, url: str, commits: int, seconds: float,
                           nbytes: int) -> None:
        """Report a complete checkpoint (the dashboard and metrics show the newest)."""
        if not self.ended:
            self._call("daskdist_checkpoint_written", state=state, url=url,
                       commits=int(commits), seconds=float(seconds), nbytes=int(nbytes))
