"""AsyncBook: the scheduler's book of a coordinator's asynchronously trained models,
and its routes.

The scheduler holds no tensor of them: each model's pure
:class:`~daskdist.core.asynchronous.ledger.ModelLedger` (holder, standby, versions, the
pushes waiting for durability, figures). This book picks the holder and the standby
among the members (none with a preemption deadline near), gives them their roles
(``daskdist-async-role`` on their streams), moves a push's rows to the model when its
holder stages it (telling the holder when they are their epochs' last, which it then
copies to its standby at once), acknowledges them once the push is durable, gives them
back when it is refused or lost (``rows.py``), plans a lost holder's recovery, and moves
the model to its standby when its holder's worker gets a deadline (the holder hands
over first, :meth:`AsyncBook.hand_over`). A model goes with its owner: closed, or a
keep-alive owner nobody attached to in time. Its routes: :data:`ASYNC_ROUTES` and
:data:`ASYNC_STREAM_ROUTES`. It asks its coordinator only what
:class:`AsyncCoordinator` declares. Runs on the scheduler's event loop; imports
nothing from Dask or torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from daskdist import config
from daskdist.core import checks
from daskdist.core.asynchronous import protocol as async_protocol
from daskdist.core.asynchronous.ledger import (
    APPLIED,
    DURABLE,
    FAILED,
    MOVING,
    READY,
    STARTING,
    ModelLedger,
    PushRecord,
    Recovery,
)
from daskdist.core.asynchronous.protocol import COPY, FRESH, HOLDER, NONE, SAME, STANDBY, AsyncRole
from daskdist.core.protocol import ANY, OWNER, SESSION, SESSION_ENDED, Route
from daskdist.plugins.scheduler.asynchronous.placement import least_busy
from daskdist.plugins.scheduler.asynchronous.rows import (
    ModelRows,
    checkpoint_ledger,
    pseudo,
    settle_rows,
    token_rows,
    wire_size,
)
from daskdist.plugins.scheduler.polls import wait_event

logger = logging.getLogger(__name__)


class AsyncCoordinator(ModelRows, Protocol):
    """What the asynchronous book asks its coordinator (the scheduler's
    ``CoordinatorState``): the coordinator's own state, the rows of the lease book
    (:class:`~daskdist.plugins.scheduler.asynchronous.rows.ModelRows`), and which
    workers have a deadline (the preemption book)."""

    send: Callable[[str, dict], None]  # a message on a worker's stream

    def leaving(self, session: str) -> bool:
        """Whether ``session``'s worker has a preemption deadline near (it takes no
        model role)."""


class AsyncBook:
    """A coordinator's asynchronous models (see the module doc)."""

    def __init__(self, co: AsyncCoordinator) -> None:
        self.co = co
        self.models: dict[str, ModelLedger] = {}
        self.specs: dict[str, bytes] = {}
        self.plans: dict[str, Recovery] = {}  # recoveries waiting for a target
        self.by_replica: dict[str, str] = {}  # its replicas' resource id -> a model
        self._ready: dict[str, asyncio.Event] = {}  # set when its holder next serves
        self.timeout = config.seconds("asynchronous.ready-timeout")

    # -- helpers --------------------------------------------------------------------------
    def _address(self, session: str | None) -> str:
        m = self.co.members.members.get(session) if session else None
        return m.address if m is not None else ""

    def _pick(self, exclude: tuple) -> str | None:
        return least_busy(self.models.values(), self.co.members, self.co.leaving, exclude)

    def _role(self, led: ModelLedger, session: str, role: str, source: str = SAME,
              version: int = 0, spec: bool = False, standby: str = "") -> None:
        address = self._address(session)
        if not address:
            return
        msg = AsyncRole(led.model, session, role, led.incarnation, version,
                        self.specs[led.model] if spec else b"", standby, source,
                        [*led.checkpoint, led.lineage()] if led.checkpoint else [])
        self.co.send(address, {"op": "daskdist-async-role", "name": self.co.name,
                               "role": tuple(msg)})

    def _ensure_standby(self, led: ModelLedger) -> None:
        """A serving model without a standby gets one, if another member exists."""
        if led.phase != READY or led.standby is not None or led.holder is None:
            return
        session = self._pick((led.holder,))
        if session is None:
            return
        led.set_standby(session)
        self._role(led, session, STANDBY, spec=True)
        self._role(led, led.holder, HOLDER, SAME, led.version,
                   standby=self._address(session))

    def _recover(self, led: ModelLedger, plan: Recovery) -> None:
        if not plan.source:
            logger.error("daskdist[%s]: %s", self.co.name, plan.reason)
            settle_rows(self.co, led.model, led.fail(plan.reason))
            self._wake(led)
            return
        if plan.source == COPY and not (plan.target and plan.target in self.co.members):
            # its standby went too
            self._recover(led, led.holder_lost(self.co.members.__contains__))
            return
        target = plan.target if plan.target and plan.target in self.co.members else self._pick(())
        if target is None:  # no member now: the next member that asks takes it
            self.plans[led.model] = plan
            return
        self.plans.pop(led.model, None)
        led.aim(target)
        logger.info("daskdist[%s]: model %s moves to %s (from its %s, version %d)", self.co.name,
                    led.model, self._address(target), plan.source, plan.version)
        self._role(led, target, HOLDER, plan.source, plan.version, spec=True)

    def _wake(self, led: ModelLedger) -> None:
        if (event := self._ready.get(led.model)) is not None:
            event.set()

    async def _wait_ready(self, led: ModelLedger, what: str) -> dict | None:
        """Wait until the model serves: ``None``; ``{"closed": why}`` when its owner or
        coordinator closed meanwhile (an answer, not an error: the caller is going);
        ``RuntimeError`` when it failed, ``TimeoutError`` after ``ready-timeout``."""
        event = self._ready[led.model] = asyncio.Event()
        try:
            while led.phase in (STARTING, MOVING):
                event.clear()
                if not await wait_event(event, self.timeout):
                    raise TimeoutError(f"{what}: no worker served model {led.model} within "
                                       f"{self.timeout:g} s (daskdist.asynchronous."
                                       "ready-timeout)")
        finally:
            self._ready.pop(led.model, None)
        if self.models.get(led.model) is not led:
            return {"closed": f"{what}: model {led.model}: {led.failed}"}
        if led.phase == FAILED:
            raise RuntimeError(f"{what}: {led.failed}")
        return None

    def _model(self, model: Any, op: str) -> ModelLedger:
        led = self.models.get(checks.text(model, f"{op}: model"))
        if led is None:
            raise KeyError(f"{op}: no asynchronous model {model!r} on coordinator "
                           f"{self.co.name!r} (dropped, or its coordinator closed)")
        return led

    # -- the client's routes --------------------------------------------------------------
    async def create(self, owner: str, token: str, model: str, spec: bytes,
                     max_staleness: int, replica: str) -> dict:
        """A new model: a member builds the global model from ``spec``; waits until it
        serves (its first members may still be joining). ``replica``: the per-worker
        resource of its replicas (``am.replica``): the model goes when it is released."""
        op = "daskdist_async_create"
        checks.text(model, f"{op}: model")
        replica = checks.text(replica, f"{op}: replica")
        if not isinstance(spec, bytes):
            raise TypeError(f"{op}: spec must be bytes, got {type(spec).__name__}")
        max_staleness = async_protocol.max_staleness(max_staleness)
        if model in self.models:
            raise ValueError(f"{op}: model {model!r} exists")
        led = self.models[model] = ModelLedger(model, owner, max_staleness)
        self.specs[model] = spec
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout
            target = self._pick(())
            while target is None:  # no member yet
                if loop.time() > deadline:
                    raise TimeoutError(f"{op}: no worker joined coordinator "
                                       f"{self.co.name!r} within {self.timeout:g} s")
                await asyncio.sleep(0.05)
                target = self._pick(())
            led.aim(target)
            self._role(led, target, HOLDER, FRESH, 0, spec=True)
            closed = await self._wait_ready(led, "async_model")
        except BaseException:
            self.models.pop(model, None)
            self.specs.pop(model, None)
            if led.target or led.holder:
                self._role(led, led.target or led.holder, NONE)
            raise
        if closed is not None:
            return closed
        led.replica, self.by_replica[replica] = replica, model  # the model goes with it
        self._ensure_standby(led)
        return self.info(model)

    async def configure(self, owner: str, token: str, model: str, url: str,
                        every: int) -> dict:
        """``am.checkpoint_to(url, every)``: the holder writes a checkpoint every
        ``every`` versions; before anything was applied, it first loads the newest one
        under ``url`` (a job resumed on a new cluster). Waits for that load."""
        op = "daskdist_async_checkpoint"
        led = self._model(model, op)
        checks.text(url, f"{op}: url", 4096)
        every = async_protocol.every(every, f"{op}: every")
        if led.owner != owner:
            raise PermissionError(f"{op}: model {model!r} is another owner's")
        led.checkpoint = (url, every)
        if led.phase == READY and not led.applied and not led.open and led.version == 0:
            plan = led.reload()
            self._role(led, plan.target, HOLDER, plan.source, plan.version, spec=True)
            closed = await self._wait_ready(led, "checkpoint_to")
            if closed is not None:
                return closed
            self._ensure_standby(led)
        elif led.holder is not None:
            self._role(led, led.holder, HOLDER, SAME, led.version,
                       standby=self._address(led.standby))
        return self.info(model)

    def info(self, model: str) -> dict:
        """A model's version, holders and phase (read-only)."""
        led = self._model(model, "daskdist_async_info")
        return {"model": led.model, "version": led.version, "phase": led.phase,
                "failed": led.failed, "incarnation": led.incarnation,
                "holder": self._address(led.holder), "standby": self._address(led.standby),
                "nbytes": led.nbytes}

    def report(self, model: str) -> dict:
        """Everything ``am.report()`` shows (read-only)."""
        return self._model(model, "daskdist_async_report").report(self._address)

    def reports(self) -> list[dict]:
        """Every model's report (the dashboard and the ``daskdist_async_*`` metrics)."""
        return [led.report(self._address) for led in self.models.values()]

    # -- the workers' routes --------------------------------------------------------------
    def where(self, session: str, model: str) -> dict:
        """Where a model's holder is, for a worker about to pull or push."""
        led = self.models.get(checks.text(model, "daskdist_async_where: model"))
        if led is None:
            return {"failed": f"no asynchronous model {model!r} on coordinator "
                              f"{self.co.name!r} (dropped, or its coordinator closed)"}
        plan = self.plans.get(led.model)
        if plan is not None:  # a recovery waiting for a member: this one
            self._recover(led, plan)
        self._ensure_standby(led)
        reply = {"holder": self._address(led.holder), "phase": led.phase,
                 "incarnation": led.incarnation, "version": led.version,
                 "failed": led.failed}
        led.scheduler_bytes += wire_size(reply) + 64
        return reply

    def stage(self, session: str, stage: Any) -> dict:
        """The holder received push ``stage.pid``: its rows become the model's (all of
        them, or it is refused: its pusher's session ended and they went back)."""
        op = "daskdist_async_stage"
        s = async_protocol.stage(stage, op)
        led = self.models.get(s.model)
        if led is None:
            return {"refused": f"no asynchronous model {s.model!r}"}
        led.scheduler_bytes += wire_size(stage) + 64
        why, rec = led.may_stage(session, s.incarnation, s.pid)
        if why == "duplicate" and rec is not None:
            applied = rec.state in (APPLIED, DURABLE)
            return {"duplicate": {"applied": applied, "version": rec.version,
                                  "reason": "" if applied else f"it was {rec.state}"}}
        if why:
            return {"refused": why}
        if s.tokens and not self.co.hand_rows(s.pusher, pseudo(s.model), s.tokens):
            return {"refused": "its rows are no longer leased to the pushing worker's "
                               "session (the worker was lost): they went back"}
        self.co.note_trained(s.model, s.tokens)
        led.stage(PushRecord(s.pid, s.pusher, s.address, list(s.tokens), token_rows(s.tokens),
                             s.base))
        led.paces.measured(s.address, s.steps, s.seconds)  # this round counts in its answer
        return {"staged": True, "speed": led.paces.share(s.address),
                "last": self.co.rows_only_with(pseudo(s.model), s.tokens)}

    def abandon(self, session: str, model: str, pid: str, tokens: list) -> dict:
        """A worker's push that no holder staged, as far as it knows (refused before
        staging, or its holder did not answer): if the book knows the push, its fate is
        the book's; else its rows go back from the caller's session now, and a later
        stage of it is refused. Atomic here: the pusher never gives back rows the book
        may have handed on (they may be leased to its session again)."""
        op = "daskdist_async_abandon"
        checks.text(pid, f"{op}: pid")
        checks.items(tokens, f"{op}: tokens")
        led = self.models.get(checks.text(model, f"{op}: model"))
        if led is not None:
            led.scheduler_bytes += wire_size(tokens) + 64
            if pid in led.pushes:
                return {"staged": True}
            led.abandon(PushRecord(pid, session, self._address(session), [], 0, 0))
        return {"staged": False, "released": self.co.release_rows(session, tokens)}

    def ledger(self, session: str, model: str, version: int, applied: list) -> dict:
        """``{"ledger": ...}``: the datasets' ledger a checkpoint at ``version`` keeps:
        the rows acknowledged now (every push durable so far) and those of the pushes applied up to
        ``version`` and not yet durable (``applied``: those the holder applied since its
        last copy, whose decisions may still be on their way). The holder asks before it
        applies anything later, so no push after ``version`` is among them."""
        op = "daskdist_async_ledger"
        led = self.models.get(checks.text(model, f"{op}: model"))
        if led is None:
            return {"failed": f"no asynchronous model {model!r} (dropped)"}
        version = checks.integer(version, f"{op}: version", 0, 1 << 62)
        if session != led.holder:
            raise PermissionError(f"{op}: the caller is not the holder of model {model!r}")
        led.note_applied(async_protocol.copied(
            (model, session, 0, version, applied), op).applied)
        return {"ledger": checkpoint_ledger(self.co, led, version)}

    def hand_over(self, session: str, model: str, incarnation: int, version: int,
                  standby: str) -> dict:
        """The holder's worker got a preemption deadline: it takes no more pushes and its
        standby (at ``standby``) took its state at ``version`` (every push it applied).
        The model moves to the standby from that copy, as a lost holder's does but
        losing nothing: ``{"moved": the new holder's address}``; ``{"kept": why}`` when
        it cannot (the holder serves on until its worker goes)."""
        op = "daskdist_async_hand_over"
        led = self.models.get(checks.text(model, f"{op}: model"))
        if led is None:
            return {"kept": f"no asynchronous model {model!r} (dropped)"}
        incarnation = checks.integer(incarnation, f"{op}: incarnation", 0, 1 << 62)
        version = checks.integer(version, f"{op}: version", 0, 1 << 62)
        if checks.text(standby, f"{op}: standby") != self._address(led.standby):
            return {"kept": f"its standby is {self._address(led.standby) or 'none'} now"}
        plan = led.hand_over(session, incarnation, version)
        if isinstance(plan, str):
            return {"kept": plan}
        self._recover(led, plan)
        return {"moved": self._address(led.target)}

    # -- the workers' stream messages ---------------------------------------------------
    def _arrived(self, value: Any, check: Any, op: str) -> tuple[Any, ModelLedger | None]:
        """A worker's message, checked, and its model's ledger (``None``: dropped), its
        bytes counted."""
        msg = check(value, op)
        led = self.models.get(msg.model)
        if led is not None:
            led.scheduler_bytes += wire_size(value)
        return msg, led

    def on_ready(self, session: str, ready: Any, worker: str | None = None) -> None:
        r, led = self._arrived(ready, async_protocol.ready, "daskdist-async-ready")
        if led is None:
            return
        if r.nbytes:
            led.nbytes = r.nbytes
        settle = led.recovered(session, r.incarnation, r.version, r.origin, r.source,
                               r.ledger, r.error, r.loaded)
        settle_rows(self.co, led.model, settle)
        if led.phase == FAILED:
            logger.error("daskdist[%s]: model %s: %s", self.co.name, led.model, led.failed)
        self._wake(led)
        self._ensure_standby(led)

    def on_decided(self, session: str, decision: Any, worker: str | None = None) -> None:
        d, led = self._arrived(decision, async_protocol.decision, "daskdist-async-decided")
        if led is None:
            return
        alone = led.standby is None and self._pick((led.holder,)) is None  # none to copy to
        settle = led.decided(session, d.incarnation, d.pid, d.applied, d.version, d.staleness,
                             alone, d.round_bytes)
        settle_rows(self.co, led.model, settle)
        self._ensure_standby(led)

    def on_copied(self, session: str, copy: Any, worker: str | None = None) -> None:
        c, led = self._arrived(copy, async_protocol.copied, "daskdist-async-copied")
        if led is not None:
            settle_rows(self.co, led.model,
                        led.copied(session, c.incarnation, c.version, c.applied))

    def on_checkpointed(self, session: str, checkpointed: Any,
                        worker: str | None = None) -> None:
        c = checks.named(checkpointed, "daskdist-async-checkpointed",
                         async_protocol.Checkpointed)
        led = self.models.get(c.model)
        if led is None or session != led.holder:
            return
        settle_rows(self.co, led.model, led.checkpointed_at(checks.integer(
            c.version, "daskdist-async-checkpointed: version", 0, 1 << 62)))

    # -- the coordinator's events -----------------------------------------------------------
    def session_lost(self, session: str, address: str) -> None:
        """A member's session ended (the coordinator calls this after the membership
        dropped it): a lost holder's model recovers, a lost standby is replaced, and its
        worker's pace (``address``) no longer scales the others' steps."""
        for led in list(self.models.values()):
            led.paces.forget(address)
            if led.phase == FAILED:
                continue
            if session == led.holder or (session == led.target and led.phase == MOVING):
                if session == led.standby:
                    led.standby_lost()
                self._recover(led, led.holder_lost(self.co.members.__contains__))
            elif session == led.target and led.phase == STARTING:
                target = self._pick((session,))
                if target is not None:
                    led.aim(target)
                    self._role(led, target, HOLDER, FRESH, 0, spec=True)
            if session == led.standby:
                led.standby_lost()
            self._ensure_standby(led)

    def standby_leaving(self, session: str) -> None:
        """``session``'s worker got a preemption deadline: a model whose standby it is
        gets another now, ahead of the deadline (the holder copies to it at once; a
        holder lost meanwhile recovers from a checkpoint as with no standby), and the
        old one drops its copy. With no other member to take it, it keeps it."""
        for led in list(self.models.values()):
            if led.phase != READY or session != led.standby:
                continue
            if self._pick((led.holder, session)) is None:
                continue
            led.standby_lost()
            self._role(led, session, NONE)
            self._ensure_standby(led)

    def member_joined(self) -> None:
        """A session joined: a model without a standby (or a recovery's target) gets it."""
        for led in list(self.models.values()):
            plan = self.plans.get(led.model)
            if plan is not None:
                self._recover(led, plan)
            self._ensure_standby(led)

    def _forget(self, led: ModelLedger, why: str) -> None:
        for s in {led.holder, led.standby, led.target} - {None}:
            self._role(led, s, NONE)
        settle_rows(self.co, led.model, led.fail(why))
        self._wake(led)
        self.models.pop(led.model, None)
        self.specs.pop(led.model, None)
        self.plans.pop(led.model, None)
        self.by_replica.pop(led.replica, None)

    def drop_owner(self, owner: str) -> None:
        """An owner was dropped (closed, its client gone past ``client-grace``, or kept
        alive and attached to by nobody within ``keep-alive-timeout``): its models go,
        their open rows back to the pool. A keep-alive owner's client leaving drops
        nothing: its models train on for whoever attaches."""
        for led in [led for led in self.models.values() if led.owner == owner]:
            self._forget(led, "its coordinator closed")

    def replicas_released(self, rids: list[str]) -> None:
        """Per-worker resources released (handles dropped, the closures before them done):
        a model whose replicas one was goes, its open rows back to the pool."""
        for rid in rids:
            led = self.models.get(self.by_replica.get(rid, ""))
            if led is not None:
                self._forget(led, "its handle was dropped")

    def close(self) -> None:
        for led in list(self.models.values()):
            self._forget(led, "its coordinator closed")

    def status(self) -> dict:
        """Each model's few counts (``coord.status()``)."""
        return {m: led.summary() for m, led in self.models.items()}


# The book's routes (the plugin registers each on the named coordinator's book,
# protocol.book_handler). A worker's session is checked (and renewed) by its route; a
# stream message from an ended session is dropped there.
ASYNC_ROUTES = {
    "daskdist_async_create": Route(AsyncBook.create, caller=OWNER),
    "daskdist_async_checkpoint": Route(AsyncBook.configure, caller=OWNER),
    "daskdist_async_info": Route(AsyncBook.info, caller=ANY),
    "daskdist_async_report": Route(AsyncBook.report, caller=ANY),
    "daskdist_async_where": Route(AsyncBook.where, SESSION_ENDED, SESSION),
    "daskdist_async_stage": Route(AsyncBook.stage, SESSION_ENDED, SESSION),
    "daskdist_async_ledger": Route(AsyncBook.ledger, SESSION_ENDED, SESSION),
    "daskdist_async_abandon": Route(AsyncBook.abandon, SESSION_ENDED, SESSION),
    "daskdist_async_hand_over": Route(AsyncBook.hand_over, SESSION_ENDED, SESSION),
}
ASYNC_STREAM_ROUTES = {
    "daskdist-async-ready": Route(AsyncBook.on_ready, None, SESSION, None),
    "daskdist-async-decided": Route(AsyncBook.on_decided, None, SESSION, None),
    "daskdist-async-copied": Route(AsyncBook.on_copied, None, SESSION, None),
    "daskdist-async-checkpointed": Route(AsyncBook.on_checkpointed, None, SESSION, None),
}
