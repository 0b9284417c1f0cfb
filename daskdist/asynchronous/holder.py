"""The asynchronous models one worker keeps for one coordinator: the global models it
holds (:class:`Held`) and the standby copies it keeps (:class:`Standby`), and the roles
the scheduler's book gives it (:class:`AsyncService`).

A holder applies pushes one at a time, in the order they arrived: each push is first
*staged* with the scheduler (the rows it consumed become the model's), then applied in
the holder's one apply thread; its decision goes to the scheduler on the worker's
stream. A push already decided (a retry) gets its first answer again. Pulls are
served from the bytes packed once per version. The holder copies its state to its
standby every ``daskdist.asynchronous.standby-every`` versions, or
``standby-interval`` after the oldest version not yet copied, or as soon as no push came
for ``standby-idle``, or at once after a push the scheduler says holds its epochs' last
rows (the epoch's end waits on that copy); the standby tells the scheduler, which
acknowledges the rows of the pushes the copy holds.
With ``checkpoint_to``, the holder writes a checkpoint every ``every`` versions, with
the datasets' ledger at that version. When its worker gets a preemption deadline
(:func:`daskdist.session.preemption.on_preemption`) within
``daskdist.preemption.horizon``, the holder hands the model over first: it takes no
new push, decides those in flight, copies its state to its standby and asks the book to
move the model there (``daskdist_async_hand_over``): no applied delta is lost.

Everything runs on the worker's event loop except the apply thread (and checkpoint
writes); messages to the scheduler go on the worker's own stream, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed.protocol.pickle import loads
from distributed.utils import sync

from daskdist import config
from daskdist.asynchronous.model import GlobalModel
from daskdist.collective.state.checkpoint import CheckpointStore
from daskdist.core.asynchronous.protocol import (
    CHECKPOINT,
    COPY,
    FRESH,
    NONE,
    SAME,
    STANDBY,
    AsyncRole,
    Checkpointed,
    Copied,
    Decision,
    Pulled,
    Push,
    Ready,
    Stage,
)
from daskdist.core.protocol import Preemption, is_session_ended
from daskdist.session.preemption import on_preemption, preemption_of

logger = logging.getLogger(__name__)

_SERVICES: dict[tuple[str, str], AsyncService] = {}  # (worker address, coordinator)
KEEP_DECIDED = 4096  # decisions a holder remembers for retried pushes


def service(worker: Any, name: str) -> AsyncService:
    """This worker's asynchronous models of coordinator ``name`` (made on first use)."""
    key = (worker.address, name)
    svc = _SERVICES.get(key)
    if svc is None or svc.worker is not worker:
        svc = _SERVICES[key] = AsyncService(worker, name)
    return svc


class Standby:
    """A copy of a model's holder, kept to take over when the holder is lost."""

    def __init__(self, role: AsyncRole, spec: bytes) -> None:
        self.session = role.session
        self.incarnation = role.incarnation
        self.spec = spec
        self.version: int | None = None
        self.blob: bytes | None = None


class Held:
    """One global model this worker holds (see the module doc)."""

    def __init__(self, svc: AsyncService, role: AsyncRole, gm: GlobalModel) -> None:
        self.svc = svc
        self.model = role.model
        self.session = role.session
        self.gm = gm
        self.standby = role.standby
        self.executor = ThreadPoolExecutor(  # named by its model (seen in a stack dump)
            1, thread_name_prefix=f"daskdist-async-apply-{role.model}")
        self.order = asyncio.Lock()  # pushes in arrival order
        self.decided: OrderedDict[str, dict] = OrderedDict()
        self.inflight: dict[str, asyncio.Future] = {}
        self.log: list[tuple[str, int]] = []  # (pid, version) applied, not yet in a copy
        self.copied = -1  # the version the standby last took (-1: none)
        self.first_uncopied = 0.0  # when the oldest version not yet copied was applied
        self.last_push = time.monotonic()
        self.urgent = -1  # a version to copy at once: it holds an epoch's last rows
        self.changed = asyncio.Event()
        self.closed = False
        self.store: CheckpointStore | None = None
        self.every = 0
        self.last_checkpoint = gm.version
        self.configure(role.checkpoint)
        self.copier = asyncio.ensure_future(self._copy_loop())
        # a preemption deadline: ``due`` once within the horizon, then ``leaving`` (no
        # push taken) while the model is handed over
        self.due = self.leaving = False
        self._due_timer: asyncio.TimerHandle | None = None
        self._handing: asyncio.Task | None = None
        self._unlisten = on_preemption(self._deadline)
        notice = preemption_of(svc.worker.address)
        if notice is not None:
            self._deadline(svc.worker.address, notice)

    def configure(self, checkpoint: list) -> None:
        if checkpoint:
            url, every = checkpoint[:2]
            if self.store is None or self.store.url != str(url).rstrip("/"):
                self.store = CheckpointStore(url)
            self.every = int(every)

    def set_standby(self, address: str) -> None:
        if address != self.standby:
            self.standby = address
            self.copied = -1  # a new standby takes a whole copy at once
        self.changed.set()
        self._leave()  # a deadline came before a standby did

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._unlisten()
        if self._due_timer is not None:
            self._due_timer.cancel()
        self.copier.cancel()
        self.changed.set()
        self.executor.shutdown(wait=False)
        if self.store is not None:
            self.store.close()

    # -- pushes ---------------------------------------------------------------------------
    async def push(self, p: Push) -> dict:
        """Decide push ``p`` (stage, then apply in arrival order); a retry gets the
        first decision."""
        if self.closed:
            return {"moved": True}
        done = self.decided.get(p.pid)
        if done is not None:
            return done
        if self.leaving:  # handed over: its pusher asks the book where the model went
            return {"moved": True}
        running = self.inflight.get(p.pid)
        if running is not None:
            return await asyncio.shield(running)
        fut = asyncio.get_running_loop().create_future()
        self.inflight[p.pid] = fut
        try:
            staging = asyncio.ensure_future(self._stage(p))
            async with self.order:
                reply = await self._decide(p, staging)
            if not reply.get("moved"):
                self.decided[p.pid] = reply
                while len(self.decided) > KEEP_DECIDED:
                    self.decided.popitem(last=False)
            fut.set_result(reply)
            return reply
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: a retry waiting on it gets it
            raise
        finally:
            self.inflight.pop(p.pid, None)

    async def _stage(self, p: Push) -> dict:
        stage = Stage(self.model, self.gm.incarnation, p.pid, p.pusher, p.address,
                      list(p.tokens), int(p.base), int(p.steps), float(p.seconds))
        return await self.svc.worker.scheduler.daskdist_async_stage(
            name=self.svc.name, session=self.session, stage=tuple(stage))

    async def _decide(self, p: Push, staging: asyncio.Future) -> dict:
        gm = self.gm
        try:
            st = await staging
        except Exception as e:  # noqa: BLE001 - unknown: refused, and said so below
            st = {"refused": f"the scheduler could not stage it: {e!r}", "unsure": True}
        if is_session_ended(st) or self.closed:
            self.svc.drop(self.model)
            return {"moved": True}
        if "duplicate" in st:  # staged before (a retry): the book has its fate
            d = st["duplicate"]
            return {"applied": bool(d["applied"]), "version": int(d["version"]),
                    "staleness": 0, "reason": "" if d["applied"] else d.get("reason", ""),
                    "staged": True}
        if "refused" in st:
            if st.get("unsure"):  # it may have been staged: its rows go back if so
                self._report(p, False, gm.version, 0, st["refused"])
            return {"applied": False, "version": gm.version, "staleness": 0,
                    "reason": st["refused"], "staged": False}
        loop = asyncio.get_running_loop()
        error = ""
        try:
            applied, version, staleness, reason = await loop.run_in_executor(
                self.executor, gm.apply, p)
        except (ValueError, TypeError, RuntimeError) as e:  # not this model's delta
            applied, version, staleness, reason = False, gm.version, 0, str(e)
            error = str(e)
        self.last_push = time.monotonic()
        if applied:
            if not self.log:
                self.first_uncopied = self.last_push
            self.log.append((p.pid, version))
            if st.get("last"):
                self.urgent = version
            self.changed.set()
        self._report(p, applied, version, staleness, reason)
        if applied and self.store is not None and version - self.last_checkpoint >= self.every:
            self.last_checkpoint = version
            try:
                loop.run_in_executor(self.executor, self._checkpoint)
            except RuntimeError:  # closed meanwhile: its successor checkpoints
                pass
        out = {"applied": applied, "version": version, "staleness": staleness,
               "reason": reason, "speed": float(st.get("speed", 1.0)), "staged": True}
        if error:
            out["error"] = error
        return out

    def _report(self, p: Push, applied: bool, version: int, staleness: int, reason: str) -> None:
        d = Decision(self.model, self.session, self.gm.incarnation, p.pid, applied,
                     int(version), int(staleness), reason[:4000], int(p.round_bytes))
        self.svc.send("daskdist-async-decided", self.session, decision=tuple(d))

    # -- pulls ------------------------------------------------------------------------------
    async def pull(self, incarnation: int, version: int) -> tuple:
        gm = self.gm
        if (incarnation, version) == (gm.incarnation, gm.version):
            gm.pulled(version)
            return tuple(Pulled(self.model, gm.incarnation, gm.version, True, [], 0, b"", b""))
        loop = asyncio.get_running_loop()
        v, params, buffers = await loop.run_in_executor(self.executor, gm.served)
        return tuple(Pulled(self.model, gm.incarnation, v, False, gm.layout,
                            len(gm.param_layout), params, buffers))

    # -- the standby's copies -------------------------------------------------------------
    async def _copy_loop(self) -> None:
        every = int(config.get("asynchronous.standby-every"))
        interval = config.seconds("asynchronous.standby-interval")
        idle = config.seconds("asynchronous.standby-idle")
        while not self.closed:
            now = time.monotonic()
            behind = self.gm.version != self.copied
            if not self.standby or not behind:
                self.changed.clear()
                await self.changed.wait()
                continue
            due = (self.copied < 0 or self.gm.version - self.copied >= every
                   or self.urgent > self.copied
                   or now - self.first_uncopied >= interval or now - self.last_push >= idle)
            if not due:
                self.changed.clear()
                wait = min(interval - (now - self.first_uncopied), idle - (now - self.last_push))
                try:
                    await asyncio.wait_for(self.changed.wait(), max(0.01, wait))
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                await self._copy()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the standby is gone or busy: retry
                logger.info("daskdist: copy of model %s to its standby %s failed: %r",
                            self.model, self.standby, e)
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), interval)
                except asyncio.TimeoutError:
                    pass

    async def _copy(self) -> None:
        standby = self.standby
        loop = asyncio.get_running_loop()
        version, blob = await loop.run_in_executor(self.executor, self.gm.snapshot)
        applied = [(pid, v) for pid, v in self.log if v <= version]
        ok = await self.svc.worker.rpc(standby).daskdist_async_copy(
            name=self.svc.name, model=self.model, incarnation=self.gm.incarnation,
            version=version, blob=blob, applied=applied)
        if ok is not True:
            raise RuntimeError(f"the standby refused the copy: {ok!r}")
        if standby == self.standby:
            self.copied = version
            self.log = [(pid, v) for pid, v in self.log if v > version]
            if self.log:
                self.first_uncopied = time.monotonic()

    # -- a preemption deadline: hand the model over first ---------------------------------
    def _deadline(self, address: str, notice: Preemption) -> None:
        """Worker ``address`` will be taken away (an :func:`on_preemption` listener):
        this holder's worker hands the model over once the deadline is within
        ``daskdist.preemption.horizon``."""
        if address == self.svc.worker.address and not self.closed:
            self.svc.worker.loop.add_callback(self._arm, notice.deadline)

    def _arm(self, deadline: float) -> None:
        if self._due_timer is not None:
            self._due_timer.cancel()
        wait = deadline - config.seconds("preemption.horizon") - time.time()
        self._due_timer = asyncio.get_running_loop().call_later(max(0.0, wait), self._due)

    def _due(self) -> None:
        self._due_timer = None
        self.due = True
        self._leave()

    def _leave(self) -> None:
        """Start the hand-over, once due and with a standby to take the model."""
        if self.due and self.standby and not (self.leaving or self.closed):
            self.leaving = True  # no new push from now on
            self._handing = asyncio.ensure_future(self._hand_over())

    async def _hand_over(self) -> None:
        """The pushes that came first are decided, the standby takes the state at the
        newest version, then the book moves the model there (this holder drops it); if
        it cannot, this holder serves on (and tries again with its next standby)."""
        standby, reply = self.standby, None
        try:
            async with self.order:
                await self._copy()
                if self.copied == self.gm.version and standby == self.standby:
                    reply = await self.svc.worker.scheduler.daskdist_async_hand_over(
                        name=self.svc.name, session=self.session, model=self.model,
                        incarnation=self.gm.incarnation, version=self.copied,
                        standby=standby)
        except Exception as e:  # noqa: BLE001 - the standby or the scheduler is gone
            reply = {"kept": repr(e)}
        if isinstance(reply, dict) and "moved" in reply:
            logger.info("daskdist: model %s handed over to %s before this worker's "
                        "preemption deadline", self.model, reply["moved"])
            if self.svc.held.get(self.model) is self:
                self.svc.drop(self.model)
            return
        logger.warning("daskdist: model %s could not be handed over before this worker's "
                       "preemption deadline (%s): it serves on", self.model,
                       (reply or {}).get("kept", "its standby changed"))
        self.leaving = False

    # -- checkpoints ----------------------------------------------------------------------
    def _checkpoint(self) -> None:
        """Write the model at its version now (the apply thread: no push is applied
        until the ledger of this version is taken)."""
        store = self.store
        if store is None or store.writing:
            return
        gm = self.gm
        version = gm.version
        model_state, outer_state = gm.checkpoint_state()
        applied = [[pid, v] for pid, v in list(self.log) if v <= version]
        try:
            reply = sync(self.svc.worker.loop, self.svc.worker.scheduler.daskdist_async_ledger,
                          name=self.svc.name, session=self.session, model=self.model,
                          version=version, applied=applied,
                          callback_timeout=config.seconds("worker.rpc-timeout"))
        except Exception as e:  # noqa: BLE001 - no ledger, no checkpoint: try next time
            logger.warning("daskdist: checkpoint of model %s skipped: %r", self.model, e)
            return
        ledger = reply.get("ledger") if isinstance(reply, dict) else None
        if not isinstance(ledger, dict):  # its session ended, or the model was dropped
            return
        record = {"model": self.model, "incarnation": gm.incarnation, "version": version,
                  "ledger": ledger}
        fut = store.write(version, model_state, outer_state, {}, record)
        if fut is not None:
            fut.add_done_callback(lambda f: self._written(f, version))

    def _written(self, fut: Any, version: int) -> None:
        try:
            w = fut.result()
        except Exception as e:  # noqa: BLE001 - a failed write is logged; training goes on
            logger.warning("daskdist: checkpoint of model %s failed: %r", self.model, e)
            return
        c = Checkpointed(self.model, self.session, version, w.info.url, float(w.seconds),
                         int(w.nbytes))
        self.svc.worker.loop.add_callback(
            self.svc.send, "daskdist-async-checkpointed", self.session, checkpointed=tuple(c))


class AsyncService:
    """The roles one worker has for one coordinator's asynchronous models."""

    def __init__(self, worker: Any, name: str) -> None:
        self.worker = worker
        self.name = name
        self.held: dict[str, Held] = {}
        self.standbys: dict[str, Standby] = {}
        self.specs: dict[str, bytes] = {}
        self._tasks: set[asyncio.Task] = set()

    def send(self, op: str, session: str, **fields: Any) -> None:
        """A message to the scheduler on this worker's stream (event loop)."""
        self.worker.batched_send({"op": op, "name": self.name, "session": session, **fields})

    def drop(self, model: str) -> None:
        held = self.held.pop(model, None)
        if held is not None:
            held.close()
        self.standbys.pop(model, None)

    def on_role(self, role: AsyncRole) -> None:
        """The book's word (a stream message, event loop)."""
        if role.spec:
            self.specs[role.model] = role.spec
        if role.role == NONE:
            self.drop(role.model)
            self.specs.pop(role.model, None)
            return
        if role.role == STANDBY:
            held = self.held.pop(role.model, None)
            if held is not None:
                held.close()
            self.standbys[role.model] = Standby(role, self.specs.get(role.model, b""))
            return
        held = self.held.get(role.model)
        if role.source == SAME:  # a new standby, or a checkpoint setting
            if held is not None and held.session == role.session:
                held.set_standby(role.standby)
                held.configure(role.checkpoint)
            return
        task = asyncio.ensure_future(self._become_holder(role))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _become_holder(self, role: AsyncRole) -> None:
        origin, ledger, loaded = 0, {}, []
        source = role.source
        try:
            spec = loads(self.specs[role.model])
            old = self.held.pop(role.model, None)
            gm = old.gm if old is not None and source == CHECKPOINT else None
            if old is not None:
                async with old.order:  # its pushes in flight are decided first
                    old.close()
            if gm is None:
                gm = await asyncio.to_thread(GlobalModel, spec)
            if source == COPY:
                standby = self.standbys.pop(role.model, None)
                if standby is None or standby.blob is None:
                    raise RuntimeError(f"this worker keeps no copy of model {role.model}")
                origin = await asyncio.to_thread(gm.restore, standby.blob)
            elif source == CHECKPOINT:
                origin, ledger, loaded = await asyncio.to_thread(_load_newest, gm,
                                                                 role.checkpoint)
                if not origin:
                    source = FRESH
            gm.version = max(int(role.version), origin)
            gm.incarnation = int(role.incarnation)
            held = Held(self, role, gm)
            held.copied = -1
            self.held[role.model] = held
            ready = Ready(role.model, role.session, role.incarnation, gm.version, origin,
                          source, gm.nbytes, ledger, loaded)
        except Exception as e:  # noqa: BLE001 - the book hears why (and the client)
            logger.warning("daskdist: this worker could not hold model %s: %r", role.model, e)
            ready = Ready(role.model, role.session, role.incarnation, 0, 0, role.source, 0,
                          {}, [], f"{type(e).__name__}: {e}")
        self.send("daskdist-async-ready", role.session, ready=tuple(ready))

    async def push(self, p: Push) -> dict:
        held = self.held.get(p.model)
        if held is None:
            return {"moved": True}
        return await held.push(p)

    async def pull(self, model: str, incarnation: int, version: int) -> tuple | dict:
        held = self.held.get(model)
        if held is None or held.closed:
            return {"moved": True}
        return await held.pull(int(incarnation), int(version))

    def copy(self, model: str, incarnation: int, version: int, blob: bytes,
             applied: list) -> bool | str:
        """A holder's copy for this worker's standby (kept, then reported)."""
        standby = self.standbys.get(model)
        if standby is None or standby.incarnation != int(incarnation):
            return "not the standby of this model's holder"
        if standby.version is not None and int(version) < standby.version:
            return True  # an older copy overtaken by a newer one
        standby.version, standby.blob = int(version), blob
        c = Copied(model, standby.session, int(incarnation), int(version),
                   [list(a) for a in applied])
        self.send("daskdist-async-copied", standby.session, copy=tuple(c))
        return True


def _load_newest(gm: GlobalModel, checkpoint: list) -> tuple[int, dict, list]:
    """Load into ``gm`` the newest complete checkpoint under the model's URL that is on
    its lineage (``checkpoint[2]``: ``[[model id, incarnation, newest version], ...]``,
    ``-1`` any version; ``None``: any checkpoint): ``(its version, its datasets'
    ledger, [its writer's model id, incarnation])``; ``(0, {}, [])`` when there is none."""
    if not checkpoint:
        return 0, {}, []
    lineage = checkpoint[2] if len(checkpoint) > 2 else None
    store = CheckpointStore(checkpoint[0])
    try:
        for info in reversed(store.complete()):
            _, extra = store.load(info, None)
            record = extra["record"]
            version = int(record.get("version", info.commits))
            writer = [str(record.get("model", "")), int(record.get("incarnation", 0))]
            if lineage is not None and not any(
                    [m, i] == writer and (cap < 0 or version <= cap) for m, i, cap in lineage):
                continue  # a state the model no longer descends from
            _, extra = store.load(info, gm.module.state_dict())
            gm.outer.load_state_dict(extra["optimizer"])
            return version, dict(record.get("ledger") or {}), writer
        return 0, {}, []
    finally:
        store.close()
