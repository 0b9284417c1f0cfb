"""What the Lightning and Hugging Face adapters share (SPEC §4.4): the per-worker
``State`` of a user's module, the lease tokens of batches a framework fetched ahead of
training, one state_dict for several optimizers and schedulers, DDP's gradient
allreduce routed through daskdist's group, and a peer's loss seen inside a framework's
own collective calls turned into ``CollectiveError`` (so the gang runs again).

Runs inside gang closures on workers (imports torch, never lightning or transformers).
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from daskdist.collective.bootstrap import PROCESS
from daskdist.collective.group import Group
from daskdist.collective.state.elastic import State
from daskdist.errors import CollectiveError, HostsUpdatedInterrupt
from daskdist.session.resources import resource_id
from daskdist.session.scope import minting, session_services
from daskdist.session.tokens import consumed_mark, drop_aside, set_aside, take_back

logger = logging.getLogger(__name__)

# the attribute a module keeps its State in (collected with it): an adapter that
# rebuilds a module's ``__dict__`` keeps it (``lightning_sharded``)
STATE_ATTR = "_daskdist_state"


def kept_state(owner: Any) -> State | None:
    """The ``State`` :func:`state_for` keeps for ``owner``, or ``None`` if none yet."""
    return owner.__dict__.get(STATE_ATTR)


def state_for(owner: Any, label: str, make: Callable[[], State]) -> State:
    """The elastic ``State`` kept for ``owner`` (the user's module) on this worker, made by
    ``make`` the first time.

    Its id is named after ``owner``'s per-worker resource id, so every rank, a
    replacement worker and every later gang (another ``schedule_on_all`` of the driver's
    loop) name it alike: its commits meet, and ``sync()`` finds the holder. A module that
    is not a per-worker resource (built inside the gang closure) gets a State that lives
    for one run of the gang, as a ``State`` made there does.
    """
    state = kept_state(owner)
    if state is not None:
        return state
    rid = resource_id(owner)
    if rid is None:
        logger.warning(
            "daskdist: %s is not a per-worker resource: its committed state lives for one "
            "run of the gang closure (make it with coord.create_per_worker_resource)",
            type(owner).__name__)
        state = make()
    else:
        with minting(f"{rid}/{label}"):
            state = make()
    owner.__dict__[STATE_ATTR] = state  # plain attribute: no nn.Module registration
    return state


class Optimizers:
    """A trainer's optimizers and LR schedulers as one ``state_dict`` (what ``State``
    keeps as its ``optimizer``): a fit makes new ones, the State's copy outlives them."""

    def __init__(self, optimizers: Iterable[Any] = (), schedulers: Iterable[Any] = ()):
        self.optimizers = list(optimizers)
        self.schedulers = list(schedulers)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, sd: dict) -> None:
        for o, s in zip(self.optimizers, sd.get("optimizers", []), strict=False):
            o.load_state_dict(s)
        for sch, s in zip(self.schedulers, sd.get("schedulers", []), strict=False):
            sch.load_state_dict(s)


class TokenHold:
    """Lease tokens of batches fetched but not yet trained.

    Lightning's data fetcher and Accelerate's loaders fetch one batch ahead; a commit at
    the end of step k must acknowledge the rows of steps up to k, never those of the
    batch already fetched for step k+1. :meth:`wrap` takes each batch's tokens out of
    the closure's list as it is fetched; :meth:`started` hands the oldest batch's
    tokens back when its training begins (the next commit acknowledges them);
    :meth:`release` gives back the rows of batches never trained. One closure thread
    owns it.
    """

    def __init__(self) -> None:
        self._pending: collections.deque[list] = collections.deque()

    def wrap(self, iterable: Iterable) -> Iterator:
        it = iter(iterable)
        while True:
            mark = consumed_mark()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._pending.append(set_aside(mark))
            yield batch

    def started(self) -> None:
        """The oldest fetched batch begins training."""
        if self._pending:
            take_back(self._pending.popleft())

    def release(self) -> None:
        """Batches fetched and never trained: their rows go back to the pool."""
        back = [t for tokens in self._pending for t in tokens]
        self._pending.clear()
        drop_aside(back)
        if back:
            session_services().release_tokens(back)


class GroupHook:
    """A DDP communication hook that averages each gradient bucket with daskdist's
    group (:meth:`Group.allreduce`) instead of DDP's own call: a lost peer or a failed
    rank wakes it at once, and its error is ``CollectiveError``. Blocking: small and
    CPU models have one bucket, reduced at the end of backward either way."""

    def __init__(self, group: Group):
        self.group = group
        self.error: BaseException | None = None  # the hook's failure, for failures()

    def reduce(self, bucket: Any) -> torch.futures.Future:
        t = bucket.buffer()
        try:
            self.group.allreduce(t, op="mean")
        except BaseException as e:
            self.error = e
            raise
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(t)
        return fut

    def install(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(state=self, hook=_group_hook)


def disarm(model: Any) -> None:
    """Remove the autograd hooks of ``model``'s DDP reducer (no-op for other modules).

    A run that ended (a commit's interrupt, a lost peer mid-backward) may leave its DDP
    wrapper alive for a while (the exception's traceback holds it) with hooks on the
    user's parameters: the next run's backward would fire them in the stale reducer."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model._remove_autograd_hooks()


def _group_hook(state, bucket):  # no annotations: DDP checks them against its own types
    return state.reduce(bucket)


# How a gloo call that lost its peer fails: a plain RuntimeError naming gloo's transport.
_TRANSPORT_FAILURES = ("gloo/transport", "Connection closed by peer",
                       "Connection reset by peer")


@contextlib.contextmanager
def failures(group: Group,
             hook: Callable[[], GroupHook | None] = lambda: None) -> Iterator[None]:
    """Inside, a framework's own collective call (DDP, Accelerate) that failed because a
    peer was lost raises ``CollectiveError`` (the gang runs again on a re-formed group),
    and the group is marked broken; other errors pass unchanged (the gang fails).
    ``hook()``: the fit's :class:`GroupHook`, whose own error is the one to raise."""
    try:
        yield
    except (CollectiveError, HostsUpdatedInterrupt):
        raise
    except Exception as e:
        cause = _collective_cause(e, group, hook())
        if cause is None:
            raise
        PROCESS.break_group(group.generation, f"{type(e).__name__}: {e}")
        if isinstance(cause, CollectiveError):
            raise cause from e
        raise CollectiveError(
            f"a collective call of the training loop failed on rank {group.rank} of "
            f"generation {group.generation}: {e}") from e


def _collective_cause(e: BaseException, group: Group,
                      hook: GroupHook | None) -> BaseException | None:
    """Why ``e`` is a collective failure (the error to raise), or ``None`` if it is not."""
    if hook is not None and hook.error is not None:
        return hook.error
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:  # the chain: a hook's error, re-raised
        seen.add(id(x))
        if isinstance(x, CollectiveError):
            return x
        if isinstance(x, dist.DistError):
            return e
        x = x.__cause__ or x.__context__
    m = PROCESS.current()
    if m is None or m.generation != group.generation or m.broken or \
            PROCESS.is_lost(group.generation):
        return e  # the group of this run is gone: whatever failed, a re-run may not
    text = str(e)
    if any(s in text for s in _TRANSPORT_FAILURES):
        return e
    return None


def rank_device(group: Group) -> torch.device:
    """The device this member trains on: the one its group was formed with (the
    worker's own GPU, else the CPU)."""
    return torch.device(group.device)


def committed_state(owner: Any, label: str) -> State:
    """The ``State`` adapter ``label`` (``"lightning"``, ``"transformers"``) keeps for
    ``owner`` (the per-worker module) on this worker: ``sync()`` it in a gang closure to
    read the newest commit. On a worker that ran no fit with it (one that joined after
    the last), a State of the same id, which ``sync()`` fills from a holder."""
    return state_for(owner, label, lambda: State(model=owner, optimizer=Optimizers(),
                                                 global_step=0))
