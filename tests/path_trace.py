"""Which daskdist files one event's path runs code in, in every process it crosses.

docs/architecture.md names the files each path crosses; ``tests/test_paths.py`` counts
them instead: a profile hook on every thread of the client, the scheduler and the
workers records the daskdist files whose functions are called between :func:`start` and
:func:`stop`, while the test runs one event and nothing else.

One event at a time: what a process does on its own, whatever the event, is not
recorded, so every file seen is the event's and the sets are exact.

- Periodic work runs with the trace paused: the hook records nothing beneath a
  periodic root on the call stack (:func:`periodic_roots`, read from the package: every
  timer loop, an ``async def`` that ends in a ``while`` loop which sleeps, then works,
  each round, such as the scheduler's liveness sweep, a session's lease renewal, the preemption
  handler's upkeep and a rank's window reports; and tornado's ``PeriodicCallback``, which
  runs the dashboard's sampler and Dask's own periodic work).
- What a timer sets off in another process, and the empty reply a long-poll gets when
  its wait runs out, run under :data:`QUIET`: the traced cluster's configuration sets
  those intervals past a test's length, so they do not fall into a trace.
- The test starts the trace once the processes have settled after the warm-up (no
  reply still due to an earlier call) and stops it once the event has ended in every
  process it crosses.
"""

from __future__ import annotations

import ast
import os
import sys
import threading
from pathlib import Path

import daskdist

ROOT = os.path.dirname(daskdist.__file__) + os.sep

# The traced cluster's configuration: a session's lease renewal (the scheduler's side of
# it; renewals come at most every lease-timeout / 4), a rank's window report (likewise)
# and an idle long-poll's empty reply come after an hour, never within a test; the
# dashboard samples once an hour.
QUIET = {
    "daskdist.scheduler.poll-interval": "1h",
    "daskdist.liveness.lease-timeout": "4h",
    "daskdist.liveness.renew-interval": "1h",
    "daskdist.observe.window": "1h",
    "daskdist.dashboard.sample-interval": "1h",
}

_seen: set[str] = set()
_on = False
_FUNCS = bool(os.environ.get("DASKDIST_TRACE_FUNCS"))  # file:function, to see what runs
_roots: frozenset = frozenset()  # (file, qualified name) of the periodic roots
_codes: frozenset = frozenset()  # code objects that are periodic roots (tornado's)


def _is_sleep(node: ast.stmt) -> bool:
    """``await asyncio.sleep(...)`` as a statement of its own."""
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Await)
            and isinstance(node.value.value, ast.Call)
            and isinstance(node.value.value.func, ast.Attribute)
            and node.value.value.func.attr == "sleep"
            and isinstance(node.value.value.func.value, ast.Name)
            and node.value.value.func.value.id == "asyncio")


def _timer_loop(fn: ast.AsyncFunctionDef) -> bool:
    """An ``async def`` that ends in a ``while`` loop which sleeps and then works, each
    round (a polling wait inside other work, or a loop that only sleeps, waits for
    something else: not periodic work)."""
    last = fn.body[-1]
    if not isinstance(last, ast.While):
        return False
    body = last.body
    return any(_is_sleep(stmt) for stmt in body[:-1])


def periodic_roots(package: str | Path = ROOT) -> set[tuple[str, str]]:
    """``(file, qualified name)`` of every timer loop of the package (see
    :func:`_timer_loop`), the file relative to the package."""
    package = Path(package)
    out: set[tuple[str, str]] = set()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()

        def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if isinstance(child, ast.AsyncFunctionDef) and _timer_loop(child):
                        out.add((rel, prefix + child.name))
                    visit(child, f"{prefix}{child.name}.<locals>.")

        visit(ast.parse(path.read_text(), str(path)), "")
    return out


def _periodic(frame) -> bool:
    """Whether ``frame`` runs beneath a periodic root (its callers, its awaiting
    coroutines)."""
    while frame is not None:
        code = frame.f_code
        if code in _codes:
            return True
        name = code.co_filename
        if name.startswith(ROOT) and (name[len(ROOT):], code.co_qualname) in _roots:
            return True
        frame = frame.f_back
    return False


def _profile(frame, event, arg) -> None:
    if _on and event == "call":
        name = frame.f_code.co_filename
        if name.startswith(ROOT) and not _periodic(frame):
            _seen.add(name[len(ROOT):] + ("" if not _FUNCS else
                                          ":" + frame.f_code.co_name))


def install() -> None:
    """Hook this thread and every thread started from now on (a process's threads that
    run daskdist code start after this: call it before the Coordinator)."""
    global _roots, _codes
    from tornado.ioloop import PeriodicCallback

    _roots = frozenset(periodic_roots())
    _codes = frozenset({PeriodicCallback._run.__code__})
    sys.setprofile(_profile)
    threading.setprofile(_profile)


async def install_async() -> None:
    """:func:`install` on an event loop's thread (the scheduler's, the client's)."""
    install()


def start() -> None:
    global _on
    _seen.clear()
    _on = True


def stop() -> list[str]:
    """Stop recording: the files seen since :func:`start`, relative to the package."""
    global _on
    _on = False
    return sorted(_seen)


def uninstall() -> None:
    global _on
    _on = False
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
