"""The closure's Step defers a commit's message until the synced loop hands out the next
batch (``Step.defer``; no worker: a closure scope and futures made here)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from daskdist.collective.step.step import Late, this_step
from daskdist.session.scope import ClosureScope, closure_scope


def _sender(sent: list, value=True):
    def send():
        sent.append(threading.current_thread().name)
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(value)
        return f
    return send


def test_outside_a_loop_it_is_sent_at_once_and_its_error_raised_there():
    sent: list = []
    late = Late.now(_sender(sent))  # outside a closure: no step to defer it
    assert sent and late.result(1) is True
    with closure_scope(ClosureScope()):  # a closure, no synced loop in it

        def broken():
            raise RuntimeError("session ended")

        with pytest.raises(RuntimeError, match="session ended"):
            this_step().defer(broken)


def test_inside_a_loop_it_waits_for_the_next_batch_or_for_its_answer():
    sent: list = []
    scope = ClosureScope()
    with closure_scope(scope):
        step = this_step()
        outer = step.open_loop()
        first = step.defer(_sender(sent))
        assert sent == []  # queued
        step.flush()  # the loop hands out a batch
        assert len(sent) == 1 and first.result(1) is True
        second = step.defer(_sender(sent, value=False))
        assert len(sent) == 1
        assert second.result(1) is False and len(sent) == 2  # asked for: sent first
        step.flush()
        assert len(sent) == 2  # sent once only
        third = step.defer(_sender(sent))
        step.close_loop(outer)  # the loop ended: what is left goes
        assert len(sent) == 3 and third.result(1) and step.queued is None
        step.defer(_sender(sent))  # no loop any more: at once
        assert len(sent) == 4


def test_nested_loops_and_a_late_finalizer_in_another_thread():
    sent: list = []
    scope = ClosureScope()
    with closure_scope(scope):
        step = this_step()
        outer = step.open_loop()
        step.defer(_sender(sent))
        inner = step.open_loop()
        step.defer(_sender(sent))
        step.close_loop(inner)  # the inner loop's message goes; the outer's waits for its loop
        assert len(sent) == 1 and step.queued is not None and len(step.queued) == 1
    # the outer loop's generator finalized late, from a thread outside the closure
    t = threading.Thread(target=step.close_loop, args=(outer,), name="finalizer")
    t.start()
    t.join(10)
    assert sent == ["MainThread", "finalizer"] and step.queued is None


def test_the_closure_end_sends_what_a_loop_left_queued():
    sent: list = []
    scope = ClosureScope()
    with closure_scope(scope):
        this_step().open_loop()  # a loop never closed (its generator kept)
        late = this_step().defer(_sender(sent))
    assert sent == []
    scope.end()  # what the runner does when the closure returns
    assert len(sent) == 1 and late.result(1) is True


def test_a_send_that_fails_later_is_the_answers_error():
    scope = ClosureScope()

    def broken():
        raise ConnectionError("scheduler gone")

    with closure_scope(scope):
        step = this_step()
        step.open_loop()
        late = step.defer(broken)
        step.flush()
    assert isinstance(late, Late)
    with pytest.raises(ConnectionError, match="scheduler gone"):
        late.result(1)


def test_put_aside_moves_only_the_closures_own_tokens_out_of_what_a_commit_acknowledges():
    """The failure path of a synced loop: its untrained batch's tokens leave the list a
    commit acknowledges and go back with the closure's end (``end_aside``)."""
    from daskdist.session.tokens import put_aside, record_consumed

    a, b, c, stranger = object(), object(), object(), object()
    scope = ClosureScope()
    with closure_scope(scope):
        for t in (a, b, c):
            record_consumed(t)
        put_aside([b, c, stranger])  # the stranger is not this closure's: left alone
    assert scope.tokens == [a] and scope.aside == [b, c]
    assert scope.end() == [a] and scope.end_aside() == [b, c]
    put_aside([a])  # outside a closure: nothing to do
