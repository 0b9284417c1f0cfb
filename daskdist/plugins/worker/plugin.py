"""CoordinatorWorkerPlugin: the worker side of one named coordinator.

The scheduler plugin registers one on every present and future worker (by reference,
:class:`daskdist.plugins.PluginRef`). Its setup starts a :class:`ClosureRunner` and
installs the stream and RPC handlers the scheduler side calls: wake, steal, hold,
release and leaving for the runner, and the confirmation of a session it registers;
peer-lost, membership and the collective actions (store, init, destroy) for this
process's collective group. A broken group's word (peer-lost) also comes from a peer,
which passes it down the tree the group's init drew (:func:`_pass_on`). torch is
imported only by those actions. The first one in a worker process turns SIGTERM into
a graceful leave (:mod:`.preemption`) and starts the worker's deadline watch
(:mod:`.deadlines`: what tells closures and the scheduler when it will be taken away).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed.comm.addressing import get_address_host
from distributed.comm.core import CommClosedError
from distributed.diagnostics.plugin import WorkerPlugin

from daskdist.core import checks
from daskdist.core.protocol import Preemption, worker_plugin_name
from daskdist.observe.recorder import gang_stack
from daskdist.plugins import devices
from daskdist.plugins.worker import deadlines, preemption
from daskdist.plugins.worker.runner import ClosureRunner
from daskdist.session.counters import set_formation_version, set_membership

logger = logging.getLogger(__name__)


def _runners(worker) -> list[ClosureRunner]:
    """The closure runners of every coordinator on this worker now."""
    return [p.runner for p in list(worker.plugins.values())
            if isinstance(p, CoordinatorWorkerPlugin) and p.runner is not None]


def _runner(worker, name: str) -> ClosureRunner | None:
    plugin = worker.plugins.get(worker_plugin_name(name))
    return getattr(plugin, "runner", None)


_relaying: set[asyncio.Task] = set()  # broken-group words on their way to peers


def _pass_on(worker, address: str, word: dict) -> None:
    """Tell the member at ``address`` (this one's child in the word's tree) that its
    group broke, in the background (event loop). Ends once delivered, refused, or after
    ``distributed.comm.timeouts.connect``; a member gone meanwhile hears nothing from
    here, and the scheduler tells its children in its place when it sees it go."""
    timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))

    async def send() -> None:
        try:
            await asyncio.wait_for(worker.rpc(address).daskdist_peer_lost(**word), timeout)
        except Exception as e:  # noqa: BLE001 - gone or stuck: the scheduler's to tell
            logger.debug("daskdist: passing a broken group's word to %s failed: %r",
                         address, e)

    task = asyncio.ensure_future(send())
    _relaying.add(task)
    task.add_done_callback(_relaying.discard)


# -- the handlers every coordinator's plugin on a worker shares (WORKER_ROUTES) -----------
def wake(worker, name: str) -> None:
    """The scheduler has work for this worker: exchange now."""
    runner = _runner(worker, name)
    if runner is not None:
        runner.poke()


def peer_lost(worker, name: str, generation: int, reason: str = "a peer left the group",
              version: int | None = None, joins: int | None = None,
              session: str | None = None) -> None:
    """The group of ``generation`` broke: from the scheduler (a stream message) or from
    the member above this one in the word's tree (an RPC): this process's calls in it
    raise now, and the word goes on to this member's children once."""
    if version is not None:  # the membership counters the loss made (one message)
        membership(worker, name, version, joins, session)
    # through sys.modules: no group was ever formed in this process otherwise
    collective = sys.modules.get("daskdist.collective")
    if collective is not None:
        collective.mark_peer_lost(generation, reason or "a peer left the group")
    runner = _runner(worker, name)
    relay = runner.relay if runner is not None else None
    if runner is not None and relay is not None and relay[0] == generation:
        runner.relay = None  # passed on once (a later word of it finds it gone)
        for address in relay[1]:  # their own sessions: the counters go unaddressed
            _pass_on(worker, address, dict(name=name, generation=generation,
                                           reason=reason, version=version, joins=joins))


def membership(worker, name: str, version: int, joins: int | None = None,
               session: str | None = None) -> None:
    """The membership counters of the session the scheduler addressed (a message for a
    session that ended, say of a coordinator closed before, changes nothing)."""
    runner = _runner(worker, name)
    current = runner.session_id if runner is not None else ""
    if current and session in (None, current):
        set_membership(version, joins, session=current)


def hold(worker, name: str, owners: list) -> None:
    """Owners whose error the scheduler is raising: their prefetched closures go back."""
    runner = _runner(worker, name)
    if runner is not None:
        runner.set_hold(owners)


def release(worker, name: str, rids: list) -> None:
    """Per-worker resources dropped by their owner: closed here."""
    runner = _runner(worker, name)
    if runner is not None and runner.resources is not None:
        runner.resources.drop(rids)


def leaving(worker, name: str) -> None:
    """This worker retires: its gang members leave at their next commit."""
    runner = _runner(worker, name)
    if runner is not None:
        runner.leaving = True


def preempt(worker, name: str, deadline: float, reason: str) -> None:
    """``coord.notify_preemption``: this worker will be taken away at ``deadline``."""
    deadlines.noticed(worker, Preemption(float(deadline), str(reason)))


def steal(worker, name: str, n: int) -> None:
    """An idle worker waits: give back up to ``n`` unstarted closures."""
    runner = _runner(worker, name)
    if runner is not None:
        runner.give_back(n)


async def collective(worker, action: str, name: str, **kw: Any) -> Any:
    """A formation's step on this member (``store``, ``init``, ``destroy``), in a thread."""
    from daskdist import collective as coll

    runner = _runner(worker, name)
    host = get_address_host(worker.address)  # where this worker's stores listen
    if action == "store":
        return list(await asyncio.to_thread(coll.create_store, kw["generation"], host,
                                            kw["timeout"]))
    if action == "init":
        set_formation_version(kw["generation"], kw.get("version"), kw.get("joins"))
        if runner is not None:  # whom to tell if this generation breaks
            runner.relay = (kw["generation"], list(kw.get("relay") or ()))

        def join() -> int:
            if kw.get("open_store"):  # rank 0, on the port it reported: one round, not two
                coll.create_store(kw["generation"], host, kw["timeout"], port=kw["port"])
            coll.init_member(kw["rank"], kw["world_size"], kw["host"], kw["port"],
                             kw["backend"], kw["generation"], kw["timeout"],
                             runner.device if runner is not None else None)
            return coll.spare_store_port(host)

        return {"rank": kw["rank"], "store_port": await asyncio.to_thread(join)}
    if action == "destroy":
        await asyncio.to_thread(coll.destroy_member)
        return None
    raise ValueError(f"unknown collective action {action!r}")


def confirm_session(worker, name: str, session: str) -> bool:
    """The scheduler asks whether this worker is registering ``session`` (only the
    worker itself can register a session for its address)."""
    runner = _runner(worker, name)
    return runner is not None and runner.registering == session


def stack(worker, name: str) -> dict | None:
    """The stack of the gang closure coordinator ``name`` runs here, served from the event
    loop, which a blocked closure does not block (SPEC §5.1)."""
    return gang_stack(name)


# Every handler a worker serves for daskdist: stream messages (one-way, from the
# scheduler) and RPCs (from the scheduler, or a peer passing a broken group's word on).
# Each is ``fn(worker, **message)``; install_handlers binds them to the worker.
STREAM_ROUTES = {
    "daskdist-wake": wake,
    "daskdist-peer-lost": peer_lost,
    "daskdist-membership": membership,
    "daskdist-hold": hold,
    "daskdist-steal": steal,
    "daskdist-leaving": leaving,
    "daskdist-release": release,
    "daskdist-preemption": preempt,
}
RPC_ROUTES = {
    "daskdist_collective": collective,
    "daskdist_peer_lost": peer_lost,
    "daskdist_confirm_session": confirm_session,
    "daskdist_gang_stack": stack,
}


def _bound(fn: Any, worker: Any) -> Any:
    """``fn`` with the worker bound (Dask names a handler by its ``__name__``)."""
    handler = functools.partial(fn, worker)
    handler.__name__ = fn.__name__  # type: ignore[attr-defined]
    return handler


def install_handlers(worker) -> None:
    """Install :data:`STREAM_ROUTES` and :data:`RPC_ROUTES` on ``worker`` (idempotent)."""
    worker.stream_handlers.update({op: _bound(fn, worker) for op, fn in STREAM_ROUTES.items()})
    worker.handlers.update({op: _bound(fn, worker) for op, fn in RPC_ROUTES.items()})


class CoordinatorWorkerPlugin(WorkerPlugin):
    """Registered on every worker (present and future) by the scheduler plugin."""

    idempotent = True

    def __init__(self, name: str = "default", prefetch: int | None = None,
                 torch_threads: int | None = None, resources: dict | None = None,
                 members: str | None = None):
        self.name = name
        self.prefetch = prefetch
        self.torch_threads = torch_threads
        self.resources = resources  # only workers declaring these are members
        self.members = members  # "gpu": only workers with a GPU (the Dask convention)
        self.runner: ClosureRunner | None = None

    async def is_member(self, worker) -> bool:
        """Whether this worker is a member: it declares the coordinator's ``resources``
        and, with ``members="gpu"``, has a GPU by the Dask convention (its
        ``CUDA_VISIBLE_DEVICES``, else a declared ``GPU`` resource or the host's GPUs,
        counted in a thread: that may ask ``nvidia-smi``)."""
        have = dict(worker.state.total_resources)
        if not checks.satisfies(have, self.resources):
            return False
        return self.members != "gpu" or await asyncio.to_thread(devices.has_gpu, have)

    async def setup(self, worker) -> None:
        if not await self.is_member(worker):
            # not a member (resources= or members=): free for Dask's own tasks, and the
            # scheduler hears it on this worker's own stream (a collection's helper)
            try:
                worker.batched_stream.send({"op": "daskdist-helper", "name": self.name})
            except CommClosedError:  # the worker is closing: the scheduler sees it leave
                pass
            return
        install_handlers(worker)
        preemption.install(worker, lambda: _runners(worker))
        deadlines.install(worker, lambda: _runners(worker))
        self.runner = ClosureRunner(worker, self.name, self.prefetch)
        await self.runner.start(self.torch_threads)

    async def teardown(self, worker) -> None:
        if self.runner is not None:
            await self.runner.stop()
            self.runner = None
        if not _runners(worker):  # the last coordinator here: SIGTERM is Python's again
            preemption.uninstall(worker)
            deadlines.uninstall(worker)

    def __getstate__(self):
        return {"name": self.name, "prefetch": self.prefetch,
                "torch_threads": self.torch_threads, "resources": self.resources,
                "members": self.members, "runner": None}
