"""Which daskdist files a message's path runs code in, in every process it crosses.

The README's "How it is built" names the files each path crosses; this counts them
instead of reading them off the code: a profile hook on every thread of the client, the
scheduler and the workers records the daskdist files whose functions are called while
one closure goes from ``schedule`` to ``fetch`` (``tests/test_paths.py``). Background
work (lease renewals, the dashboard's sampler) can fall into a window, so a path is
traced several times and a file counts when most of the traces saw it.
"""

from __future__ import annotations

import os
import sys
import threading

import daskdist

ROOT = os.path.dirname(daskdist.__file__) + os.sep
_seen: set[str] = set()
_on = False
_FUNCS = bool(os.environ.get("DASKDIST_TRACE_FUNCS"))  # file:function, to see what runs


def _profile(frame, event, arg) -> None:
    if _on and event == "call":
        name = frame.f_code.co_filename
        if name.startswith(ROOT):
            _seen.add(name[len(ROOT):] + ("" if not _FUNCS else
                                          ":" + frame.f_code.co_name))


def install() -> None:
    """Hook this thread and every thread started from now on (a process's threads that
    run daskdist code start after this: call it before the Coordinator)."""
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
