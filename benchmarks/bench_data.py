"""Data benchmark: ArrowLoader rows/s against the pyarrow limit and what users write today.

Writes 16 Parquet files (``--rows`` rows in all, 32 float32 features + an int64 label,
row groups of 64k) to a temp dir, then measures, in one run, rows/s of:

- the limit: pyarrow ``iter_batches(65536)``, each column to a tensor once with
  ``torch.from_numpy``, then 1024-row views (no shuffle, no per-row work);
- ArrowLoader without and with shuffle (batch 1024);
- a hand-written map-style torch ``Dataset`` + ``DataLoader(batch_size=1024, shuffle=True)``;
- a torch ``IterableDataset`` over record batches with ``DataLoader(num_workers=0 / 2)``
  (the slow anchors, map-style and 2 workers, run on ``--slow-rows`` rows: a rate is a rate);
- Ray Data ``iter_torch_batches`` when ``ray`` is installed (skipped otherwise).

Each figure is printed beside the limit as a ratio, with its targets, and the
peak RSS of a child process that only iterates the shuffled loader (bounded by its
buffers, not the data size).

Through a coordinator (``--section policies``): rows/s of ``"dynamic"``
against ``"file"`` on a LocalCluster of 2 single-threaded workers, with 100-row and
10,000-row row groups, at 500 and 20,000 row groups (files repeated as symlinks: the
units are real, the disk is not; at most ``--e2e-rows`` rows are read per run).
Targets: dynamic >= 0.8x file in every case, and 20,000 vs 500 row groups >= 0.8x.
``--section responsiveness``: while a 10^5-unit dynamic epoch runs on 3 workers, the
round trip of ``client.scheduler_info()`` (target p99 <= 50 ms).

    python benchmarks/bench_data.py            # every section; the loader on 4M rows
    python benchmarks/bench_data.py --rows 200000 --section loader
    python benchmarks/bench_data.py --section policies responsiveness
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import deque

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from figures import record

from daskdist.data import ArrowLoader, ArrowShards

FEATURES = [f"f{i}" for i in range(32)]
BATCH = 1024
FILES = 16


def write_data(root: str, rows: int, row_group: int, dictionary: bool = False) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    per = -(-rows // FILES)
    for f in range(FILES):
        n = max(0, min(per, rows - f * per))
        cols = {c: rng.random(n, dtype=np.float32) for c in FEATURES}
        cols["label"] = np.arange(f * per, f * per + n, dtype=np.int64)
        path = os.path.join(root, f"part-{f:02d}.parquet")
        # Dense random float features gain nothing from dictionary pages (pyarrow's
        # default tries them first); --dictionary keeps the default.
        pq.write_table(pa.table(cols), path, row_group_size=row_group,
                       use_dictionary=dictionary)
        paths.append(path)
    return paths


def peak_rss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024 if sys.platform != "darwin" else r / 2**20


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure_memory(root: str) -> None:
    """Child process: iterate a shuffled ArrowLoader, print peak anonymous RSS (MB).

    Sampled every 16 batches. Anonymous memory is what the loader allocates; the
    memory-mapped Parquet pages it reads are page cache the kernel can drop."""
    base = _status_kb("RssAnon")
    peak = base
    loader = ArrowLoader(ArrowShards(root), None, batch_size=BATCH, shuffle=True, seed=0)
    for i, _batch in enumerate(loader):
        if i % 16 == 0:
            peak = max(peak, _status_kb("RssAnon"))
    print(f"{base / 1024:.0f} {peak / 1024:.0f} {_status_kb('VmHWM') / 1024:.0f}")


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - t0), n


def run_limit(paths: list[str], memory_map: bool = False) -> int:
    n = 0
    for p in paths:
        for rb in pq.ParquetFile(p, memory_map=memory_map).iter_batches(65536):
            cols = {name: torch.from_numpy(rb.column(i).to_numpy())
                    for i, name in enumerate(rb.schema.names)}
            for a in range(0, rb.num_rows, BATCH):
                batch = {k: v[a:a + BATCH] for k, v in cols.items()}
                n += len(batch["label"])
    return n


def run_loader(root: str, shuffle: bool, **kw) -> int:
    loader = ArrowLoader(ArrowShards(root), None, batch_size=BATCH, shuffle=shuffle, seed=0,
                         **kw)
    n = 0
    for batch in loader:
        n += len(batch["label"])
    return n


class MapDataset(torch.utils.data.Dataset):
    """What users write today: the table in memory, one row per ``__getitem__``."""

    def __init__(self, paths: list[str], max_rows: int) -> None:
        table = pa.concat_tables(pq.read_table(p) for p in paths).slice(0, max_rows)
        self.x = np.stack([table.column(c).to_numpy() for c in FEATURES], axis=1)
        self.y = table.column("label").to_numpy()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.x[i]), int(self.y[i])


def run_map_style(ds: MapDataset) -> int:
    n = 0
    for x, _y in torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True):
        n += len(x)
    return n


class RecordBatches(torch.utils.data.IterableDataset):
    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        paths = self.paths if info is None else self.paths[info.id::info.num_workers]
        for p in paths:
            for rb in pq.ParquetFile(p).iter_batches(65536):
                cols = {name: torch.from_numpy(rb.column(i).to_numpy())
                        for i, name in enumerate(rb.schema.names)}
                for a in range(0, rb.num_rows, BATCH):
                    yield {k: v[a:a + BATCH] for k, v in cols.items()}


def run_iterable(paths: list[str], workers: int) -> int:
    n = 0
    dl = torch.utils.data.DataLoader(RecordBatches(paths), batch_size=None, num_workers=workers)
    for batch in dl:
        n += len(batch["label"])
    return n


def run_ray(root: str) -> int:
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, ignore_reinit_error=True)
    try:
        ds = ray.data.read_parquet(root)
        n = 0
        for batch in ds.iter_torch_batches(batch_size=BATCH):
            n += len(batch["label"])
        return n
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--row-group", type=int, default=65536)
    ap.add_argument("--slow-rows", type=int, default=500_000,
                    help="rows for the slow anchors (map-style, IterableDataset with workers)")
    ap.add_argument("--measure-memory", metavar="ROOT", help=argparse.SUPPRESS)
    ap.add_argument("--dictionary", action="store_true",
                    help="write with pyarrow's default dictionary encoding")
    ap.add_argument("--repeat", type=int, default=2, help="runs per figure; best is kept")
    ap.add_argument("--section", nargs="+", default=["loader", "policies", "responsiveness"],
                    choices=["loader", "policies", "responsiveness"])
    ap.add_argument("--e2e-rows", type=int, default=2_000_000,
                    help="rows read per run through the coordinator (policies section)")
    ap.add_argument("--e2e-units", type=int, default=100_000,
                    help="units of the responsiveness section's epoch")
    args = ap.parse_args(argv)
    if args.measure_memory:
        measure_memory(args.measure_memory)
        return 0
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    ok = True
    if "loader" in args.section:
        ok &= loader_section(args)
    if "policies" in args.section:
        ok &= policies_section(args)
    if "responsiveness" in args.section:
        ok &= responsiveness_section(args)
    return 0 if ok else 1


def loader_section(args: argparse.Namespace) -> bool:
    """The loader alone against the pyarrow limit and the anchors (one process)."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    with tempfile.TemporaryDirectory(prefix="daskdist-bench-") as root:
        t0 = time.perf_counter()
        paths = write_data(root, args.rows, args.row_group, args.dictionary)
        size = sum(os.path.getsize(p) for p in paths) / 2**20
        raw = args.rows * (32 * 4 + 8) / 2**20
        print(f"data: {FILES} files, {args.rows:,} rows, {size:.0f} MB on disk, "
              f"{raw:.0f} MB in memory; written in {time.perf_counter() - t0:.1f} s")
        rss_before = peak_rss_mb()

        def best(fn):
            return max(timed(fn)[0] for _ in range(args.repeat))

        figures: dict[str, float] = {}
        figures["limit"] = best(lambda: run_limit(paths))
        figures["limit_mmap"] = best(lambda: run_limit(paths, memory_map=True))
        figures["loader"] = best(lambda: run_loader(root, False))
        figures["loader_shuffle"] = best(lambda: run_loader(root, True))
        figures["loader_shuffle_256k"] = best(
            lambda: run_loader(root, True, shuffle_buffer=262144))
        rss_loader = peak_rss_mb()
        child = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--measure-memory", root],
            capture_output=True, text=True, check=True)
        anon_base, anon_peak, hwm = (float(x) for x in child.stdout.split()[-3:])
        figures["iterable_w0"] = best(lambda: run_iterable(paths, 0))
        slow = min(args.slow_rows, args.rows)
        few = paths[: max(1, -(-slow * FILES // args.rows))]
        figures["iterable_w2"] = timed(lambda: run_iterable(few, 2))[0]
        ds = MapDataset(paths, slow)
        figures["map_style"] = timed(lambda: run_map_style(ds))[0]
        ray_rate = None
        try:
            import ray  # noqa: F401
        except ImportError:
            print("ray: not installed (optional `bench` extra); Ray Data comparison skipped")
        else:
            t1 = time.perf_counter()
            ray_rate = timed(lambda: run_ray(root))[0]
            print(f"ray: measured in {time.perf_counter() - t1:.1f} s including start-up")

    lim = figures["limit"]
    print(f"\n{'pipeline':<44}{'rows/s':>12}{'x limit':>10}")
    labels = {
        "limit": "limit: pyarrow iter_batches -> from_numpy",
        "limit_mmap": "  the same with memory_map=True (info)",
        "loader": "ArrowLoader (no shuffle)",
        "loader_shuffle": "ArrowLoader (shuffle, 64k-row buffer)",
        "loader_shuffle_256k": "ArrowLoader (shuffle, 256k-row buffer)",
        "iterable_w0": "torch IterableDataset, num_workers=0",
        "iterable_w2": "torch IterableDataset, num_workers=2",
        "map_style": "torch map-style Dataset, shuffle=True",
    }
    for k, label in labels.items():
        print(f"{label:<44}{figures[k] / 1e6:>10.2f} M{figures[k] / lim:>10.2f}")
    if ray_rate is not None:
        label = "Ray Data iter_torch_batches"
        print(f"{label:<44}{ray_rate / 1e6:>10.2f} M{ray_rate / lim:>10.2f}")

    print("\ntargets:")
    limit = "pyarrow → torch, the limit"
    map_style = "a map-style torch `DataLoader`, shuffle"
    # (label, what, ours, anchor, anchor's rows/s, target ratio)
    checks = [
        ("ArrowLoader / limit (no shuffle)", "ArrowLoader rows/s, no shuffle",
         figures["loader"], limit, lim, 0.85),
        ("ArrowLoader / limit (shuffle)", "ArrowLoader rows/s, shuffle (64k-row buffer)",
         figures["loader_shuffle"], limit, lim, 0.6),
        ("ArrowLoader shuffle / map-style DataLoader", "ArrowLoader rows/s, shuffle",
         figures["loader_shuffle"], map_style, figures["map_style"], 20.0),
    ]
    info = [
        ("ArrowLoader no shuffle / map-style", figures["loader"] / figures["map_style"]),
        ("the limit itself / map-style", lim / figures["map_style"]),
        ("ArrowLoader / limit with memory_map", figures["loader"] / figures["limit_mmap"]),
    ]
    if ray_rate is not None:
        checks.append(("ArrowLoader / Ray Data", "ArrowLoader rows/s, no shuffle",
                       figures["loader"], "Ray Data `iter_torch_batches`", ray_rate, 10.0))
    ok = True
    for label, what, ours, anchor, theirs, target in checks:
        ratio = ours / theirs
        good = ratio >= target
        ok &= good
        record(f"  {label:<44}{ratio:>8.2f}x  (target >= {target}x)  "
               f"{'ok' if good else 'MISS'}", what=what, ours=ours, unit="rows/s",
               anchor=anchor, anchor_value=theirs, target=f"≥ {target:g}x", met=good)
    if ray_rate is None:
        print(f"  {'ArrowLoader / Ray Data':<44}{'skipped':>9}  (ray not installed)")
    for label, ratio in info:
        print(f"  {label:<44}{ratio:>8.2f}x  (for context)")
    print(f"\npeak RSS of a process that only iterates the shuffled ArrowLoader: "
          f"{anon_peak:.0f} MB anonymous ({anon_peak - anon_base:.0f} MB above the "
          f"{anon_base:.0f} MB of imports), {hwm:.0f} MB including mapped file pages; "
          f"the data is {raw:.0f} MB in memory")
    print(f"peak RSS of this process: {rss_before:.0f} MB after writing the data, "
          f"{rss_loader:.0f} MB after the ArrowLoader runs (includes page cache of the "
          f"memory-mapped files), {peak_rss_mb():.0f} MB at the end (the map-style "
          f"Dataset holds its rows in memory)")
    return ok


# -- through a coordinator: "dynamic" against "file" --------------------------

E2E_FEATURES = [f"x{i}" for i in range(16)]
E2E_BATCH = 1024  # rows per worker batch
E2E_TAKE = 16  # batches per closure
GROUPS_PER_FILE = 25


def write_units(root: str, row_group: int, groups: int, physical: int = 20) -> str:
    """``groups`` row groups of ``row_group`` rows in files of GROUPS_PER_FILE row
    groups: ``physical`` real files, the rest symlinks to them (the loader's units and
    the lease table's rows are real; the page cache holds one copy)."""
    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    n = row_group * GROUPS_PER_FILE
    files = -(-groups // GROUPS_PER_FILE)
    real = []
    for f in range(min(physical, files)):
        cols = {c: rng.random(n, dtype=np.float32) for c in E2E_FEATURES}
        cols["label"] = np.arange(n, dtype=np.int64)
        path = os.path.join(root, f"real-{f:05d}.parquet")
        pq.write_table(pa.table(cols), path, row_group_size=row_group, use_dictionary=False)
        real.append(path)
    for f in range(files):
        link = os.path.join(root, f"part-{f:05d}.parquet")
        os.symlink(real[f % len(real)], link)
    return os.path.join(root, "part-*.parquet")


def take(it, batches: int) -> int:
    """A closure: up to ``batches`` batches of the worker's iterator; rows taken."""
    n = 0
    for _ in range(batches):
        try:
            n += len(next(it)["label"])
        except StopIteration:
            break
    return n


def drive(coord, it, workers: int, target: int) -> tuple[float, int]:
    """Closures kept in flight (4 per worker) until ``target`` rows or the end of the
    epoch; rows/s after a first closure per worker (the loaders are built by then)."""
    coord.fetch([coord.schedule(take, args=(it, 1)) for _ in range(workers)])
    t0 = time.perf_counter()
    rows = 0
    inflight = deque(coord.schedule(take, args=(it, E2E_TAKE)) for _ in range(4 * workers))
    while inflight:
        n = inflight.popleft().fetch()
        rows += n
        if n and rows < target:
            inflight.append(coord.schedule(take, args=(it, E2E_TAKE)))
    return rows / (time.perf_counter() - t0), rows


def policies_section(args: argparse.Namespace) -> bool:
    import dask
    from distributed import Client, LocalCluster

    import daskdist as dd

    dask.config.set({"distributed.worker.daemon": False})
    configs = [(100, 500), (100, 20_000), (10_000, 500), (10_000, 20_000)]
    figures: dict[tuple[int, int, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="daskdist-bench-e2e-") as tmp, \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client, name="bench-data")
        coord.wait_for_workers(2, timeout=120)
        print(f"\nthrough a coordinator: 2 workers x 1 thread, {len(E2E_FEATURES)} float32 "
              f"features + int64 label, batches of {E2E_BATCH} rows per worker, closures "
              f"of {E2E_TAKE} batches; at most {args.e2e_rows:,} rows a run; best of "
              f"{args.repeat}")
        print(f"{'row group':>10} {'row groups':>11} {'file rows/s':>13} "
              f"{'dynamic rows/s':>15} {'dynamic/file':>13}")
        for row_group, groups in configs:
            pattern = write_units(os.path.join(tmp, f"{row_group}-{groups}"), row_group, groups)
            for policy in ("dynamic", "file") * args.repeat:  # alternately
                ds = coord.distribute_dataset(pattern, global_batch_size=2 * E2E_BATCH,
                                              policy=policy)
                rate, _rows = drive(coord, iter(ds), 2, args.e2e_rows)
                key = (row_group, groups, policy)
                figures[key] = max(figures.get(key, 0.0), rate)
                del ds
            f, d = figures[(row_group, groups, "file")], figures[(row_group, groups, "dynamic")]
            print(f"{row_group:>10,} {groups:>11,} {f / 1e3:>11.0f} k {d / 1e3:>13.0f} k "
                  f"{d / f:>12.2f}x")
            sys.stdout.flush()
        coord.close()
    print("\ntargets:")
    ok = True
    for row_group, groups in configs:
        d, f = figures[(row_group, groups, "dynamic")], figures[(row_group, groups, "file")]
        good = d / f >= 0.8
        ok &= good
        record(f"  dynamic / file, {row_group:,}-row groups x {groups:,}: {d / f:.2f}x "
               f"(target >= 0.8x)  {'ok' if good else 'MISS'}",
               what=f'`"dynamic"` rows/s through a coordinator, 2 workers, {groups:,} row '
               f"groups of {row_group:,} rows", ours=d, unit="rows/s",
               anchor='`"file"`, the same run', anchor_value=f, target="≥ 0.8x", met=good)
    for row_group in (100, 10_000):
        many, few = figures[(row_group, 20_000, "dynamic")], figures[(row_group, 500, "dynamic")]
        good = many / few >= 0.8
        ok &= good
        record(f"  dynamic, 20,000 / 500 row groups of {row_group:,} rows: {many / few:.2f}x "
               f"(target >= 0.8x)  {'ok' if good else 'MISS'}",
               what=f'`"dynamic"` rows/s, 20,000 row groups of {row_group:,} rows',
               ours=many, unit="rows/s", anchor="the same at 500 row groups",
               anchor_value=few, target="≥ 0.8x", met=good)
    return ok


def responsiveness_section(args: argparse.Namespace) -> bool:
    """The scheduler's event loop while a dynamic epoch of ``--e2e-units`` 100-row units
    runs on 3 workers: ``scheduler_info()`` round trips, every 20 ms, from a thread."""
    import dask
    from distributed import Client, LocalCluster

    import daskdist as dd

    dask.config.set({"distributed.worker.daemon": False})
    units = args.e2e_units
    with tempfile.TemporaryDirectory(prefix="daskdist-bench-resp-") as tmp, \
            LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                         dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        pattern = write_units(tmp, 100, units)
        coord = dd.Coordinator(client, name="bench-resp")
        coord.wait_for_workers(3, timeout=120)
        ds = coord.distribute_dataset(pattern, global_batch_size=3 * E2E_BATCH,
                                      policy="dynamic")
        rtts: list[float] = []
        stop = threading.Event()

        def ping() -> None:
            while not stop.wait(0.02):
                t0 = time.perf_counter()
                client.scheduler_info()
                rtts.append(time.perf_counter() - t0)

        pinger = threading.Thread(target=ping, daemon=True)
        t0 = time.perf_counter()
        pinger.start()
        rate, _ = drive(coord, iter(ds), 3, units * 100)
        stop.set()
        pinger.join()
        seconds = time.perf_counter() - t0
        p = ds.progress()
        coord.close()
    rtts.sort()
    p50, p99 = rtts[len(rtts) // 2], rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))]
    print(f"\nresponsiveness: a {units:,}-unit epoch ({units * 100:,} rows of 100-row "
          f"units) on 3 workers in {seconds:.1f} s ({rate / 1e3:.0f} k rows/s, complete: "
          f"{p['complete']}); {len(rtts)} scheduler_info() round trips: p50 "
          f"{p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {rtts[-1] * 1e3:.1f} ms")
    good = p99 <= 0.05 and p["complete"]
    record(f"  scheduler_info() p99 {p99 * 1e3:.1f} ms (target <= 50 ms)  "
           f"{'ok' if good else 'MISS'}",
           what=f"`scheduler_info()` round trip, p99, during a {units:,}-unit dynamic epoch "
           "on 3 workers", ours=p99 * 1e3, unit="ms", anchor="the target's bound",
           anchor_value=50.0, target="≤ 50 ms", met=good)
    return good


if __name__ == "__main__":
    sys.exit(main())
