"""Step times in fixed size: log-bucket histograms and one rank's window of steps (pure).

A rank's steps are summed into windows of ``daskdist.observe.window`` seconds
(:class:`WindowSum`): the count, the wall time, the time of each phase, the rows and a
histogram of the step times. Whatever the number of steps, a window holds a few numbers
and at most :data:`BUCKETS` histogram buckets, so a median or a 90th percentile over any
windows is read from their merged histograms, never from a list of steps.

A bucket is an eighth of a power of two (about 9 % wide): a quantile is the middle of
its bucket, within 4.5 % of the true value. The bucket scheme is wire format (worker
and scheduler compute alike), not a setting.

Imports nothing from Dask, torch or the rest of the package.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

PHASES = ("data", "collective", "commit", "compute")  # how a step's wall time splits
DATA, COLLECTIVE, COMMIT, COMPUTE = range(4)  # their indices in a window's ``phases``

PER_OCTAVE = 8  # buckets per power of two
LOW = -20 * PER_OCTAVE  # the bucket of ~1 µs: shorter steps count here
HIGH = 20 * PER_OCTAVE  # the bucket of ~12 days: longer steps count here
BUCKETS = HIGH - LOW + 1  # at most this many buckets in any histogram


def bucket(seconds: float) -> int:
    """The histogram bucket of a step of ``seconds`` (clamped to [LOW, HIGH])."""
    if not seconds > 0.0:  # 0, negative, NaN
        return LOW
    b = math.floor(math.log2(seconds) * PER_OCTAVE)
    return LOW if b < LOW else HIGH if b > HIGH else b


def value(b: int) -> float:
    """The seconds a bucket stands for: the geometric middle of its bounds."""
    return 2.0 ** ((b + 0.5) / PER_OCTAVE)


def merge(hists: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """The sum of several histograms (``{bucket: count}``)."""
    out: dict[int, int] = {}
    for h in hists:
        for b, n in h.items():
            out[b] = out.get(b, 0) + n
    return out


def quantile(hist: Mapping[int, int], q: float) -> float | None:
    """The ``q``-quantile (0 < q <= 1) of a histogram's steps; ``None`` when it is
    empty. O(buckets), never O(steps)."""
    total = sum(hist.values())
    if total <= 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return value(b)
    return value(max(hist))  # pragma: no cover - rank <= total


@dataclass(slots=True)
class WindowSum:
    """One rank's steps that ended in window ``index`` (wall-clock seconds // the window
    length): their count, wall time, phases (:data:`PHASES`, summed; they add up to
    ``seconds``), rows, step-time histogram, and the seconds its producer threads waited
    for Dask to compute a collection's partitions (``computing``) and read them
    (``reading``)."""

    index: int
    steps: int = 0
    seconds: float = 0.0
    phases: list[float] = field(default_factory=lambda: [0.0] * len(PHASES))
    rows: int = 0
    hist: dict[int, int] = field(default_factory=dict)
    computing: float = 0.0
    reading: float = 0.0

    def add(self, seconds: float, data: float, collective: float, commit: float,
            rows: int) -> None:
        """One step of ``seconds``, with the seconds it spent in the data, collective and
        commit phases; the rest is compute. Phases that overlap (a call in another
        thread during one of this thread's) are scaled down so the four sum to the step."""
        seconds = max(0.0, seconds)
        waited = data + collective + commit
        if waited > seconds:
            scale = seconds / waited if waited > 0 else 0.0
            data, collective, commit = data * scale, collective * scale, commit * scale
            waited = seconds
        p = self.phases
        p[DATA] += data
        p[COLLECTIVE] += collective
        p[COMMIT] += commit
        p[COMPUTE] += seconds - waited
        self.steps += 1
        self.seconds += seconds
        self.rows += rows
        b = bucket(seconds)
        self.hist[b] = self.hist.get(b, 0) + 1

    def mean(self, phase: int) -> float:
        """Mean seconds a step in ``phase`` (0 without steps)."""
        return self.phases[phase] / self.steps if self.steps else 0.0

    @property
    def step_mean(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def own(self) -> float:
        """Mean seconds a step not spent waiting in collectives: what the rank itself
        takes (in a synchronous gang the others wait for the slowest inside collectives)."""
        return self.step_mean - self.mean(COLLECTIVE)

    @property
    def data_share(self) -> float:
        """The share of the step time spent waiting for data."""
        return self.phases[DATA] / self.seconds if self.seconds > 0 else 0.0
