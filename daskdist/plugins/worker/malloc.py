"""Undo the allocator setting that Dask's Nanny gives every worker process, for torch.

The Nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536`` so that freed memory goes
back to the OS quickly. Setting any such glibc threshold also turns off glibc's dynamic
mmap threshold, so every allocation above 128 KiB stays a fresh ``mmap``: each tensor of a
training step, and each of gloo's scratch buffers, then costs page faults every time it
is allocated (a 4-layer MLP step ran 17% slower in a Dask worker; a 16 MB gloo allreduce
took 500 faults a call). We set the thresholds glibc's dynamic rule reaches in a plain
process that has freed a large buffer: mmap above 32 MiB, trim above 64 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "restore_dynamic_thresholds"]

MMAP_THRESHOLD = 32 * 2**20  # glibc's upper bound for its dynamic mmap threshold
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what the dynamic rule sets beside it

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def restore_dynamic_thresholds(environ: dict[str, str] | None = None) -> bool:
    """Set large mmap/trim thresholds when only a trim threshold was set by environment.

    Does nothing (returns ``False``) off glibc, without ``MALLOC_TRIM_THRESHOLD_``, or
    when the user chose an mmap threshold too (``MALLOC_MMAP_THRESHOLD_``): then the
    allocator is as someone configured it on purpose.
    """
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or "MALLOC_TRIM_THRESHOLD_" not in env:
        return False
    if "MALLOC_MMAP_THRESHOLD_" in env:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and friends: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
