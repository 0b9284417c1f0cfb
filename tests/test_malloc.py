"""Worker processes get glibc's large-buffer behaviour back (plugins/malloc.py)."""

from __future__ import annotations

import os
import sys

import pytest

from daskdist.plugins.worker.malloc import restore_dynamic_thresholds

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


def test_leaves_the_allocator_alone_unless_only_a_trim_threshold_was_set():
    assert restore_dynamic_thresholds({}) is False
    assert restore_dynamic_thresholds({"MALLOC_TRIM_THRESHOLD_": "65536",
                                       "MALLOC_MMAP_THRESHOLD_": "131072"}) is False


@linux
def test_sets_thresholds_when_the_nanny_set_a_trim_threshold():
    assert restore_dynamic_thresholds({"MALLOC_TRIM_THRESHOLD_": "65536"}) is True


def _faults_per_allocation(mb: int = 4, n: int = 20) -> tuple[str | None, float]:
    import resource

    import torch

    for _ in range(n):  # the thread's arena grows to its working size first
        torch.empty(mb * 2**18).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        torch.empty(mb * 2**18).fill_(1.0)  # allocated, written, freed
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return os.environ.get("MALLOC_TRIM_THRESHOLD_"), faults / n


@linux
def test_worker_tensors_reuse_freed_memory(coord):
    """Dask's Nanny sets MALLOC_TRIM_THRESHOLD_; without the fix every 4 MB tensor is a
    fresh mmap and faults in its 1024 pages again (100+ faults, with fault-around)."""
    env, faults = coord.schedule(_faults_per_allocation).fetch(timeout=60)
    assert env is not None, "the Nanny no longer sets MALLOC_TRIM_THRESHOLD_: test is moot"
    assert faults < 10, f"{faults:.0f} page faults per 4 MB tensor"
