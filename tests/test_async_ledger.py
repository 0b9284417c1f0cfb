"""The scheduler's ledger of an asynchronously trained model (pure), driven against a
simulated holder, standby and checkpoint store by hypothesis: pushes staged, applied or
refused; decisions delivered late (the holder's stream) while copies report at once
(the standby's); copies, checkpoints, holder and standby losses and recoveries, and
hand-overs before a holder's deadline, in any order. Invariants: a push's rows are
settled once (acknowledged or given back, never both, never twice); while the model
serves, every acknowledged push is in the holder's model; once everything is decided
and copied, the acknowledged pushes are exactly the pushes in the global model; a
hand-over loses no applied push; versions never go back."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from daskdist.core.asynchronous.ledger import FAILED, READY, ModelLedger, PushRecord
from daskdist.core.asynchronous.protocol import CHECKPOINT, COPY, FRESH

pytestmark = pytest.mark.timeout(120)


class Sim(RuleBasedStateMachine):
    """The book's side is the ledger; the workers' side is simulated here."""

    def __init__(self) -> None:
        super().__init__()
        self.led = ModelLedger("m", "owner", max_staleness=1 << 20)
        self.sessions = iter(f"s{i}" for i in range(10_000))
        self.alive: set[str] = set()
        holder = self._join()
        self.led.aim(holder)
        self.led.recovered(holder, 0, 0, 0, FRESH, {})
        self.content: set[str] = set()  # the pushes in the holder's model
        self.version = 0  # the holder's
        self.standby_copy: tuple[int, set[str]] | None = None
        # every checkpoint written: (writer's model id, incarnation, version, content, ledger)
        self.checkpoints: list[tuple[str, int, int, set[str], set[str]]] = []
        self.reports: list[tuple] = []  # the holder's stream, not yet delivered
        self.staged: list[str] = []  # staged, not decided by the holder
        self.acked: set[str] = set()
        self.given_back: set[str] = set()
        self.n = 0
        self.seen_versions = [0]
        self.log: list[tuple[str, int]] = []  # applied since the last copy

    def _join(self) -> str:
        s = next(self.sessions)
        self.alive.add(s)
        return s

    def _apply(self, settle) -> None:
        for rec in settle.ack:
            assert rec.pid not in self.acked, f"{rec.pid} acknowledged twice"
            assert rec.pid not in self.given_back, f"{rec.pid} given back, then acknowledged"
            self.acked.add(rec.pid)
        for rec in settle.release:
            assert rec.pid not in self.acked, f"{rec.pid} acknowledged, then given back"
            assert rec.pid not in self.given_back, f"{rec.pid} given back twice"
            self.given_back.add(rec.pid)
        if settle.restore is not None:  # restore_epoch: acknowledged := the ledger's
            freed = self.acked - settle.restore["pids"]
            self.acked = set(settle.restore["pids"])
            self.given_back |= freed

    @property
    def serving(self) -> bool:
        return self.led.phase == READY

    # -- pushes -------------------------------------------------------------------------
    @precondition(lambda self: self.serving)
    @rule()
    def stage(self) -> None:
        self.n += 1
        pid = f"p{self.n}"
        why, _ = self.led.may_stage(self.led.holder, self.led.incarnation, pid)
        assert why == ""
        self.led.stage(PushRecord(pid, "pusher", "w", [], 1, self.version))
        self.staged.append(pid)

    @precondition(lambda self: self.serving and self.staged)
    @rule(applied=st.booleans())
    def decide(self, applied: bool) -> None:
        pid = self.staged.pop(0)  # arrival order
        if applied:
            self.version += 1
            self.content.add(pid)
            self.log.append((pid, self.version))
        self.reports.append(("decided", self.led.holder, self.led.incarnation, pid, applied,
                             self.version))

    @precondition(lambda self: self.serving and self.reports)
    @rule()
    def deliver(self) -> None:
        report = self.reports.pop(0)
        if report[0] == "decided":
            _, holder, inc, pid, applied, version = report
            alone = self.led.standby is None and len(self.alive) == 1
            self._apply(self.led.decided(holder, inc, pid, applied, version, 0, alone))
        else:
            _, holder, version = report
            if holder == self.led.holder:
                self._apply(self.led.checkpointed_at(version))

    # -- copies and checkpoints -----------------------------------------------------------
    @precondition(lambda self: self.serving and self.led.standby is not None)
    @rule()
    def copy(self) -> None:
        self.standby_copy = (self.version, set(self.content))
        listed, self.log = self.log, []
        self._apply(self.led.copied(self.led.standby, self.led.incarnation, self.version,
                                    listed))

    @precondition(lambda self: self.serving)
    @rule()
    def checkpoint_now(self) -> None:
        """The holder writes its model at its version with the book's ledger for it."""
        self.led.checkpoint = ("url", 1)
        self.led.note_applied(self.log)  # the holder's ledger request lists them
        ledger = self.acked | {r.pid for r in self.led.pending_rows(self.version)}
        assert ledger <= self.content, "a checkpoint's ledger names a push not in it"
        self.checkpoints.append(("m", self.led.incarnation, self.version, set(self.content),
                                 ledger))
        self.reports.append(("checkpointed", self.led.holder, self.version))

    # -- membership -----------------------------------------------------------------------
    @precondition(lambda self: self.serving and self.led.standby is None)
    @rule()
    def new_standby(self) -> None:
        self.led.set_standby(self._join())
        self.standby_copy = None
        self.log = list(self.log)  # the next copy lists what is not yet copied

    @precondition(lambda self: self.led.standby is not None and self.serving)
    @rule()
    def lose_standby(self) -> None:
        self.alive.discard(self.led.standby)
        self.led.standby_lost()
        self.standby_copy = None

    @precondition(lambda self: self.serving)
    @rule()
    def lose_holder(self) -> None:
        self.alive.discard(self.led.holder)
        self.reports.clear()  # the lost holder's stream: never delivered
        self.staged.clear()
        plan = self.led.holder_lost(lambda s: s in self.alive)
        if not plan.source:
            self._apply(self.led.fail(plan.reason))
            return
        lineage = self.led.lineage()  # what the role message carries
        target = plan.target or self._join()
        self.led.aim(target)
        origin, content, ledger, loaded, source = 0, set(), {}, [], plan.source
        if plan.source == COPY:
            origin, content = self.standby_copy
        elif plan.source == CHECKPOINT:
            found = [c for c in self.checkpoints if any(
                [m, i] == [c[0], c[1]] and (cap < 0 or c[2] <= cap) for m, i, cap in lineage)]
            if found:
                m, i, origin, content, pids = max(found, key=lambda c: c[2])
                ledger, loaded = {"pids": set(pids)}, [m, i]
            else:
                source = FRESH
        version = max(plan.version, origin)
        self._apply(self.led.recovered(target, plan.incarnation, version, origin, source,
                                       ledger, "", loaded))
        if self.led.phase == FAILED:
            return
        self.content, self.version = set(content), version
        self.standby_copy, self.log = None, []
        assert self.led.standby is None  # the new incarnation's standby is assigned anew
        self.seen_versions.append(self.led.version)

    @precondition(lambda self: self.serving and self.led.standby is not None)
    @rule()
    def hand_over(self) -> None:
        """The holder's worker got a deadline: it decides what it took, copies its state
        to its standby and the model moves there; the holder's decisions arrive late and
        the standby's copy report after the move."""
        while self.staged:
            self.decide(True)
        holder, inc, standby = self.led.holder, self.led.incarnation, self.led.standby
        lost = self.led.lost_rows
        plan = self.led.hand_over(holder, inc, self.version)
        assert (plan.source, plan.target) == (COPY, standby), plan
        listed, self.log = self.log, []
        self._apply(self.led.copied(standby, inc, self.version, listed))
        self.alive.discard(holder)  # it leaves
        self.led.aim(standby)
        version = max(plan.version, self.version)
        self._apply(self.led.recovered(standby, plan.incarnation, version, self.version,
                                       COPY, {}, ""))
        assert self.led.phase == READY and self.led.lost_rows == lost
        self.version, self.standby_copy = version, None
        self.seen_versions.append(self.led.version)

    @rule()
    def wait(self) -> None:
        """Nothing happens (a failed model stays failed)."""

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def acknowledged_pushes_are_in_the_model(self) -> None:
        if self.serving:
            assert self.acked <= self.content, sorted(self.acked - self.content)
            assert not (self.acked & self.given_back)

    @invariant()
    def versions_never_go_back(self) -> None:
        self.seen_versions.append(self.led.version)
        assert self.seen_versions == sorted(self.seen_versions)

    def teardown(self) -> None:
        """Drain: decide and deliver everything, copy: exactly the model's pushes are
        acknowledged."""
        if not self.serving:
            return
        while self.staged:
            self.decide(True)
        while self.reports:
            self.deliver()
        if self.led.standby is None:
            self.new_standby()
        self.copy()
        assert self.acked == self.content, (sorted(self.acked ^ self.content))
        assert not self.led.open


TestLedgerUnderLosses = Sim.TestCase
TestLedgerUnderLosses.settings = __import__("hypothesis").settings(
    max_examples=150, stateful_step_count=40, deadline=None)


def test_a_refused_push_gives_its_rows_back_and_counts_for_its_worker():
    led = ModelLedger("m", "o", max_staleness=2)
    led.aim("h")
    led.recovered("h", 0, 0, 0, FRESH, {})
    led.stage(PushRecord("p", "s", "tcp://w", ["t"], 7, 0))
    settle = led.decided("h", 0, "p", False, 0, 5, alone=False)
    assert [r.pid for r in settle.release] == ["p"] and not settle.ack
    r = led.report(lambda s: s or "")
    assert r["refused"] == 1 and r["workers"][0]["refused"] == 1 and r["rows_released"] == 7


def test_a_retried_push_is_a_duplicate_with_its_fate():
    led = ModelLedger("m", "o", max_staleness=2)
    led.aim("h")
    led.recovered("h", 0, 0, 0, FRESH, {})
    led.stage(PushRecord("p", "s", "w", [], 0, 0))
    led.decided("h", 0, "p", True, 1, 0, alone=True)
    why, rec = led.may_stage("h", 0, "p")
    assert why == "duplicate" and rec.version == 1 and rec.state == "durable"


def test_every_holder_lost_without_a_checkpoint_fails_clearly():
    led = ModelLedger("m", "o", max_staleness=2)
    led.aim("h")
    led.recovered("h", 0, 0, 0, FRESH, {})
    led.stage(PushRecord("p", "s", "w", ["t"], 3, 0))
    led.decided("h", 0, "p", True, 1, 0, alone=True)  # durable: its rows acknowledged
    led.stage(PushRecord("q", "s", "w", ["t"], 3, 1))
    led.decided("h", 0, "q", True, 2, 0, alone=False)
    plan = led.holder_lost(lambda s: False)
    assert plan.source == "" and "no checkpoint_to" in plan.reason
    settle = led.fail(plan.reason)
    assert [r.pid for r in settle.release] == ["q"]
    assert led.phase == FAILED and led.may_stage("h", 1, "r")[0] == plan.reason


def test_nothing_durable_yet_restarts_fresh_on_a_holder_loss():
    led = ModelLedger("m", "o", max_staleness=2)
    led.aim("h")
    led.recovered("h", 0, 0, 0, FRESH, {})
    led.stage(PushRecord("p", "s", "w", ["t"], 3, 0))
    led.decided("h", 0, "p", True, 1, 0, alone=False)  # applied, no copy yet
    plan = led.holder_lost(lambda s: False)
    assert plan.source == FRESH and plan.version == 2
    led.aim("h2")
    settle = led.recovered("h2", plan.incarnation, plan.version, 0, FRESH, {})
    assert [r.pid for r in settle.release] == ["p"]  # its rows go back
    assert led.phase == READY and led.version == 2
