"""Preemption deadlines (pure): what a worker with a deadline judges by, and the cloud
notices that give one.

- :class:`DurationBook`: how long closures of each function take on one worker (the
  longest of their last few runs). A worker with a deadline starts a closure only if
  its function's expected time, plus a margin, ends before the deadline; a function it
  never ran counts a configured bound (``daskdist.preemption.unknown-duration``). It
  asks for new work only while the longest closure it expects (of the functions it
  ran, or refused) would still fit, so a closure it hands back is not handed to it
  again.
- :func:`acting`: a deadline nearer than the horizon (``daskdist.preemption.horizon``)
  is acted on (a gang member leaves at its next commit, with a just-in-time checkpoint);
  a farther one (Dask's worker ``lifetime``, hours away) is only known.
- :func:`earliest`: of two notices, the one whose deadline comes first.
- The cloud notices' bodies: AWS spot ``instance-action`` (its ``time``), Azure
  scheduled events (a ``Preempt`` or ``Terminate`` event's ``NotBefore``) and GCP's
  ``preempted`` flag (a fixed 30 s).

Imports nothing from Dask or the rest of the package but the wire's types.
"""

from __future__ import annotations

import datetime
import email.utils
import json
from collections import deque
from collections.abc import Hashable

from daskdist.core.protocol import Preemption

GCP_NOTICE = 30.0  # seconds GCP gives a preempted VM (it says when, not how long)
AZURE_EVENTS = frozenset({"Preempt", "Terminate"})  # scheduled events that end the VM


class DurationBook:
    """Closure durations by function on one worker, and whether a closure fits before a
    deadline. ``keep``: runs remembered per function (the expectation is their longest);
    ``unknown``: seconds expected of a function never run here."""

    def __init__(self, keep: int = 8, unknown: float = 60.0) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if unknown < 0:
            raise ValueError(f"unknown must be >= 0 seconds, got {unknown}")
        self.keep = keep
        self.unknown = float(unknown)
        self._runs: dict[Hashable, deque[float]] = {}
        self._expected: dict[Hashable, float] = {}

    def add(self, key: Hashable, seconds: float) -> None:
        """A closure of function ``key`` ran ``seconds``."""
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = deque(maxlen=self.keep)
        runs.append(max(0.0, float(seconds)))
        self._expected[key] = max(runs)

    def expected(self, key: Hashable) -> float:
        """Seconds a closure of ``key`` is expected to take here (``unknown`` if none ran)."""
        return self._expected.get(key, self.unknown)

    def longest(self) -> float:
        """The longest expected closure of the functions run or refused here
        (``unknown`` before any)."""
        return max(self._expected.values(), default=self.unknown)

    def fits(self, key: Hashable, now: float, deadline: float, margin: float) -> bool:
        """Whether a closure of ``key`` started at ``now`` ends ``margin`` seconds before
        ``deadline``. One that does not is remembered (as expected to take ``unknown``
        if it never ran here): :meth:`takes_more` says no from then on."""
        expected = self.expected(key)
        if now + expected + margin <= deadline:
            return True
        self._expected.setdefault(key, expected)
        return False

    def takes_more(self, now: float, deadline: float, margin: float) -> bool:
        """Whether to ask for more closures: the longest expected one still fits."""
        return now + self.longest() + margin <= deadline


def acting(deadline: float, now: float, horizon: float) -> bool:
    """Whether a deadline is near enough to act on (within ``horizon`` seconds)."""
    return deadline - now <= horizon


def earliest(old: Preemption | None, new: Preemption) -> Preemption:
    """The notice that counts: the one with the earlier deadline (``old`` on a tie)."""
    return new if old is None or new.deadline < old.deadline else old


def _epoch(moment: datetime.datetime) -> float:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def aws_deadline(body: str) -> float | None:
    """AWS spot ``instance-action``: ``{"action": "terminate", "time":
    "2017-09-18T08:22:00Z"}`` gives its ``time`` (epoch seconds); anything else (an
    empty body, a 404 page) ``None``."""
    try:
        notice = json.loads(body)
        when = notice["time"]
        return _epoch(datetime.datetime.fromisoformat(str(when).replace("Z", "+00:00")))
    except (ValueError, TypeError, KeyError):
        return None


def azure_deadline(body: str, now: float) -> float | None:
    """Azure scheduled events: the earliest ``NotBefore`` of a ``Preempt`` or
    ``Terminate`` event (RFC 1123, ``"Mon, 19 Sep 2016 18:29:47 GMT"``; an event with
    none has started: ``now``); ``None`` without such an event."""
    try:
        events = json.loads(body).get("Events") or []
    except (ValueError, AttributeError):
        return None
    out = None
    for event in events:
        if not isinstance(event, dict) or event.get("EventType") not in AZURE_EVENTS:
            continue
        when = event.get("NotBefore") or ""
        try:
            at = _epoch(email.utils.parsedate_to_datetime(when)) if when else now
        except (TypeError, ValueError):
            at = now
        out = at if out is None else min(out, at)
    return out


def gcp_deadline(body: str, now: float) -> float | None:
    """GCP's ``instance/preempted``: ``TRUE`` gives ``now`` + 30 s (GCP's fixed notice)."""
    return now + GCP_NOTICE if body.strip().upper() == "TRUE" else None
