"""Coordinators: the named coordinators on a scheduler, and each one's life.

A name lives while it has owners (client-side Coordinators, SPEC §2.5b): the first
``create`` of a name makes its :class:`CoordinatorState` (attached to the scheduler, which
makes its :class:`GroupDriver`) and registers its worker plugin; each ``create``
attaches a new owner with a secret token; when the last owner leaves (``close()``, or
its client gone for ``daskdist.coordinator.client-grace``; a keep-alive owner's, for
``daskdist.coordinator.keep-alive-timeout`` with nobody attaching: see the keep book)
the state and driver go and the worker plugin is removed from every worker (its threads
and timers with it).
Creation and teardown of a name are serialized (a lock per name), so a worker plugin's
registration and removal never cross on a worker.

Runs on the scheduler's event loop; the :class:`CoordinatorPlugin` (plugin.py) holds one
and its handlers call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from distributed.protocol.pickle import dumps

from daskdist import config
from daskdist.core import checks
from daskdist.core.protocol import worker_plugin_name
from daskdist.plugins import WORKER_PLUGIN, PluginRef
from daskdist.plugins.scheduler.groups import GroupDriver
from daskdist.plugins.scheduler.state import CoordinatorState

logger = logging.getLogger(__name__)


def _describe(co: CoordinatorState) -> str:
    """The workers a coordinator admits as members, for messages."""
    parts = (["a GPU"] if co.member_kind == "gpu" else []) + (
        [f"resources {co.member_resources}"] if co.member_resources else [])
    return f"the workers with {' and '.join(parts)}" if parts else "every worker"


class Coordinators:
    """The named coordinators of one scheduler: their creation, owners and teardown."""

    def __init__(self, send: Callable[[str, dict], None],
                 next_generation: Callable[[], int]) -> None:
        self.scheduler: Any = None  # set by the plugin's start
        self.states: dict[str, CoordinatorState] = {}
        self.drivers: dict[str, GroupDriver] = {}
        self._send = send
        self._next_generation = next_generation
        # name -> [its lock, held while created / torn down; how many use it]: a name's
        # entry goes when nobody holds or waits for its lock
        self._life: dict[str, list] = {}
        self.locality: Any = None  # the plugin's Locality (set by its start)
        self._teardowns: dict[str, asyncio.Task] = {}  # by coordinator name
        # client -> the pending drop of its owners (a cut connection may come back)
        self._orphaned: dict[str, asyncio.TimerHandle] = {}

    def get(self, name: Any) -> CoordinatorState:
        """The coordinator ``name`` (``KeyError`` naming it if there is none)."""
        checks.text(name, "name")
        try:
            return self.states[name]
        except KeyError:
            raise KeyError(f"no daskdist coordinator named {name!r} on this scheduler") from None

    @contextlib.asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[None]:
        """Hold ``name``'s life lock (its creation and teardown never cross)."""
        entry = self._life.setdefault(name, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._life[name]

    # -- creation and owners -------------------------------------------------------------
    async def create(self, name: str, client: str | None, max_worker_failures: int | None,
                     torch_threads: int | None, lease_timeout: float | None,
                     resources: dict | None = None, members: str | None = None,
                     keep_alive: bool = False) -> dict:
        """Create ``name`` if new (its settings: the first caller's; arguments already
        checked), make sure workers run its plugin, attach a new owner:
        ``{"workers", "owner", "token"}``. ``resources``: the Dask resources a worker must
        declare to be a member; ``members="gpu"``: a member must have a GPU by the Dask
        convention (the first caller's; another asking for others gets a ``ValueError``
        naming both). ``keep_alive``: the owner outlives its client (the keep book)."""
        async with self._lock(name):
            co = self.states.get(name)
            if co is not None and resources is not None and \
                    resources != co.member_resources:
                raise ValueError(
                    f"coordinator {name!r} makes {_describe(co)} its members; a "
                    f"Coordinator asking for resources={resources} needs another name")
            if co is not None and members is not None and members != co.member_kind:
                raise ValueError(
                    f"coordinator {name!r} makes {_describe(co)} its "
                    f"members; a Coordinator asking for members={members!r} needs "
                    f"another name")
            if co is None:
                if max_worker_failures is None:
                    max_worker_failures = checks.max_worker_failures(
                        config.integer("coordinator.max-worker-failures"),
                        "daskdist.coordinator.max-worker-failures")
                if lease_timeout is None:
                    lease_timeout = checks.lease_timeout(
                        config.seconds("liveness.lease-timeout"),
                        "daskdist.liveness.lease-timeout")
                co = CoordinatorState(name, max_worker_failures, send=self._send,
                                      lease_timeout=lease_timeout, locality=self.locality,
                                      expire=functools.partial(self._expired, name))
                co.member_resources = resources  # only these workers are members
                co.member_kind = members
                self.states[name] = co
                # rpc to members (formations, stacks), NVML metrics
                self.drivers[name] = co.attach_scheduler(self.scheduler,
                                                         self._next_generation)
            try:
                started = await self._register_worker_plugin(
                    name, torch_threads, co.member_resources, co.member_kind)
            except BaseException:
                if not co.has_owners():  # nobody uses it: the next attempt starts afresh
                    self._forget(name)
                raise
            owner, token = uuid.uuid4().hex[:12], secrets.token_hex(16)
            co.add_owner(owner, client, token, keep_alive)
        # workers register their sessions once their plugin is set up (the others say
        # they are not members): wait a little for them, so the reply's worker count is
        # the cluster's (its end: 5 poll intervals)
        deadline = time.monotonic() + 5 * config.seconds("scheduler.poll-interval")
        while len(co.members) + len(co.helpers) < started and not co.closed:
            if not await co.wait_changed(deadline - time.monotonic()):
                break
        return {"workers": len(co.members), "owner": owner, "token": token}

    async def _register_worker_plugin(self, name: str, torch_threads: int | None,
                                      resources: dict | None = None,
                                      members: str | None = None) -> int:
        """Register the worker plugin of ``name`` unless it is; how many workers set it
        up now (0 if it was there). With ``resources`` or ``members``, it runs closures
        only on the workers that qualify; each of the others tells the scheduler it is
        not a member (a helper)."""
        plugin_name = worker_plugin_name(name)
        if plugin_name in self.scheduler.worker_plugins:
            return 0
        replies = await self.scheduler.register_worker_plugin(
            comm=None,
            plugin=dumps(PluginRef(WORKER_PLUGIN, name=name, torch_threads=torch_threads,
                                   resources=resources, members=members)),
            name=plugin_name,
            idempotent=True,
        )
        failed = {w: r for w, r in (replies or {}).items()
                  if isinstance(r, dict) and r.get("status") != "OK"}
        if failed:
            # Unregister, so that the next attempt registers (and reports) again.
            await self.scheduler.unregister_worker_plugin(comm=None, name=plugin_name)
            worker, reply = next(iter(failed.items()))
            raise RuntimeError(
                f"the daskdist worker plugin of coordinator {name!r} failed to set up "
                f"on {len(failed)} of {len(replies)} workers; {worker}: "
                f"{reply.get('exception_text') or reply}")
        return len(replies or {})

    def drop_owner(self, co: CoordinatorState, owner: str) -> list:
        """Drop ``owner`` (closed, or its client is gone); the coordinator goes with its
        last owner. The outcomes the owner had not read."""
        items = co.drop_owner(owner)
        if not co.has_owners():
            name = co.name
            task = asyncio.ensure_future(self._teardown(name))
            self._teardowns[name] = task
            task.add_done_callback(
                lambda t: self._teardowns.pop(name) if self._teardowns.get(name) is t else None)
        return items

    def _expired(self, name: str, owner: str) -> None:
        """A keep-alive owner of ``name`` nobody attached to within
        ``keep-alive-timeout``: dropped as if it closed."""
        co = self.states.get(name)
        if co is not None:
            self.drop_owner(co, owner)

    async def torn_down(self, name: str, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, for the teardown of ``name`` under way (if
        any) to remove its worker plugin: a ``close()`` that returns after it leaves no
        plugin to race with a cluster closed right after (Dask's ``plugin_remove`` of
        the same plugin from both sides raises ``KeyError``). The teardown goes on if
        the wait ends first."""
        task = self._teardowns.get(name)
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except Exception:  # noqa: BLE001 - a timeout; the task logs its own errors
                pass

    # -- teardown --------------------------------------------------------------------------
    def _forget(self, name: str) -> CoordinatorState | None:
        co = self.states.pop(name, None)
        driver = self.drivers.pop(name, None)
        if driver is not None:
            driver.stop()
        if co is not None:
            co.close()
        if self.locality is not None:
            self.locality.forget(name)
        return co

    async def _teardown(self, name: str) -> None:
        """No owner of ``name`` is left: end its waits, drop its state and group driver,
        and remove its worker plugin (its threads and timers go on every worker; a hung
        worker is waited for at most ``scheduler.teardown-timeout``)."""
        async with self._lock(name):
            co = self.states.get(name)
            if co is None or co.has_owners():  # someone attached again meanwhile
                return
            self._forget(name)
            plugin_name = worker_plugin_name(name)
            if plugin_name in self.scheduler.worker_plugins:
                try:
                    await asyncio.wait_for(
                        self.scheduler.unregister_worker_plugin(comm=None, name=plugin_name),
                        config.seconds("scheduler.teardown-timeout"))
                except Exception as e:  # a hung worker: it loses the plugin with its session
                    logger.warning("daskdist[%s]: removing the worker plugin: %r", name, e)
            logger.info("daskdist[%s]: last owner left; coordinator closed", name)

    # -- clients ---------------------------------------------------------------------------
    def client_left(self, client: str) -> None:
        """A client's connection closed: drop its owners after ``coordinator.client-grace``
        unless it reconnects first (Dask's client reconnects with the same id); its
        keep-alive owners wait ``keep-alive-timeout`` instead (the keep book)."""
        if not any(co.owners_of(client) for co in self.states.values()):
            return
        for co in self.states.values():
            co.client_away(client, True)
        old = self._orphaned.pop(client, None)
        if old is not None:
            old.cancel()
        grace = config.seconds("coordinator.client-grace")
        self._orphaned[client] = asyncio.get_running_loop().call_later(
            grace, self._drop_client, client)

    def client_back(self, client: str) -> None:
        handle = self._orphaned.pop(client, None)
        if handle is not None:
            handle.cancel()  # it came back: its closures and results are still here
        for co in self.states.values():
            co.client_away(client, False)

    def _drop_client(self, client: str) -> None:
        """The client stayed away for ``client-grace``: its owners are dropped as if they
        had closed (their per-worker resources are released); its keep-alive owners
        wait on (the keep book)."""
        self._orphaned.pop(client, None)
        for co in list(self.states.values()):
            for owner in co.owners_of(client, kept=False):
                logger.info("daskdist[%s]: client %s gone for client-grace: owner %s "
                            "dropped", co.name, client, owner)
                self.drop_owner(co, owner)

    def close(self) -> None:
        """The scheduler closes: stop teardowns, drivers, client timers and every
        coordinator (its waits, its keep-alive and preemption timers)."""
        for task in list(self._teardowns.values()):
            task.cancel()
        for driver in self.drivers.values():
            driver.stop()
        for co in self.states.values():
            co.close()
        for handle in self._orphaned.values():
            handle.cancel()
        self._orphaned.clear()
