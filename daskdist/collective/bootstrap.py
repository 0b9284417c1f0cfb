"""This process's membership in a collective group, and its transitions (SPEC §4).

torch.distributed has one default process group per process, so a worker is a member of
at most one group at a time. :data:`PROCESS`, the one :class:`ProcessGroupState` of this
process, holds that membership (rank, generation, backend, device), the generations the
scheduler plugin declared lost, the events of collective calls now waiting (so a lost
peer wakes them at once), rank 0's rendezvous stores, and a graveyard of abandoned
process groups whose in-flight work has not finished (dropping the last reference to a
gloo group with pending work would block the dropping thread until gloo's own timeout).
``PROCESS`` is guarded by one lock and issues no collective call. The objects it lets
go of (a destroyed group, a store of an older generation) are dropped by
:data:`REAPER`'s thread, off the formation's path: a gloo group's destructor joins its
threads and closes its connections (10-20 ms), which a re-formation must not wait for.

The transitions, driven by the scheduler plugin through worker RPCs:

1. ``create_store(generation, host)`` on rank 0 binds a ``TCPStore`` master to an
   ephemeral port and keeps it alive in ``PROCESS``, so the port stays held (no
   free-port-then-bind race, no fixed port: concurrent groups never collide).
2. ``init_member(...)`` on every member, concurrently, each in a worker thread:
   tears down any previous group of this process, meets the others on the store
   (abortable: ``mark_peer_lost`` ends the wait at once), then runs
   ``init_process_group`` which, with every member known alive, takes milliseconds.

A member that formed a group holds a listening socket for the next store it may open
(``spare_store_port``): a re-formation whose rank 0 reported that port opens the store
inside rank 0's ``init_member`` (``create_store(..., port=...)``), so it is one round of
calls, not two. Every generation's keys live under a prefix of their own, so a member
told a port that was since used for another generation's store finds nothing of its own
there.

``mark_peer_lost(generation)`` is how the scheduler plugin tells a member that a
peer left: collective calls of that generation, waiting or future, raise
``CollectiveError`` at once. ``destroy_member()`` leaves the group.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from daskdist.collective.device import backend_for, bind_device
from daskdist.errors import CollectiveError

__all__ = [
    "backend_for",
    "bind_device",
    "create_store",
    "destroy_member",
    "init_member",
    "mark_peer_lost",
]


class Reaper:
    """Drops the last references handed to it in a thread of its own, so their
    destructors run off the caller's thread. The thread starts on demand and ends once
    nothing came for ``idle`` seconds (it holds nothing then)."""

    def __init__(self, idle: float = 0.05) -> None:
        self.idle = idle
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        # held while items are handed over (and by the thread before it drops one, so
        # the caller's last reference is gone by then); guards _thread
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def take(self, items: list) -> None:
        """Take every object out of ``items`` (the caller keeps no other reference)."""
        with self._lock:
            while items:
                obj = items.pop()
                if obj is not None:
                    self._items.put(obj)
                del obj
            if self._thread is None and not self._items.empty():
                self._thread = threading.Thread(target=self._run, name="daskdist-reaper",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                obj = self._items.get(timeout=self.idle)
            except queue.Empty:
                with self._lock:
                    if self._items.empty():
                        self._thread = None
                        return
                continue
            with self._lock:
                pass  # the hand-over is over: the caller holds no reference now
            del obj  # its destructor runs here

    def alive(self) -> bool:
        """Whether the thread runs (it ends ``idle`` seconds after the last hand-over)."""
        with self._lock:
            return self._thread is not None


REAPER = Reaper()  # this process's one reaper


@dataclass
class ProcessMembership:
    """This process's place in the formed group of one generation."""

    rank: int
    world_size: int
    generation: int
    backend: str
    device: Any
    timeout: float
    broken: str = ""  # why the group can no longer be used ("" while healthy)
    pg: Any = None  # this generation's torch process group (the default group)


class ProcessGroupState:
    """This process's collective-group state (one per process: :data:`PROCESS`).

    Any thread may call any method; ``lock`` (re-entrant) guards every attribute.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.member: ProcessMembership | None = None
        self.lost_upto = 0  # every generation <= lost_upto has lost a peer
        self.waiters: set[threading.Event] = set()
        self.stores: dict[int, Any] = {}  # generation -> TCPStore master held on rank 0
        self.spare: _Spare | None = None  # the listening socket of the next store opened here
        self.graveyard: list[tuple[Any, Any]] = []  # (process group, pending work) kept alive

    # -- membership -----------------------------------------------------------------
    def current(self) -> ProcessMembership | None:
        """The formed membership, or ``None``."""
        return self.member

    def join(self, member: ProcessMembership) -> bool:
        """Become ``member``, unless its generation was declared lost meanwhile
        (``False``: nothing changes)."""
        with self.lock:
            if self.is_lost(member.generation):
                return False
            self.member = member
            return True

    def leave(self, keep_store: int | None, reap: bool = True) -> ProcessMembership | None:
        """Forget the membership (marked broken), wake every waiting call and drop every
        store but ``keep_store``'s (closed by the reaper, or here: ``reap=False``); the
        membership left, if any."""
        with self.lock:
            m, self.member = self.member, None
            if m is not None and not m.broken:
                m.broken = "the group was destroyed"
            for ev in self.waiters:
                ev.set()
            dropped = [self.stores.pop(g) for g in list(self.stores) if g != keep_store]
        if reap:
            REAPER.take(dropped)
        return m

    def is_lost(self, generation: int) -> bool:
        """Whether ``generation`` was declared lost (a peer left, or it was superseded)."""
        return generation <= self.lost_upto

    def highest_generation(self) -> int:
        """The newest collective generation this process has seen (later ones must be
        numbered higher). Lock-free: the worker plugin asks from its event loop."""
        m = self.member
        return max(self.lost_upto, m.generation if m else 0, max(list(self.stores), default=0))

    def break_group(self, generation: int, reason: str) -> None:
        """Mark ``generation`` unusable and wake every collective call waiting on it."""
        with self.lock:
            m = self.member
            if m is not None and m.generation == generation and not m.broken:
                m.broken = reason
            for ev in self.waiters:
                ev.set()

    def mark_lost(self, generation: int, reason: str) -> None:
        """Record that ``generation`` (and every older one) lost a peer."""
        with self.lock:
            self.lost_upto = max(self.lost_upto, generation)
            m = self.member
            if m is not None and m.generation <= generation and not m.broken:
                m.broken = reason
            for ev in self.waiters:
                ev.set()

    def check(self, generation: int) -> ProcessMembership:
        """The healthy membership of ``generation``; ``CollectiveError`` otherwise."""
        m = self.member
        if m is None:
            raise CollectiveError(
                f"collective group generation {generation} is gone (this worker left it)"
            )
        if m.generation != generation:
            raise CollectiveError(f"collective group generation {generation} was replaced "
                                  f"by generation {m.generation}")
        if m.broken:
            raise CollectiveError(
                f"collective group generation {generation} is broken: {m.broken}")
        return m

    # -- waiting calls ----------------------------------------------------------------
    @contextlib.contextmanager
    def waiting(self) -> Iterator[threading.Event]:
        """An event registered while a call waits: lost-peer marks and teardown set it."""
        wake = threading.Event()
        with self.lock:
            self.waiters.add(wake)
        try:
            yield wake
        finally:
            with self.lock:
                self.waiters.discard(wake)

    # -- rank 0's rendezvous stores ---------------------------------------------------
    def keep_store(self, generation: int, store: Any) -> None:
        """Hold ``generation``'s store (rank 0), dropping those of older generations."""
        with self.lock:
            REAPER.take([self.stores.pop(g) for g in list(self.stores) if g < generation])
            self.stores[generation] = store

    def store(self, generation: int) -> Any:
        """The store held for ``generation``, or ``None``."""
        with self.lock:
            return self.stores.get(generation)

    def spare_port(self, host: str) -> int:
        """The port of the socket held for the next store opened here (bound on
        ``host``'s interface now if none is held for it)."""
        with self.lock:
            if self.spare is None or self.spare.host != host:
                self.close_spare()
                fd, port = _listen_on(host)
                self.spare = _Spare(host, port, fd)
            return self.spare.port

    def take_spare(self, host: str, port: int) -> int | None:
        """The held socket's descriptor if it listens at ``host:port`` (the caller owns
        it now), else ``None``."""
        with self.lock:
            spare = self.spare
            if spare is None or (spare.host, spare.port) != (host, int(port)):
                return None
            self.spare = None
            return spare.fd

    def close_spare(self) -> None:
        """Close the held socket, if any."""
        with self.lock:
            spare, self.spare = self.spare, None
        if spare is not None:
            os.close(spare.fd)

    # -- abandoned groups -------------------------------------------------------------
    def bury(self, pg: Any, work: Any) -> None:
        """Keep ``pg`` and its unfinished ``work`` alive until the work ends by itself."""
        with self.lock:
            self.graveyard.append((pg, work))

    def prune_graveyard(self) -> None:
        """Drop abandoned groups whose work has finished (cheap; called at each formation)."""
        with self.lock:
            kept, done = [], []
            for entry in self.graveyard:
                (done if _completed(entry[1]) else kept).append(entry)
            self.graveyard[:] = kept
        REAPER.take(done)


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a broken work object is as good as finished
        return True


@dataclass(frozen=True)
class _Spare:
    """A listening socket held for the next store this process opens as rank 0."""

    host: str
    port: int
    fd: int


PROCESS = ProcessGroupState()  # this process's one collective-group state

_init_lock = threading.Lock()  # one formation at a time in this process
_CONNECT_TRY = 0.5  # seconds per attempt to reach rank 0's store
_JOINED = "daskdist/joined/"  # + rank: idempotent, so a retried init_member counts once


def create_store(generation: int, host: str, timeout: float = 60.0,
                 port: int | None = None) -> tuple[str, int]:
    """Rank 0: open the rendezvous store of ``generation``; return ``(host, port)``.

    ``host`` is this worker's address as the other members reach it (the host part of
    its Dask address). The store listens on an ephemeral port of that interface only
    (torch's own bind would take every interface) and is held in this process until
    ``destroy_member()`` or a later generation's store replaces it: it lives as long as
    the group generation it serves. Run it in any thread of the rank-0 worker, before
    ``init_member`` on this member. With ``port``, the store listens on the socket
    :func:`spare_store_port` said (the other members may be connecting already);
    ``CollectiveError`` if this process no longer holds it.
    """
    if port is None:
        fd, _ = _listen_on(host)
    else:
        fd = PROCESS.take_spare(host, port)
        if fd is None:
            raise CollectiveError(
                f"generation {generation}: this worker holds no store socket at "
                f"{host}:{port} any more (another group's store took it, or it left its "
                "group): the group forms again with a store opened first")
    try:
        store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        os.close(fd)
        raise
    PROCESS.keep_store(generation, store)
    return host, int(store.port)


def init_member(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str = "gloo",
    generation: int = 1,
    timeout: float = 60.0,
    device: Any = None,
) -> dict:
    """Join the process group of ``generation`` as ``rank`` of ``world_size``.

    Call it on every member at once, in a worker thread (it blocks until all members
    arrived, at most ``timeout`` seconds). Any previous group of this process is
    destroyed first. ``device`` defaults to :func:`bind_device`. Returns a summary
    dict (rank, world_size, generation, backend, device). Raises ``CollectiveError``
    when a member is lost or does not arrive in time.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    dev = torch.device(device) if device is not None else bind_device()
    backend = backend_for([dev], backend)
    # Every older generation is superseded: an init_member of one still meeting its
    # peers in another thread gives up at once instead of forming a stale group.
    PROCESS.mark_lost(generation - 1, f"superseded by generation {generation}")
    with _init_lock:
        return _init_locked(rank, world_size, host, port, backend, generation, timeout, dev)


def spare_store_port(host: str) -> int:
    """The port this process holds for the next store it opens on ``host`` as a group's
    rank 0 (``create_store(..., port=...)``): a formation may tell every member that port
    before the store is open."""
    return PROCESS.spare_port(host)


def destroy_member() -> None:
    """Leave the group and free its store and the socket held for the next one (all
    gone when it returns). Safe to call at any time, from any thread, any number of
    times."""
    _teardown(keep_store=None, reap=False)
    PROCESS.close_spare()


def mark_peer_lost(generation: int, reason: str = "a peer left the group") -> None:
    """A peer of ``generation`` left: its collective calls raise ``CollectiveError`` now.

    Calls waiting on that generation's group (and older ones) wake at once; later
    calls raise before touching the transport; an ``init_member`` of that generation
    still meeting its peers gives up. Cheap and non-blocking: call it from any thread,
    including an event loop.
    """
    m = PROCESS.current()
    PROCESS.mark_lost(generation, f"{reason} (generation {generation})")
    if m is not None and m.backend == "nccl" and m.generation <= generation:
        # NCCL work runs on the GPU, not in a thread we can wake: abort the
        # communicators so kernels waiting on the lost peer end too (off this thread:
        # an abort can take a while and the caller may be an event loop).
        if m.pg is not None:
            threading.Thread(target=_abort, args=(m.pg,), daemon=True).start()


# -- internals ---------------------------------------------------------------


def _listen_on(host: str) -> tuple[int, int]:
    """A TCP socket listening on ``host``'s interface only, at an ephemeral port: its file
    descriptor, which the store takes over (and closes when it is destroyed), and port."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def _init_locked(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str,
    generation: int,
    timeout: float,
    dev: torch.device,
) -> dict:
    _teardown(keep_store=generation)
    _raise_if_lost(generation)
    PROCESS.prune_graveyard()
    if backend == "nccl":
        # A dead peer must surface as an error, not a hang: torch's watchdog aborts
        # the communicators on an error or timeout. Mode 2 ("clean up only") does
        # that without killing the process (1 and 3 tear the worker down). Set
        # before the group exists; a value the user set wins.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
    deadline = time.monotonic() + timeout
    # this generation's keys only: a member told a port that another generation's store
    # took since (a stale spare) meets nobody there, and neither side's keys mix
    store = dist.PrefixStore(f"daskdist/{generation}/",
                             _store_for(rank, generation, host, port, timeout, deadline))
    _rendezvous(store, rank, world_size, generation, deadline)
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and dev.type == "cuda":
        kwargs["device_id"] = dev
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
            **kwargs,
        )
    except Exception as e:
        _teardown(keep_store=None)
        raise CollectiveError(
            f"init_process_group failed for generation {generation} (rank {rank}): {e}"
        ) from e
    joined = PROCESS.join(ProcessMembership(
        rank=rank,
        world_size=world_size,
        generation=generation,
        backend=backend,
        device=dev,
        timeout=float(timeout),
        pg=dist.group.WORLD,
    ))
    if not joined:
        _teardown(keep_store=None)
        _raise_if_lost(generation)
    return {
        "rank": rank,
        "world_size": world_size,
        "generation": generation,
        "backend": backend,
        "device": str(dev),
    }


def _abort(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:  # older torch, or already aborted: the watchdog still acts
        pass


def _raise_if_lost(generation: int) -> None:
    if PROCESS.is_lost(generation):
        raise CollectiveError(f"generation {generation} lost a peer before it formed")


def _store_for(
    rank: int, generation: int, host: str, port: int, timeout: float, deadline: float
) -> Any:
    if rank == 0:
        store = PROCESS.store(generation)
        if store is None or int(store.port) != int(port):
            raise RuntimeError(
                f"rank 0 holds no store for generation {generation} on port {port}: "
                "call create_store(generation, host) on rank 0 first, in the same process"
            )
        return store
    # Connect in short attempts: a client retries a refused connection until its
    # timeout, and rank 0 may be gone; between attempts, mark_peer_lost is heard.
    with PROCESS.waiting() as wake:
        while True:
            _raise_if_lost(generation)
            left = deadline - time.monotonic()
            try:
                store = dist.TCPStore(
                    host,
                    int(port),
                    is_master=False,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=max(0.05, min(_CONNECT_TRY, left))),
                )
            except Exception as e:
                if deadline - time.monotonic() <= 0:
                    raise CollectiveError(
                        f"cannot reach rank 0's store at {host}:{port} for generation "
                        f"{generation}: {e}"
                    ) from e
                wake.wait(0.01)
                continue
            store.set_timeout(datetime.timedelta(seconds=timeout))
            return store


def _rendezvous(store: Any, rank: int, world_size: int, generation: int, deadline: float) -> None:
    """Wait until every member reached the store; abortable by ``mark_peer_lost``."""
    keys = [f"{_JOINED}{r}" for r in range(world_size)]
    with PROCESS.waiting() as wake:
        _rendezvous_wait(store, keys, rank, world_size, generation, deadline, wake)


def _rendezvous_wait(store: Any, keys: list[str], rank: int, world_size: int,
                     generation: int, deadline: float, wake: threading.Event) -> None:
    try:
        store.set(keys[rank], b"1")
        pause, started = 0.0005, time.monotonic()
        while not store.check(keys):
            _raise_if_lost(generation)
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise CollectiveError(
                    f"generation {generation}: ranks {missing} of {world_size} did not "
                    "arrive before the timeout"
                )
            # The event is set by mark_peer_lost; otherwise this is a short poll, at most
            # 2 ms apart while the others are expected (members are asked at once)
            wake.wait(min(pause, left))
            pause = min(pause * 2, 0.002 if time.monotonic() < started + 0.25 else 0.02)
        _raise_if_lost(generation)
    except CollectiveError:
        raise
    except Exception as e:  # the store's master (rank 0) went away
        raise CollectiveError(f"generation {generation}: rendezvous failed: {e}") from e


def _teardown(keep_store: int | None, reap: bool = True) -> None:
    """Destroy this process's group, wake its waiters, drop stores not kept; the group
    object and the stores go to the reaper (their destructors run there), or, with
    ``reap=False``, are destroyed before this returns."""
    doomed = [PROCESS.leave(keep_store, reap)]
    # Abandoned in-flight work keeps its group object alive in the graveyard, so this
    # never runs the C++ destructor while gloo still waits on a dead peer.
    if dist.is_initialized():
        doomed.append(dist.group.WORLD)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    if reap:
        REAPER.take(doomed)
