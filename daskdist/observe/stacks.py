"""A thread's Python stack, read from another thread (``sys._current_frames()``), and
where in the user's code it is (SPEC §5.1: a hung gang's stacks).

:func:`thread_stack` formats the stack as ``traceback.format_stack`` does and names its
*place*: the innermost frame outside the standard library and the libraries a training
step runs through (torch, Dask's ``distributed`` and tornado, and daskdist itself), with
the daskdist phase the thread is in, if any (``"in collective"``). So ranks waiting in
the same collective call from the same line have the same place, whichever line of
daskdist's wait loop each is on, and a rank stuck in a function of the user's is named
by that function.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig
import traceback
from types import FrameType

_LIBRARIES = ("torch", "distributed", "tornado", "daskdist")


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Directories (as prefixes) of the standard library, and of the libraries."""
    paths = sysconfig.get_paths()
    std = tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")
                 if paths.get(k)})
    libs = set()
    for name in _LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec is not None else []:
            libs.add(os.path.realpath(loc) + os.sep)
    return std, tuple(libs)


_SITE = ("site-packages" + os.sep, "dist-packages" + os.sep)


@functools.lru_cache(maxsize=4096)
def _is_library(filename: str) -> bool:
    """Whether code of ``filename`` is the standard library's or a library's."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>, <stdin>
        return filename.startswith("<frozen")
    path = os.path.realpath(filename)
    std, libs = _library_roots()
    if path.startswith(libs):
        return True
    # site-packages lives under the standard library's directory: it is not the stdlib
    return path.startswith(std) and not any(s in path for s in _SITE)


def place(frame: FrameType) -> str:
    """``"func (file.py:line)"`` of the innermost frame of ``frame``'s stack outside the
    standard library and the libraries (see the module); the innermost frame itself when
    every frame is a library's."""
    innermost = None
    for f, lineno in traceback.walk_stack(frame):
        code = f.f_code
        here = f"{code.co_name} ({os.path.basename(code.co_filename)}:{lineno})"
        innermost = innermost or here
        if not _is_library(code.co_filename):
            return here
    return innermost or "?"


def thread_stack(ident: int) -> tuple[str, str] | None:
    """The stack of thread ``ident`` (``traceback.format_stack`` form) and its place, or
    ``None`` when the thread is gone. Any thread may call it."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return None
    try:
        return "".join(traceback.format_stack(frame)), place(frame)
    finally:
        del frame
