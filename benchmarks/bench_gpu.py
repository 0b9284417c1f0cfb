"""GPU benchmark: the CUDA input path, NCCL bootstrap, and DDP through a daskdist group.

In one run (skipped, with one line, where CUDA is not available):

- the data of ``bench_data.py`` (16 Parquet files, 32 float32 features + an int64 label,
  row groups of 64k; its ``write_data`` is imported, not copied), read with batch 1024:
  ``ArrowLoader(device="cuda")`` against the same loader on the CPU (target >= 0.9x) and
  against the staged-pinned baseline (a single-threaded loop that copies each
  64k-row record batch into one reused pinned 2-D buffer per dtype, one host-to-device
  copy per dtype, then 1024-row views), shuffled and not (the baseline does not
  shuffle; it is the anchor for both);
- the bootstrap seconds of a one-member NCCL group formed through Dask (a LocalCluster
  of one worker, ``coord.collective_group(backend="nccl")``, timed on the client);
- a DDP training step of a small MLP in that group (a closure on the worker) against
  plain DDP in this process (a one-rank NCCL group of its own), as a ratio.

    python benchmarks/bench_gpu.py                 # 4M rows
    python benchmarks/bench_gpu.py --rows 1000000
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
import warnings

import torch
from figures import record

try:  # run as a script (benchmarks/ on sys.path) or as benchmarks.bench_gpu
    from bench_data import BATCH, FEATURES, write_data
except ImportError:  # pragma: no cover - depends on how it is started
    from benchmarks.bench_data import BATCH, FEATURES, write_data


def _rate(fn, repeat: int) -> float:
    """Best rows/s of ``repeat`` runs of ``fn`` (which returns the rows it delivered)."""
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        n = fn()
        best = max(best, n / (time.perf_counter() - t0))
    return best


def run_loader(root: str, shuffle: bool, device: str) -> int:
    from daskdist.data import ArrowLoader, ArrowShards

    loader = ArrowLoader(ArrowShards(root), None, batch_size=BATCH, shuffle=shuffle, seed=0,
                         device=device)
    n = 0
    last = None
    for batch in loader:
        n += len(batch["label"])
        last = batch
    if last is not None and device != "cpu":
        torch.cuda.synchronize()  # the last copies are part of the cost
    return n


def run_staged_baseline(paths: list[str]) -> int:
    """The anchor: one reused pinned 2-D buffer per dtype, one copy per dtype."""
    import pyarrow.parquet as pq

    dev = torch.device("cuda")
    stream = torch.cuda.Stream()
    rows = 65536
    feats = torch.empty((len(FEATURES), rows), dtype=torch.float32, pin_memory=True)
    labels = torch.empty((rows,), dtype=torch.int64, pin_memory=True)
    done = None  # the event of the copy out of the staging buffers
    n = 0
    for p in paths:
        for rb in pq.ParquetFile(p).iter_batches(rows, columns=[*FEATURES, "label"]):
            k = rb.num_rows
            if done is not None:
                done.synchronize()  # the buffers are reused: the last copy must be over
            for j, c in enumerate(FEATURES):
                feats[j, :k].copy_(torch.from_numpy(rb.column(c).to_numpy()))
            labels[:k].copy_(torch.from_numpy(rb.column("label").to_numpy()))
            with torch.cuda.stream(stream):
                f_dev = torch.empty((len(FEATURES), k), dtype=torch.float32, device=dev)
                f_dev.copy_(feats[:, :k], non_blocking=True)
                l_dev = labels[:k].to(dev, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            torch.cuda.current_stream().wait_event(done)
            f_dev.record_stream(torch.cuda.current_stream())
            l_dev.record_stream(torch.cuda.current_stream())
            for a in range(0, k, BATCH):
                batch = dict(zip(FEATURES, f_dev[:, a:a + BATCH].unbind(0), strict=True))
                batch["label"] = l_dev[a:a + BATCH]
                n += len(batch["label"])
    torch.cuda.synchronize()
    return n


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(len(FEATURES), 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 1),
    )


def ddp_step_seconds(steps: int = 200, device: torch.device | None = None) -> float:
    """Seconds per DDP training step (forward, backward, allreduce, SGD) on the default
    process group, which must be formed already (a daskdist group, or our own)."""
    from torch.nn.parallel import DistributedDataParallel

    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    ids = [dev.index] if dev.index is not None else None
    model = DistributedDataParallel(_mlp().to(dev), device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, len(FEATURES), device=dev)
    y = torch.randn(BATCH, 1, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(20):  # warm-up: buckets, kernels, NCCL channels
        step()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) / steps


def _ddp_in_group(steps: int) -> tuple[float, str, str]:
    """A closure on the group's member: its DDP step seconds, backend and device."""
    import daskdist as dd

    g = dd.collective.get_group()
    return ddp_step_seconds(steps, g.device), g.backend, str(g.device)


def plain_ddp(steps: int) -> float:
    """DDP in this process on a one-rank NCCL group of its own (the anchor)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        return ddp_step_seconds(steps)
    finally:
        dist.destroy_process_group()


def group_figures(steps: int) -> tuple[float, float, str, str]:
    """(bootstrap s, DDP step s in the group, backend, device) on a 1-worker cluster."""
    from distributed import Client, LocalCluster

    import daskdist as dd

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                     dashboard_address=None) as cluster,
        Client(cluster) as client,
        dd.Coordinator(client) as coord,
    ):
        coord.wait_for_workers(1, timeout=120)
        t0 = time.perf_counter()
        group = coord.collective_group(backend="nccl", timeout=120)
        boot = time.perf_counter() - t0
        [rv] = coord.schedule_on_all(_ddp_in_group, args=(steps,))
        secs, backend, device = rv.fetch(timeout=600)
        assert group.backend == backend == "nccl", (group, backend)
        return boot, secs, backend, device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--row-group", type=int, default=65536)
    ap.add_argument("--repeat", type=int, default=3, help="runs per loader figure; best kept")
    ap.add_argument("--steps", type=int, default=200, help="timed DDP steps")
    ap.add_argument("--skip-group", action="store_true", help="no Dask cluster / NCCL group")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: skipped (CUDA is not available on this machine)")
        return 0
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    name = torch.cuda.get_device_name(0)

    with tempfile.TemporaryDirectory(prefix="daskdist-bench-gpu-") as root:
        paths = write_data(root, args.rows, args.row_group)
        print(f"data: {len(paths)} files, {args.rows:,} rows (bench_data.py's), batch {BATCH}; "
              f"GPU: {name}")
        run_staged_baseline(paths[:1])  # warm-up: CUDA context, pinned allocator
        run_loader(root, False, "cuda")
        fig = {
            "baseline": _rate(lambda: run_staged_baseline(paths), args.repeat),
            "cpu": _rate(lambda: run_loader(root, False, "cpu"), args.repeat),
            "cuda": _rate(lambda: run_loader(root, False, "cuda"), args.repeat),
            "cpu_shuffle": _rate(lambda: run_loader(root, True, "cpu"), args.repeat),
            "cuda_shuffle": _rate(lambda: run_loader(root, True, "cuda"), args.repeat),
        }

    print(f"\n{'pipeline':<46}{'rows/s':>10}{'x CPU loader':>14}{'x baseline':>12}")
    labels = {
        "baseline": ("staged-pinned baseline (no shuffle)", "cpu"),
        "cpu": ("ArrowLoader CPU (no shuffle)", "cpu"),
        "cuda": ("ArrowLoader cuda (no shuffle)", "cpu"),
        "cpu_shuffle": ("ArrowLoader CPU (shuffle)", "cpu_shuffle"),
        "cuda_shuffle": ("ArrowLoader cuda (shuffle)", "cpu_shuffle"),
    }
    for k, (label, anchor) in labels.items():
        print(f"{label:<46}{fig[k] / 1e6:>8.2f} M{fig[k] / fig[anchor]:>14.2f}"
              f"{fig[k] / fig['baseline']:>12.2f}")
    ok = True
    print("\ntargets:")
    for label, k, what in (("cuda / CPU loader (no shuffle)", "cuda", "no shuffle"),
                           ("cuda / CPU loader (shuffle)", "cuda_shuffle", "shuffle")):
        anchor = labels[k][1]
        ratio = fig[k] / fig[anchor]
        good = ratio >= 0.9
        ok &= good
        record(f"  {label:<44}{ratio:>8.2f}x  (target >= 0.9x)  {'ok' if good else 'MISS'}",
               what=f"`ArrowLoader(device=\"cuda\")` rows/s, {what}, batch {BATCH}",
               ours=fig[k], unit="rows/s", anchor="the same loader on the CPU",
               anchor_value=fig[anchor], target="≥ 0.9x", met=good)

    if args.skip_group:
        print("\nNCCL group and DDP: skipped (--skip-group)")
        return 0 if ok else 1
    boot, group_step, backend, device = group_figures(args.steps)
    plain_step = plain_ddp(args.steps)
    record(f"\nNCCL group of one member through Dask: bootstrap {boot:.2f} s "
           f"(backend {backend}, device {device})",
           what="an NCCL group of one member formed through Dask", ours=boot, unit="s",
           anchor="the target's bound", anchor_value=0.5, target="≤ 0.5 s", met=boot <= 0.5)
    record(f"DDP step, MLP {len(FEATURES)}-512-512-1, batch {BATCH}: group "
           f"{group_step * 1e3:.3f} ms, plain DDP in one process {plain_step * 1e3:.3f} ms, "
           f"ratio (plain / group) {plain_step / group_step:.2f}x",
           what=f"a DDP step in that group, MLP {len(FEATURES)}-512-512-1, batch {BATCH}",
           ours=group_step * 1e3, unit="ms",
           anchor="plain DDP in one process on its own NCCL group",
           anchor_value=plain_step * 1e3)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
