"""A worker's replicas of an asynchronously trained model: what ``am.replica`` is inside
a closure.

``am.replica`` resolves, on each worker, to that worker's :class:`ReplicaPool`; each
closure thread gets its own :class:`Replica` from it (its own module and inner
optimizer, kept across rounds: two closures running at once on a worker of two threads
never train one module together). Every replica of the worker shares one
:class:`ModelClient`: where the holder is, and the newest pull, fetched once per
version whatever the number of threads (a worker whose version is current fetches no
bytes).

A round is ``pull()``, inner steps, ``push()``: the push sends the pseudo-gradient
(the weights pulled minus the weights now; parameters only, the buffers as they are)
straight to the holder, with the lease tokens of the rows the closure consumed since it
started or since its previous push (a batch taken before the pull is trained after it).
The holder stages a push with the
scheduler first (its rows become the model's): a staged push's rows are acknowledged
once its delta is durable, or given back by the scheduler when it is refused or lost; a
push no holder staged is abandoned at the scheduler, which gives its rows back in the
same step (never the worker itself: its loader may hold them again by then).
Rows a closure takes after its last push are acknowledged with the closure, as any
closure's: end a round with ``push()``.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from typing import Any, NamedTuple

import torch
from distributed.comm.core import CommClosedError
from distributed.utils import sync

from daskdist import config
from daskdist.asynchronous import flat, routes
from daskdist.asynchronous.spec import AsyncSpec
from daskdist.core import checks
from daskdist.core.asynchronous.protocol import Pulled, Push
from daskdist.core.leases.table import group_tokens, merge_tokens
from daskdist.session.scope import closure_scope_now
from daskdist.session.tokens import take_consumed

# a worker's share of a round's suggested steps until its pace is measured (its first
# push answered): a short first round measures it, and keeps the first deltas small
UNPACED_SHARE = 0.25


class Fetched(NamedTuple):
    """A version of the global model as this worker fetched it (never changed)."""

    incarnation: int
    version: int
    param_layout: list
    params: list
    buffers: list


def _services(call: str) -> Any:
    """The running closure's session services; ``RuntimeError`` naming ``call``
    outside a closure."""
    scope = closure_scope_now()
    if scope is None or scope.services is None:
        raise RuntimeError(f"{call} must run inside a closure scheduled with "
                           "coord.schedule(fn, args=(am.replica, ...)): its rows and its "
                           "worker session are the closure's")
    return scope.services


class ModelClient:
    """Where one model's holder is and the newest version fetched, for every replica of
    it on this worker."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.lock = threading.Lock()  # one fetch at a time
        self.holder: str | None = None
        self.cache: Fetched | None = None
        # this worker's inner steps/s over the fastest worker's (None: no push answered)
        self.speed: float | None = None
        self.timeout = config.seconds("asynchronous.push-timeout")
        self.attempt_timeout = min(self.timeout, config.seconds("worker.rpc-timeout"))
        # the first try of a call is short: a lost holder's address refuses connections
        # for Dask's whole connect timeout (30 s), while the book knows within a second
        self.first_timeout = min(5.0, self.attempt_timeout)

    def locate(self, services: Any, deadline: float) -> str:
        """The holder's address, from the scheduler's book (waits while it moves)."""
        while True:
            where = services.call("daskdist_async_where", model=self.model_id)
            if where is None:
                raise RuntimeError(f"asynchronous model {self.model_id}: this worker's "
                                   "session ended")
            if where.get("failed"):
                raise RuntimeError(where["failed"])
            if where.get("holder") and where.get("phase") == "ready":
                self.holder = where["holder"]
                return self.holder
            if time.monotonic() > deadline:
                raise TimeoutError(f"asynchronous model {self.model_id} has no holder ready "
                                   f"(it is {where.get('phase')}) after "
                                   f"{self.timeout:g} s (daskdist.asynchronous.push-timeout)")
            time.sleep(0.05)

    def call(self, services: Any, op: str, **kwargs: Any) -> Any:
        """Call the holder's ``op``, following the model when its holder moves."""
        deadline = time.monotonic() + self.timeout
        address = self.holder or self.locate(services, deadline)
        timeout, tried = self.first_timeout, set()
        while True:
            try:
                reply = self._rpc(services, address, op, timeout, **kwargs)
            except (OSError, CommClosedError, TimeoutError) as e:
                reply = {"moved": True, "why": repr(e)}
            if not (isinstance(reply, dict) and reply.get("moved")):
                return reply
            if time.monotonic() > deadline:
                raise TimeoutError(f"asynchronous model {self.model_id}: its holder "
                                   f"{address} did not answer {op} within {self.timeout:g} s "
                                   f"(daskdist.asynchronous.push-timeout): {reply.get('why')}")
            tried.add(address)
            time.sleep(0.05)
            address = self.locate(services, deadline)
            # the book still names a holder that did not answer: wait for it longer
            timeout = self.attempt_timeout if address in tried else self.first_timeout

    def _rpc(self, services: Any, address: str, op: str, timeout: float,
             **kwargs: Any) -> Any:
        worker = services.worker
        if address == worker.address:  # the holder is this worker: no comm
            return sync(worker.loop, routes.ASYNC_RPC_ROUTES[op], worker, name=services.name,
                        callback_timeout=timeout, **kwargs)
        return sync(worker.loop, getattr(worker.rpc(address), op), name=services.name,
                    callback_timeout=timeout, **kwargs)

    def fetch(self, services: Any) -> tuple[Fetched, int]:
        """The newest version (and the bytes fetched for it: 0 when this worker had it)."""
        with self.lock:
            have = self.cache
            # where the holder is now (a round's push goes there too): a lost holder's
            # address is never tried again once the book knows
            self.locate(services, time.monotonic() + self.timeout)
            reply = self.call(services, "daskdist_async_pull", model=self.model_id,
                              incarnation=have.incarnation if have else -1,
                              version=have.version if have else -1)
            p = checks.named(reply, "daskdist_async_pull reply", Pulled)
            if p.current and have is not None:
                return have, 0
            n = int(p.nparams)
            layout = [tuple(x) for x in p.layout]
            fetched = Fetched(int(p.incarnation), int(p.version), layout[:n],
                              flat.unpack(p.params, layout[:n]),
                              flat.unpack(p.buffers, layout[n:]))
            self.cache = fetched
            return fetched, len(p.params) + len(p.buffers)


class Replica:
    """One closure thread's module and inner optimizer (kept across rounds)."""

    def __init__(self, spec: AsyncSpec, device: Any, client: ModelClient) -> None:
        self.spec = spec
        model = spec.model()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"async_model: model() must return a torch.nn.Module, got "
                            f"{type(model).__name__}")
        self.model = model.to(device)
        self.optimizer = spec.optimizer(self.model.parameters())
        self.layout = flat.layout_of(self.model.named_parameters())
        self.client = client
        self.version: int | None = None  # of the last pull
        self._base: Fetched | None = None
        self._steps = 0
        self._t0 = time.perf_counter()
        self._fetched = 0  # bytes this round's pull fetched
        hook = getattr(self.optimizer, "register_step_post_hook", None)
        if hook is not None:
            hook(self._stepped)

    def _stepped(self, *args: Any) -> None:
        self._steps += 1

    def pull(self) -> int:
        """``model`` := the newest global model (parameters and buffers); its version."""
        services = _services("replica.pull()")
        fetched, nbytes = self.client.fetch(services)
        flat.check_layout(fetched.param_layout, self.layout, "replica.pull()")
        # always copied, the cached version too: the module trained since its last pull
        # (a push not yet applied leaves the version where it was), and a delta is
        # measured from the weights pulled
        with torch.no_grad():
            for p, t in zip(self.model.parameters(), fetched.params, strict=True):
                p.copy_(t)
            for b, t in zip(self.model.buffers(), fetched.buffers, strict=True):
                b.copy_(t)
        self._base = fetched
        self.version = fetched.version
        self._steps, self._t0, self._fetched = 0, time.perf_counter(), nbytes
        return fetched.version

    def push(self) -> dict:
        """Send this round's delta to the holder: ``{"applied", "version", "staleness",
        "rows"}`` (``applied: False``: refused, its rows went back)."""
        services = _services("replica.push()")
        base = self._base
        if base is None:
            raise RuntimeError("replica.push() before replica.pull(): a round starts with "
                               "pull() (the delta is the weights pulled minus the weights "
                               "after the inner steps)")
        flat.check_layout(base.param_layout, self.layout, "replica.push()")
        with torch.no_grad():
            deltas = [b - p.detach().to("cpu", b.dtype)
                      for b, p in zip(base.params, self.model.parameters(), strict=True)]
        params = flat.pack(deltas)
        buffers = flat.pack(list(self.model.buffers()))
        tokens = take_consumed(0)
        rows = sum(b - a for ranges in group_tokens(tokens).values() for a, b in ranges)
        ctx = closure_scope_now().context
        seconds = time.perf_counter() - self._t0
        push = Push(self.client.model_id, uuid.uuid4().hex, services.session,
                    services.worker.address, base.version, base.incarnation, self.layout,
                    params, buffers,
                    merge_tokens(tokens) if tokens else [], self._steps, seconds,
                    self._fetched + len(params) + len(buffers),
                    int(getattr(ctx, "num_workers", 1) or 1))
        try:
            reply = self.client.call(services, "daskdist_async_push", push=tuple(push))
        except BaseException:
            self._abandon(services, push)
            raise
        if not reply.get("applied") and not reply.get("staged"):
            self._abandon(services, push)  # staged: the book gave its rows back
        if reply.get("error"):
            raise ValueError(reply["error"])
        if "speed" in reply:
            self.client.speed = float(reply["speed"])
        self._fetched = 0
        out = {"applied": bool(reply.get("applied")), "version": int(reply["version"]),
               "staleness": int(reply.get("staleness", 0)), "rows": rows}
        if not out["applied"]:
            out["reason"] = str(reply.get("reason", ""))
        return out

    @staticmethod
    def _abandon(services: Any, push: Push) -> None:
        """Give up ``push``: unless a holder staged it (then the book decides), its rows
        go back from this session, at the book, in one step."""
        if push.tokens:
            services.call("daskdist_async_abandon", model=push.model, pid=push.pid,
                             tokens=list(push.tokens))

    def suggested_steps(self, steps: int) -> int:
        """Dynamic local updates (Asynchronous Local-SGD, arXiv 2401.09135): ``steps``
        scaled by this worker's measured speed over the fastest worker's,
        ``max(1, floor(share * steps))``, so a slow worker's rounds take as long as a
        fast one's and its deltas are no staler. Before its first push is answered the
        share is ``UNPACED_SHARE``: a round of unknown length would make the first,
        largest deltas (from the untrained model) the stalest."""
        speed = self.client.speed
        share = UNPACED_SHARE if speed is None else speed
        return max(1, math.floor(share * int(steps)))


class ReplicaPool:
    """A worker's replicas of one model, one per closure thread (``am.replica`` inside a
    closure: its attributes are the calling thread's replica's)."""

    def __init__(self, spec: AsyncSpec, ctx: Any) -> None:
        self.spec = spec
        self.device = getattr(ctx, "device", None) or "cpu"
        self.client = ModelClient(spec.model_id)
        self._lock = threading.Lock()
        self._replicas: dict[int, Replica] = {}

    def mine(self) -> Replica:
        """The calling thread's replica (built on its first use)."""
        ident = threading.get_ident()
        replica = self._replicas.get(ident)
        if replica is None:
            replica = Replica(self.spec, self.device, self.client)
            with self._lock:
                replica = self._replicas.setdefault(ident, replica)
        return replica

    @property
    def replicas(self) -> int:
        """How many replicas this worker built (one per closure thread that used it)."""
        return len(self._replicas)

    @property
    def model(self) -> torch.nn.Module:
        return self.mine().model

    @property
    def optimizer(self) -> Any:
        return self.mine().optimizer

    @property
    def version(self) -> int | None:
        return self.mine().version

    def pull(self) -> int:
        return self.mine().pull()

    def push(self) -> dict:
        if closure_scope_now() is None:
            _services("replica.push()")  # raises, naming the call
        return self.mine().push()

    def suggested_steps(self, steps: int) -> int:
        return self.mine().suggested_steps(steps)

    def __repr__(self) -> str:
        return f"<ReplicaPool of {self.spec.model_id}: {self.replicas} replicas>"
