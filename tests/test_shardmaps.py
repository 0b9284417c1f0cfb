"""A commit's copy as a mapping of the predecessor's memory (``collective.shardmaps``):
the shard a process packed stays readable to the process that mapped it after a
SIGKILL; a mapping of the wrong memory is refused; memory and mappings are let go with
the last tensor on them (no descriptor left open)."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

from daskdist.collective.sharded.maps import SHARED, Handle
from tests.processes import process_context

pytestmark = pytest.mark.timeout(120)


def packer(out, n: int) -> None:
    """Pack ``n`` known bytes into shared memory, say where, then wait to be killed."""
    import time

    t = SHARED.empty(n + 7)[3:3 + n]  # a slice: the handle carries its offset
    t.copy_(torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8))
    out.put((os.getpid(), SHARED.handle(t)))
    while True:
        time.sleep(1)


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _shard_fds() -> int:
    """Descriptors this process holds open on shard memory (a mapping holds one too)."""
    return sum("memfd:daskdist-shard" in _fd_target(int(fd)) for fd in os.listdir("/proc/self/fd"))


def test_a_mapped_shard_outlives_its_sigkilled_owner_and_is_let_go_with_its_views():
    ctx = process_context()
    out = ctx.Queue()
    n = 3 * 4096 + 5
    proc = ctx.Process(target=packer, args=(out, n), daemon=True)
    proc.start()
    try:
        pid, h = out.get(timeout=90)
        assert h.offset == 3 and h.nbytes == n
        assert Handle.decode(h.encode()) == h  # what travels on the wire
        view = SHARED.view(pid, h)
        assert SHARED.is_view(view) and not SHARED.owns(view)
        want = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
        assert torch.equal(view, want)
        os.kill(pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        assert torch.equal(view.clone(), want)  # the pages live with the mapping
        with pytest.raises(OSError):  # the owner is gone: its memory can't be mapped anew
            SHARED.view(pid, Handle(h.fd, h.inode + 1, 0, 1))
        del view
        gc.collect()
        assert not SHARED._view_ptrs  # the last view unmapped it
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(30)


def test_a_free_buffer_is_resized_in_place_keeping_its_pages():
    t = SHARED.empty(100)
    t.fill_(5)
    grown = SHARED.resized(t, 10_000)  # the same memory, mapped larger
    assert SHARED.handle(grown).inode == SHARED.handle(t).inode and grown.numel() == 10_000
    assert bool((grown[:100] == 5).all()) and bool((grown[100:] == 0).all())
    del t
    gc.collect()
    shrunk = SHARED.resized(grown, 50)  # its tail freed
    h = SHARED.handle(shrunk)
    assert os.fstat(h.fd).st_size == 50 and bool((shrunk == 5).all())
    again = SHARED.resized(shrunk, 4_000)  # within the mapping: its tail made anew
    assert os.fstat(h.fd).st_size == 4_000 and bool((again[50:] == 0).all())
    assert bool((SHARED.view(os.getpid(), SHARED.handle(again)) == again).all())
    fresh = SHARED.resized(torch.empty(8, dtype=torch.uint8), 8)  # not ours: new memory
    assert SHARED.owns(fresh)


def test_own_memory_closes_its_descriptor_with_its_last_tensor_and_wrong_maps_are_refused():
    gc.collect()
    before = _shard_fds()
    t = SHARED.empty(10_000)
    assert SHARED.owns(t) and SHARED.owns(t[5:]) and not SHARED.owns(torch.empty(3))
    assert bool((t == 0).all())
    h = SHARED.handle(t[100:200])
    assert (h.offset, h.nbytes) == (100, 100)
    assert "memfd:daskdist-shard" in _fd_target(h.fd)
    # this process's memory through /proc, as a successor maps it: same bytes
    t[100:200] = 7
    view = SHARED.view(os.getpid(), h)
    assert bool((view == 7).all())
    with pytest.raises(OSError, match="inode"):  # another memory behind that number
        SHARED.view(os.getpid(), Handle(h.fd, h.inode + 1, 100, 100))
    with pytest.raises(ValueError, match="outside"):
        SHARED.view(os.getpid(), Handle(h.fd, h.inode, 9_990, 100))
    assert _shard_fds() > before
    del t, view
    gc.collect()
    assert _shard_fds() == before
    assert not SHARED._own and not SHARED._view_ptrs
