"""Allreduce bandwidth and bootstrap time: daskdist's group vs plain torch.distributed.

Three sides, same sizes (1, 16, 64 MB float32), same world size, gloo on CPU:

- ``baseline``: plain torch.distributed processes started without Dask
  (``TCPStore`` + ``init_process_group`` + ``dist.all_reduce``): the anchor.
- ``worker-side``: the same processes bootstrapped with daskdist's worker-side
  functions (``create_store`` / ``init_member``) and calling
  ``get_group().allreduce``: what our wrapper costs, without Dask.
- ``dask``: the group formed through Dask (``coord.collective_group()``) on a
  ``LocalCluster`` and timed inside a gang closure (``coord.schedule_on_all``).
  Skipped, with a note, while the coordinator does not offer those calls yet.

Bandwidth is algorithm bandwidth (tensor bytes / seconds per call), best of a few
repeats; ratios are against the baseline (target: >= 0.9x). Run:

    python benchmarks/bench_collective.py [--world 2] [--sizes 1 16 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MB = 2**20


def _iters(size_mb: int) -> int:
    return max(4, int(64 / size_mb))


def _time_allreduce(calls: dict, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Seconds per call (best of ``repeats``) of each ``calls[name](tensor)``, per size.

    The calls are interleaved repeat by repeat, so load on a shared machine hits
    every side alike.
    """
    out: dict[str, dict[int, float]] = {name: {} for name in calls}
    for size in sizes:
        t = torch.ones(size * MB // 4, dtype=torch.float32)
        n = _iters(size)
        best = dict.fromkeys(calls, float("inf"))
        for fn in calls.values():
            for _ in range(2):
                fn(t)  # warm up: connections, buffers
        for _ in range(repeats):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    fn(t)
                best[name] = min(best[name], (time.perf_counter() - t0) / n)
        for name in calls:
            out[name][size] = best[name]
    return out


def _member(rank: int, world: int, mode: str, sizes, repeats, addr_q, barrier, out_q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if mode == "baseline":
        barrier.wait()  # every process imported torch: time the bootstrap alone
        t0 = time.perf_counter()
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            for _ in range(world - 1):
                addr_q.put(store.port)
        else:
            store = dist.TCPStore("127.0.0.1", addr_q.get(), is_master=False)
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        boot = time.perf_counter() - t0
        secs = _time_allreduce({"baseline": lambda t: dist.all_reduce(t)}, sizes, repeats)
        dist.destroy_process_group()
    else:
        from daskdist.collective import create_store, destroy_member, get_group, init_member

        barrier.wait()
        t0 = time.perf_counter()
        if rank == 0:
            host, port = create_store(1, "127.0.0.1")
            for _ in range(world - 1):
                addr_q.put((host, port))
        else:
            host, port = addr_q.get()
        init_member(rank, world, host, port, "gloo", 1, 60.0)
        boot = time.perf_counter() - t0
        g = get_group()
        calls = {"same-procs plain": lambda t: dist.all_reduce(t), mode: lambda t: g.allreduce(t)}
        secs = _time_allreduce(calls, sizes, repeats)
        destroy_member()
    out_q.put((rank, boot, secs))


def run_processes(mode: str, world: int, sizes: list[int], repeats: int) -> tuple[float, dict]:
    """Spawn ``world`` processes (no Dask); returns (bootstrap s, {side: {size: s}})."""
    ctx = mp.get_context("spawn")
    addr_q, out_q, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(world)
    procs = [
        ctx.Process(target=_member, args=(r, world, mode, sizes, repeats, addr_q, barrier, out_q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [out_q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    # A call ends when its slowest rank ends: take the max over ranks.
    boot = max(b for _, b, _ in results)
    sides = results[0][2].keys()
    secs = {k: {s: max(r[2][k][s] for r in results) for s in sizes} for k in sides}
    return boot, secs


def _recovery_member(rank: int, addr_q, out_q) -> None:
    """3 members; rank 2 is SIGKILLed mid-loop; ranks 0 and 1 re-form as generation 2."""
    import os
    import signal

    from daskdist.collective import create_store, destroy_member, get_group, init_member
    from daskdist.errors import CollectiveError

    torch.set_num_threads(1)
    if rank == 0:
        host, port = create_store(1, "127.0.0.1")
        for _ in range(2):
            addr_q.put((host, port))
    else:
        host, port = addr_q.get()
    init_member(rank, 3, host, port, "gloo", 1, 60.0)
    g = get_group()
    t = torch.ones(MB // 4)
    for _ in range(5):
        g.allreduce(t)
    if rank == 2:
        out_q.put(("killed", time.time()))
        out_q.close()
        out_q.join_thread()  # flushed before the kill
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            g.allreduce(t)
    except CollectiveError:
        detected = time.time()
    destroy_member()
    if rank == 0:
        host, port = create_store(2, "127.0.0.1")
        addr_q.put((host, port))
    else:
        host, port = addr_q.get()
    init_member(rank, 2, host, port, "gloo", 2, 60.0)
    get_group().allreduce(t)
    out_q.put((rank, detected, time.time()))
    destroy_member()


def run_recovery() -> tuple[float, float]:
    """(kill -> error on survivors, error -> first step done on the re-formed group) s.

    Worker side only: no Dask, no Nanny restart, no scheduler notice; the transport
    reports the reset peer by itself.
    """
    ctx = mp.get_context("spawn")
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_recovery_member, args=(r, addr_q, out_q)) for r in range(3)]
    for p in procs:
        p.start()
    msgs = [out_q.get(timeout=120) for _ in range(3)]
    for p in procs:
        p.join(30)
    killed = next(m[1] for m in msgs if m[0] == "killed")
    survivors = [m for m in msgs if m[0] != "killed"]
    detect = max(m[1] for m in survivors) - killed
    reform = max(m[2] for m in survivors) - max(m[1] for m in survivors)
    return detect, reform


def _gang_step(sizes, repeats):
    import daskdist as dd

    g = dd.collective.get_group()
    return _time_allreduce({"dask": lambda t: g.allreduce(t),
                            "dask plain": lambda t: dist.all_reduce(t)}, sizes, repeats)


def run_through_dask(world: int, sizes: list[int], repeats: int) -> tuple | str:
    """The group formed through Dask; a string says why it was skipped."""
    try:
        from distributed import Client, LocalCluster

        import daskdist as dd

        Coordinator = dd.Coordinator
    except (ImportError, AttributeError) as e:
        return f"coordinator not available yet ({e})"
    if not hasattr(Coordinator, "collective_group"):
        return "Coordinator.collective_group() not available yet"
    with (
        LocalCluster(
            n_workers=world, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        # torch's own default thread count, as in the processes started without Dask
        coord = Coordinator(client, torch_threads=torch.get_num_threads())
        t0 = time.perf_counter()
        coord.collective_group(backend="gloo", timeout=60)
        boot = time.perf_counter() - t0
        rvs = coord.schedule_on_all(_gang_step, args=(sizes, repeats))
        results = [rv.fetch(timeout=600) for rv in rvs]
        recovery = _dask_recovery(coord, client)
    secs = {side: {s: max(r[side][s] for r in results) for s in sizes}
            for side in ("dask", "dask plain")}
    return boot, secs, recovery


def _small_step():
    import os

    import torch

    import daskdist as dd

    g = dd.collective.get_group()
    g.allreduce(torch.ones(1024))
    return g.generation, os.getpid()


def _dask_recovery(coord, client) -> tuple[float, int, int]:
    """Seconds from a member's SIGKILL to the next gang step done on the re-formed group
    (Nanny restart included), with the generations before and after."""
    import os
    import signal

    coord.fetch(coord.schedule_on_all(_small_step))
    before = coord.fetch(coord.schedule_on_all(_small_step))
    victim = before[-1][1]
    t_kill = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    while True:
        after = coord.fetch(coord.schedule_on_all(_small_step))
        if after[0][0] > before[0][0] and victim not in {pid for _, pid in after}:
            return time.perf_counter() - t_kill, before[0][0], after[0][0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], help="MB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-dask", action="store_true")
    a = ap.parse_args(argv)

    runs: dict[str, tuple[float, dict] | str] = {
        "baseline": run_processes("baseline", a.world, a.sizes, a.repeats),
        "worker-side": run_processes("worker-side", a.world, a.sizes, a.repeats),
        "dask": "skipped (--skip-dask)"
        if a.skip_dask
        else run_through_dask(a.world, a.sizes, a.repeats),
    }
    base = runs["baseline"][1]["baseline"]
    print(f"allreduce, gloo, {a.world} processes, float32; GB/s = tensor bytes / s per call")
    print("ratio: bandwidth / baseline bandwidth (same-procs: / plain calls in the same run)")
    print(f"{'side':<17} {'size':>6} {'ms/call':>9} {'GB/s':>7} {'ratio':>6} {'same-procs':>10}")
    for run, res in runs.items():
        if isinstance(res, str):
            print(f"{run:<17} {res}")
            continue
        secs = res[1]
        for side, per in secs.items():
            for s in a.sizes:
                gbs = s * MB / per[s] / 1e9
                ratio = base[s] / per[s]
                plain = secs.get("same-procs plain") or secs.get("dask plain")
                same = (f"{plain[s] / per[s]:>9.2f}x"
                        if plain and not side.endswith("plain") else "")
                print(f"{side:<17} {s:>4}MB {per[s] * 1e3:>9.2f} {gbs:>7.3f} {ratio:>5.2f}x {same}")
    dask_run = runs["dask"]
    if not isinstance(dask_run, str):
        took, g0, g1 = dask_run[2]
        print(f"\nrecovery through Dask: SIGKILL -> next gang step done on the re-formed "
              f"group (generation {g0} -> {g1}, Nanny restart included) {took:.2f} s "
              f"(target <= 3 s)")
    print(f"\n{'run':<17} {'bootstrap s':>12}")
    for run, res in runs.items():
        if not isinstance(res, str):
            print(f"{run:<17} {res[0]:>12.4f}")
    detect, reform = run_recovery()
    print(
        f"\nrecovery, worker side (3 -> 2 members, no Dask): SIGKILL -> CollectiveError on "
        f"survivors {detect * 1e3:.1f} ms; -> first step on generation 2 {reform * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
