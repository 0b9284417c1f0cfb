"""A hung gang, as pure bookkeeping (SPEC §5.1): when it made no step for too long, and
which ranks' stacks stand out.

:class:`HangWatch` follows one coordinator's running gang from its members' window
reports (scheduler clock): a hang is ``after`` seconds without a step, counted from the
gang run's newest step or, before its first, from its start. It fires once per hang and
re-arms when a step comes. :func:`odd_ranks` names the ranks whose place in the code
(the innermost frame of theirs outside the standard library and torch, as the worker
summarised it) differs from the most common one: in a hang, the ranks that are not
waiting for the others.

Imports nothing from Dask, torch or the rest of the package.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class HangWatch:
    """No step for ``after`` seconds in the run being watched (see the module)."""

    after: float
    run: tuple = ()  # (gang id, generation) of the run its reports come from
    newest: float = -math.inf  # when that run's newest step (or its start) was
    fired: bool = False  # a hang was declared and no step came since

    def report(self, run: tuple, steps: int, since_step: float, now: float) -> str | None:
        """A member of ``run`` reports a window with ``steps`` steps, its last step (or its
        run's start) ``since_step`` seconds before ``now``. ``"hang"`` when the run has
        made no step for ``after`` seconds (once per hang), ``"stepped"`` when a step
        ends a declared hang, else ``None``."""
        out = None
        if run != self.run:  # a new run (or re-run): watched from its own start
            out = "stepped" if self.fired else None
            self.run, self.newest, self.fired = run, now - since_step, False
        elif steps > 0:
            self.newest = max(self.newest, now - since_step)
            if self.fired:
                self.fired, out = False, "stepped"
        if not self.fired and now - self.newest >= self.after:
            self.fired = True
            return "hang"
        return out

    def ended(self, run: tuple) -> None:
        """``run`` finished: nothing of it can hang any more."""
        if run == self.run:
            self.run, self.newest, self.fired = (), -math.inf, False


def odd_ranks(wheres: Mapping[int, str],
              waiting: Mapping[int, bool] | None = None) -> tuple[list[int], str]:
    """The ranks whose ``where`` differs from the most common one, and that one. Ties go
    to the place where ranks wait on others (``waiting``: inside a collective call, a
    commit or a data agreement), then to the lowest rank's."""
    if not wheres:
        return [], ""
    counts = Counter(wheres.values())
    waits = waiting or {}
    first: dict[str, int] = {}
    for r in sorted(wheres):
        first.setdefault(wheres[r], r)
    common = max(counts, key=lambda w: (counts[w], any(waits.get(r, False) for r in wheres
                                                       if wheres[r] == w), -first[w]))
    return sorted(r for r, w in wheres.items() if w != common), common
