"""The closure's synchronous step: what one iteration of a synced loop hands the next.

A synchronous step pays one collective call, the gradient allreduce
(:func:`~daskdist.collective.replicas.allreduce_gradients`), and three things cross from
one iteration to the next around it. A :class:`Step`, one per closure (held by its
scope, made when first used: :func:`this_step`), owns all three:

- **what rides the next gradient allreduce** (:mod:`~daskdist.collective.step.riders`):
  the synced loop's next batch and its agreement (:class:`Ahead`), and each elastic
  State's next commit head (:meth:`Step.ride_head`). ``allreduce_gradients`` takes them
  for one call (:meth:`Step.riding`) and hands every rank's ints back to each; a
  State's commit takes every rank's head from there (:meth:`Step.gathered`) instead of
  an allgather of its own;
- **the batch fetched ahead** (:class:`Ahead`): fetched inside this step's allreduce,
  its tokens set aside until the step that trains it begins, given back by identity
  when it is never trained;
- **the deferred commit message** (:meth:`Step.defer`): rank 0's commit message goes to
  the scheduler through the worker's event loop, and waking that loop from the training
  thread hands it the GIL in the middle of the commit. Its answer is needed only at the
  next commit, so inside a synced loop it is queued and sent when the loop is next
  asked for a batch (:meth:`Step.flush`), when its answer is asked for, or when the loop
  or the closure ends.

The closure's thread owns the riders and the heads; the message queue is under
:attr:`Step.lock` (a loop's generator may be finalized late, from another thread).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from daskdist.collective.group import Group, get_group
from daskdist.collective.step.riders import Rider, Riding
from daskdist.session.scope import closure_scope_now, session_services
from daskdist.session.tokens import consumed_mark, consumed_since, drop_aside, set_aside, take_back

__all__ = ["END", "Ahead", "Gathered", "Late", "Step", "this_step"]

END = object()  # what a loop's iterator gave when it ran dry


def this_step(create: bool = True) -> Step | None:
    """The Step of the closure running in this thread, made when first asked for
    (``create=False``: ``None`` until then); ``None`` outside a closure."""
    scope = closure_scope_now()
    if scope is None:
        return None
    step = scope.step
    if step is None and create:
        with scope.lock:
            if scope.step is None:
                scope.step = Step()
            step = scope.step
    return step


class Gathered(NamedTuple):
    """Every rank's commit head from a gradient allreduce: the rows an allgather would
    give, the group generation, and the tokens this rank sent it with."""

    generation: int
    table: list[list[int]]
    tokens: list


class Step:
    """One closure's synchronous step (see the module)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the queued messages
        self.riders: dict[str, Rider] = {}  # by key: the order in the segment
        self.heads: dict[str, Gathered] = {}  # a State's key -> the heads that came
        self.queued: list[Late] | None = None  # None while no synced loop runs

    # -- what rides the next gradient allreduce ----------------------------------------
    def ride(self, rider: Rider) -> None:
        """``rider`` rides this closure's next gradient allreduce (once: ride again for
        the one after); a rider of the same key replaces it."""
        self.riders[rider.key] = rider

    def unride(self, rider: Rider) -> None:
        """``rider`` rides no more (if it still is the one of its key)."""
        if self.riders.get(rider.key) is rider:
            del self.riders[rider.key]

    def riding(self, generation: int) -> Riding | None:
        """The riders, taken in key order for one call on the group of ``generation``
        (``None``: none)."""
        if not self.riders:
            return None
        taken = [self.riders.pop(k) for k in sorted(self.riders)]
        return Riding(taken, generation)

    def ride_head(self, key: str, head: Callable[[Group, list], list[int]]) -> None:
        """A State's next commit head rides every gradient allreduce until a commit takes
        it: ``head(group, tokens)`` gives this rank's ints, with ``tokens`` the rows the
        closure consumed so far (left in place: the commit takes exactly those)."""
        self.ride(_Head(self, key, head))

    def gathered(self, key: str, generation: int) -> Gathered | None:
        """Every rank's head for State ``key``, taken, when one came on the group of
        ``generation`` since the State last committed, restored or synced."""
        got = self.heads.pop(key, None)
        return got if got is not None and got.generation == generation else None

    def forget(self, key: str) -> None:
        """State ``key`` restored or synced: a head gathered before serves no commit."""
        self.heads.pop(key, None)

    # -- the deferred commit message -----------------------------------------------------
    def defer(self, send: Callable[[], concurrent.futures.Future]) -> Late:
        """``send`` queued until the synced loop is asked for its next batch, or called now
        when no synced loop runs (its error then raised at once)."""
        with self.lock:
            if self.queued is not None:
                late = Late(send)
                self.queued.append(late)
                return late
        return Late.now(send)

    def open_loop(self) -> list | None:
        """A synced loop begins: messages queue until it hands out a batch; returns what an
        enclosing loop had queued (:meth:`close_loop` puts it back)."""
        with self.lock:
            outer, self.queued = self.queued, []
        return outer

    def flush(self) -> None:
        """Send the queued messages: the loop hands out a batch, or ends, or the closure
        does."""
        if not self.queued:  # the common case, every step: nothing queued, no lock
            return
        with self.lock:
            if not self.queued:
                return
            queued, self.queued[:] = list(self.queued), []
        for message in queued:
            message.send()

    def close_loop(self, outer: list | None) -> None:
        """A synced loop ended (maybe from another thread: a late finalizer): what it
        queued goes now, and the enclosing loop's queue is back."""
        self.flush()
        with self.lock:
            self.queued = outer

    def end(self) -> None:
        """The closure ended: what a loop left queued goes now."""
        self.flush()


class Late:
    """A message sent once, later or when its answer is asked for: ``result(timeout)``
    as a ``concurrent.futures.Future``'s (an error sending it is the future's)."""

    def __init__(self, send: Callable[[], concurrent.futures.Future]) -> None:
        self._send = send
        self._future: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    def send(self) -> concurrent.futures.Future:
        """Send it now, if not sent yet; its answer's future."""
        with self._lock:
            if self._future is None:
                try:
                    self._future = self._send()
                except BaseException as e:  # noqa: BLE001 - the answer's error
                    failed: concurrent.futures.Future = concurrent.futures.Future()
                    failed.set_exception(e)
                    self._future = failed
            return self._future

    def result(self, timeout: float | None = None) -> Any:
        return self.send().result(timeout)

    @classmethod
    def now(cls, send: Callable[[], concurrent.futures.Future]) -> Late:
        """``send`` called now (its error raised here, as a direct call's)."""
        late = cls(send)
        late._future = send()
        return late


class _Head:
    """A State's next commit head riding a gradient allreduce: sent with the rows this
    rank consumed so far, kept as :class:`Gathered` in its Step for the commit, and
    riding again in the next call until a commit comes."""

    def __init__(self, step: Step, key: str, head: Callable[[Group, list], list[int]]) -> None:
        self.step, self.key, self.head = step, key, head
        self.sent: tuple[int, list] | None = None  # (generation, tokens)

    def ints(self) -> list[int]:
        g = get_group()
        tokens = consumed_since(0)
        self.sent = (g.generation, tokens)
        return self.head(g, tokens)

    def arrived(self, table: list[list[int]], generation: int) -> None:
        gen, tokens = self.sent
        self.sent = None
        if gen == generation:
            self.step.heads[self.key] = Gathered(gen, table, tokens)
        self.step.ride(self)  # the next step's head, unless a commit comes first

    def failed(self) -> None:
        self.sent = None


class Ahead:
    """A synced loop's place in its closure's Step: the next batch, fetched inside this
    step's gradient allreduce, and the ranks' agreement on it carried by that call (a
    rider): the step makes no call of its own for it. Its tokens are set aside until the
    step that trains it begins, so this step's commit does not acknowledge them; a batch
    fetched and never yielded goes back to the pool. Where no allreduce took it (the
    loop uses DDP, or runs outside a closure), the loop fetches and agrees itself. The
    loop also opens the Step's message queue (:meth:`Step.open_loop`). The closure's
    thread owns it; :meth:`close` may run late, from the collector."""

    key = "synced"  # one loop at a time rides: a second one's rider replaces it

    def __init__(self, it: Any) -> None:
        self.it = it
        self.step = this_step()  # the closure the loop runs in (None outside one)
        self.outer = self.step.open_loop() if self.step is not None else None
        self.fetched: tuple[Any, list] | None = None  # (batch or END, tokens set aside)
        self.flags: tuple[bool, bool] | None = None  # (every rank got one, any rank did)
        self.error: BaseException | None = None  # the fetch's, raised at take()

    def flush(self) -> None:
        """The loop is asked for a batch: the last commit's message goes now."""
        if self.step is not None:
            self.step.flush()

    def arm(self) -> None:
        """The next batch is fetched and agreed on in this step's gradient allreduce."""
        if self.step is not None:
            self.step.ride(self)
            self.fetched = self.flags = None

    def ints(self) -> list[int]:
        mark = consumed_mark()
        try:
            item: Any = next(self.it, END)
        except Exception as e:  # noqa: BLE001 - raised at take(), after the call
            item, self.error = END, e
        self.fetched = (item, set_aside(mark))
        return [int(item is not END)]

    def arrived(self, table: list[list[int]], generation: int) -> None:
        haves = [row[0] for row in table]
        self.flags = (min(haves) == 1, max(haves) == 1)

    def failed(self) -> None:
        self.flags = None  # the step's error goes up; its batch goes back at close()

    def take(self) -> tuple[Any, list, bool, bool] | None:
        """(batch, its tokens, every, anyone) when the last allreduce carried them."""
        if self.error is not None:
            err, self.error = self.error, None
            self._give_back()
            raise err
        if self.fetched is None or self.flags is None:
            self._give_back()  # fetched, but the call failed and the loop went on
            return None
        (item, tokens), (every, anyone) = self.fetched, self.flags
        self.fetched = self.flags = None
        take_back(tokens)  # its step begins: the next commit acknowledges them
        return item, tokens, every, anyone

    def close(self, g: Any = None) -> None:
        """The loop ended: its queued messages go, it rides no more, and its fetched batch
        goes back (left set aside when ``g``, the loop's group, broke: the closure's end
        gives it back)."""
        step = self.step
        if step is not None:
            step.close_loop(self.outer)
            step.unride(self)
        if g is not None and not g.usable:
            self.fetched = self.flags = None
            return
        self._give_back()

    def _give_back(self) -> None:
        """A batch fetched and not yielded goes back to the pool, from the closure's own
        thread (elsewhere, a late finalizer: the closure's end gives its rows back)."""
        fetched, self.fetched, self.flags = self.fetched, None, None
        if fetched is None or not fetched[1] or this_step(create=False) is not self.step:
            return
        drop_aside(fetched[1])
        session_services().release_tokens(fetched[1])
