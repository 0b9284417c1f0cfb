"""The GPU paths' copies and pinned memory, measured on the CPU: the
elastic State's copy cost per commit, and the CUDA loader's staging ring in bytes.

Run: ``python benchmarks/bench_state.py [--params 10_000_000] [--commits 20]``.

A model of ``--params`` parameters (an MLP) trained one Adam step, so the optimizer holds
two more tensors per parameter. Per commit, median of ``--commits``:

- **anchor (Horovod's TorchState, and ours before)**: ``copy.deepcopy`` of the model's
  and the optimizer's state dicts: a new copy allocated at every commit, on the
  device the model lives on;
- **ours**: ``HostCopy.fill``: the same tensors copied into host buffers made once and
  refilled in place (pinned and asynchronous on CUDA; on the CPU a plain copy).

Printed: milliseconds a commit, bytes newly allocated a commit, ours / anchor.

**Host bytes per rank** (``State.commit_bytes``): a replicated State's keeper holds one
host copy, the committed one; a dynamic dataset's commit in flight fills a second one,
which goes once the commit settles and none is in flight.

**Staging ring.** Blocks of image rows (3x64x64 float32, 48 KiB a row; 2,048-row blocks
of 96 MiB) through the CUDA loader's device stage with a host stand-in for the copies:
the ring's pinned bytes with ``daskdist.data.staging-bytes`` (64 MiB here) against the
ring sized by blocks (``slots x`` the largest block; a 65,536-row lease of such
rows is 3 GiB a slot).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from figures import record

from daskdist.collective.state.keeper import Subject
from daskdist.collective.state.replica import ReplicaKeeper
from daskdist.collective.state.snapshot import HostCopy
from daskdist.data.convert import Chunk
from daskdist.data.staging import DeviceStage


def model_of(params: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = int((params / 3) ** 0.5)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    model(torch.ones(2, width)).sum().backward()
    opt.step()
    return model, opt


def timed(fn, n: int) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--commits", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt = model_of(args.params)
    n = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(t.numel() * t.element_size() for s in opt.state_dict()["state"].values()
                       for t in s.values() if isinstance(t, torch.Tensor))

    def anchor():
        return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    host = HostCopy()

    def ours():
        host.fill((model.state_dict(), opt.state_dict(), {}))

    ours()  # the buffers are made once
    a, o = timed(anchor, args.commits), timed(ours, args.commits)
    print(f"State copy per commit, {n / 1e6:.1f} M parameters + Adam "
          f"({state_bytes / 2**20:.0f} MiB), CPU, median of {args.commits}:")
    print(f"  anchor (Horovod's deepcopy, ours before): {a * 1e3:8.1f} ms, "
          f"{state_bytes / 2**20:.0f} MiB allocated a commit (on the model's device)")
    print(f"  ours (HostCopy refilled in place):        {o * 1e3:8.1f} ms, "
          f"0 MiB allocated a commit ({host.nbytes / 2**20:.0f} MiB held, in host memory)")
    record(f"  ours / anchor = {o / a:.2f}x",
           what=f"elastic `State` copy per commit, {n / 1e6:.3g} M parameters + Adam, CPU "
           "(nothing allocated a commit)", ours=o * 1e3, unit="ms",
           anchor=f"Horovod's `deepcopy` ({state_bytes / 2**20:.0f} MiB allocated a commit)",
           anchor_value=a * 1e3)
    host_bytes(model, opt)


def host_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """A replicated State's host bytes per rank: the committed copy, a commit in flight
    with it, and after that commit settled."""
    keeper = ReplicaKeeper(Subject(model, opt, {}))
    keeper.save()
    idle = keeper.nbytes(None)
    candidate = keeper.candidate()  # a dynamic dataset's commit, its outcome not known
    flight = keeper.nbytes(candidate)
    keeper.promote(candidate)  # confirmed at the next commit, none after it
    keeper.idle()
    settled = keeper.nbytes(None)
    print(f"\nState host bytes per rank: {idle / 2**20:.0f} MiB with no commit in flight, "
          f"{flight / 2**20:.0f} MiB with one in flight, {settled / 2**20:.0f} MiB once "
          f"it settled")


class _HostCopies:
    """A stand-in for CudaTransfer: "device" tensors are host copies, fences are done."""

    class _Done:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    def host_buffer(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)

    def copy(self, host):
        return host.clone()

    def record(self):
        return self._Done()

    def wait(self, staged) -> None:
        pass


def staging(bound: int, blocks: int = 4, rows: int = 2048) -> None:
    from collections import namedtuple

    Item = namedtuple("Item", "cols ids rows staged ascending")
    pixels = 3 * 64 * 64
    chunk = Chunk(["img", "id"], {"img": torch.ones(rows, pixels),
                                  "id": torch.arange(rows)})
    out = {}
    for name, limit in (("bounded", bound), ("by blocks (before)", None)):
        stage = DeviceStage(_HostCopies(), slots=2, max_bytes=limit)
        items = (Item(chunk, None, rows, None, False) for _ in range(blocks))
        n = sum(1 for _ in stage.stage_all(items))
        out[name] = (stage.ring.host_bytes, n)
    block = rows * (pixels * 4 + 8)
    (b, nb), (u, nu) = out["bounded"], out["by blocks (before)"]
    print(f"\nStaging ring, {blocks} blocks of {rows:,} image rows ({block / 2**20:.0f} MiB "
          f"each), 2 slots:")
    print(f"  ours, staging-bytes {bound / 2**20:.0f} MiB: {b / 2**20:6.1f} MiB pinned "
          f"({nb} pieces staged)")
    print(f"  anchor, sized by blocks:    {u / 2**20:6.1f} MiB pinned ({nu} blocks staged)")
    record(f"  ours / anchor = {b / u:.2f}x",
           what=f"CUDA staging ring's pinned bytes, {block / 2**20:.0f} MiB blocks, "
           f"`staging-bytes` {bound / 2**20:.0f} MiB", ours=b / 2**20, unit="MiB",
           anchor="the ring sized by blocks", anchor_value=u / 2**20,
           target=f"≤ {bound / 2**20:.0f} MiB", met=b <= bound)


if __name__ == "__main__":
    main()
    staging(64 * 2**20)
