"""The just-in-time commit: what an elastic State does at a commit when members of its
group have a preemption deadline (SPEC §4.6).

A rank whose worker has a deadline within ``daskdist.preemption.horizon`` (read from
its session: :mod:`daskdist.session.preemption`) leaves the group at its next commit.
Its part of the commit's allgather says so (:func:`flag`), so every rank takes the same
decision from the same table (:func:`at_commit`):

- the commit is written durably at once (``checkpoint_to``), unless a leaving rank that
  writes says its write would not end before its deadline (estimated from the last
  write's duration on that rank; none yet: tried). The ranks that write are the State's
  (rank 0 of a replicated State; every rank of a ShardedState, each its part); a
  staying writer writes in the background, a leaving one waits for its write, at most
  until its deadline less ``daskdist.preemption.margin`` (:func:`wait_written`): the
  survivors, who wait for its gang closure to end, never wait on it past its deadline,
  and if it dies mid-write they re-form as on a loss (a write cut off is never loaded);
- every rank raises ``HostsUpdatedInterrupt`` (``skip_sync``: members only left); the
  leaving ranks first make sure the scheduler knows their deadline (:func:`announce`), so
  the group re-forms without them.

When every member leaves (a whole job preempted, or retired) the State's last-holder
checkpoint is written instead. :func:`flag`'s values are the head's ``leaving`` field,
retiring members' (``RETIRING``) among them. What else must act before a worker's deadline (an
asynchronous model's holder handing the global model over first) registers with
:func:`daskdist.session.preemption.on_preemption`, or reads :func:`preemption_now`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from daskdist import config
from daskdist.core.lifetime.deadlines import acting
from daskdist.session.preemption import preemption_now
from daskdist.session.scope import session_services

logger = logging.getLogger(__name__)

# how a rank leaves: its ``CommitHead.leaving`` in a commit's head
STAY, RETIRING, LEAVING, LEAVING_UNWRITTEN = 0, 1, 2, 3


def flag(retiring: bool, writes: bool, estimate: float | None) -> int:
    """This rank's "leaving?" for the commit's head: ``LEAVING`` when its worker's
    deadline is within the horizon (``LEAVING_UNWRITTEN`` when this rank ``writes`` and
    a write taking ``estimate`` seconds would not end before it), else ``RETIRING`` or
    ``STAY``."""
    notice = preemption_now()
    now = time.time()
    if notice is not None and acting(notice.deadline, now, config.seconds("preemption.horizon")):
        margin = config.seconds("preemption.margin")
        if writes and estimate is not None and now + estimate + margin > notice.deadline:
            return LEAVING_UNWRITTEN
        return LEAVING
    return RETIRING if retiring else STAY


class AtCommit(NamedTuple):
    """What a rank does at a commit, the same decision on every rank (but ``wait`` and
    ``leave``, which are the rank's own)."""

    last: bool  # every member leaves: the last holder's checkpoint
    write: bool  # a just-in-time durable write of this commit
    wait: bool  # this rank leaves and writes: wait for the write (until its deadline)
    leave: bool  # this rank leaves the group now (its deadline)
    interrupt: bool  # every rank raises HostsUpdatedInterrupt (members leave)


def at_commit(flags: list[int], rank: int, writes: bool) -> AtCommit:
    """The ranks' flags (in rank order, from the commit's allgather) as this rank's
    :class:`AtCommit`."""
    leaving = [f in (LEAVING, LEAVING_UNWRITTEN) for f in flags]
    last = all(flags)
    write = any(leaving) and LEAVING_UNWRITTEN not in flags and not last
    mine = leaving[rank]
    return AtCommit(last, write, write and writes and mine, mine, any(leaving))


def write_now(durable: Any, commits: int, wait: bool, write: Callable[[], None]) -> None:
    """A just-in-time durable write of the committed copy (``write()``, in the
    background), unless the periodic write of commit ``commits`` runs already (an older
    one still running is waited for first, up to the deadline); ``wait``: this rank
    leaves, so its write first, up to its deadline (:func:`wait_written`)."""
    if not durable.due(commits):
        wait_written(durable.store)
        write()
    if wait:
        wait_written(durable.store)


def wait_written(store: Any) -> None:
    """Wait for the checkpoint write running in ``store`` (a ``CheckpointStore``), at
    most until this rank's deadline less the margin (forever without one); a write not
    done by then goes on, and this rank goes on without it."""
    notice = preemption_now()
    timeout = None
    if notice is not None:
        timeout = max(0.0, notice.deadline - config.seconds("preemption.margin") - time.time())
    try:
        store.wait(timeout)
    except TimeoutError:
        logger.warning("daskdist: the just-in-time checkpoint was not written before the "
                       "preemption deadline less daskdist.preemption.margin; leaving "
                       "without waiting for it")
    except Exception as e:  # noqa: BLE001 - the write failed: logged by its own report
        logger.warning("daskdist: the just-in-time checkpoint failed: %r", e)


def announce() -> None:
    """This rank leaves on its deadline: make sure the scheduler knows it (the group's
    next formation leaves it out)."""
    notice = preemption_now()
    if notice is not None:
        session_services().report_preemption(notice.deadline, notice.reason)
