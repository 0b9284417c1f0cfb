"""The elastic State's copy cost per commit (issue 23 item 7), on the CPU.

Run: ``python benchmarks/bench_state.py [--params 10_000_000] [--commits 20]``.

A model of ``--params`` parameters (an MLP) trained one Adam step, so the optimizer holds
two more tensors per parameter. Per commit, median of ``--commits``:

- **anchor (Horovod's TorchState, and ours before)**: ``copy.deepcopy`` of the model's
  and the optimizer's state dicts: a new copy allocated at every commit, on the
  device the model lives on;
- **ours**: ``HostCopy.fill``: the same tensors copied into host buffers made once and
  refilled in place (pinned and asynchronous on CUDA; on the CPU a plain copy).

Printed: milliseconds a commit, bytes newly allocated a commit, ours / anchor. The
before/after of the State itself: before, a commit in flight kept a second deep copy
(and ``State`` 3-4 copies at worst: committed, in flight, the snapshot taken before the
allgather); now one host copy, plus the spare buffers a dynamic dataset's commit in
flight fills.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from daskdist.collective.snapshot import HostCopy


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
    print(f"  ours / anchor = {o / a:.2f}x")


if __name__ == "__main__":
    main()
