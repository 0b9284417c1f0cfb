"""Lease bookkeeping benchmark (pure, no Dask): the ``"dynamic"`` policy's scheduler cost
as the number of units grows.

The workload of the issue: units of 1,000 rows, 4 worker sessions taking turns, every
row leased and then acknowledged in 250-row batches (one lease token per batch, as a
closure's result carries it). Printed per size: the epoch's seconds, bookkeeping rows/s,
acknowledgements/s, microseconds of table time per lease and per acknowledgement, the
peak memory of the epoch's table and the size of the dataset's unit definition.

The anchor is the table before units were ranges (the commit's ``daskdist/core/leases/table.py``,
loaded from git in the same run: one lease per unit, the unit row list sent and compared
on every lease), measured up to ``--old-max-units`` (its cost is quadratic: 10^5 units
would take about 25 minutes). Targets: rows/s at 10^6 units within 2x of 10^3 units,
and at most 20 µs per lease plus acknowledgement.

    python benchmarks/bench_leases.py                   # 10^3 .. 10^6 units
    python benchmarks/bench_leases.py --sizes 1000 10000 --old-max-units 10000
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
import tracemalloc
import types

from figures import record

from daskdist.core.leases import table as new_leases
from daskdist.core.leases.units import DenseUnits
from daskdist.core.protocol import LeaseToken

ROWS_PER_UNIT = 1000
BATCH = 250
SESSIONS = 4
LEASE_ROWS = 65536
BASE_COMMIT = "b216f4f"  # the last commit with the per-unit table
DS = "bench"


def old_module() -> types.ModuleType | None:
    """The pre-issue-19 lease table, from git (``None`` outside a checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mods = []
    for name in ("intervals", "leases"):  # its interval helpers of that day, too
        try:
            src = subprocess.run(["git", "show", f"{BASE_COMMIT}:daskdist/core/{name}.py"],
                                 cwd=root, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        src = src.replace("from daskdist.core.intervals import", "from old_intervals import")
        mod = types.ModuleType(f"old_{name}")
        sys.modules[f"old_{name}"] = mod  # dataclasses look their module up
        exec(compile(src, f"old_{name}.py", "exec"), mod.__dict__)  # noqa: S102 - ours
        mods.append(mod)
    return mods[-1]


def batches(ranges):
    """A lease's rows cut into BATCH-row acknowledgements (one token each)."""
    out = []
    for a, b in ranges:
        for s in range(a, b, BATCH):
            out.append((s, min(b, s + BATCH)))
    return out


def run_epoch(table, acquire, units: int, timers: dict | None = None) -> None:
    """Sessions take turns: lease when the previous lease is used up, else acknowledge
    one batch. ``acquire(session)`` returns intervals or None."""
    clock = time.perf_counter
    queues = {f"s{i}": [] for i in range(SESSIONS)}
    live = list(queues)
    t_lease = t_ack = 0.0
    n_lease = n_ack = 0
    while live:
        for s in list(live):
            q = queues[s]
            if not q:
                t0 = clock()
                got = acquire(s)
                t_lease += clock() - t0
                n_lease += 1
                if got is None:
                    live.remove(s)
                    continue
                q.extend(reversed(batches(got)))
            a, b = q.pop()
            tok = LeaseToken.of(DS, 0, [(a, b)])
            t0 = clock()
            ok = table.ack_tokens(s, [tok])
            t_ack += clock() - t0
            n_ack += 1
            assert ok
    assert table.progress(DS, 0)["complete"]
    if timers is not None:
        timers.update(t_lease=t_lease, t_ack=t_ack, n_lease=n_lease, n_ack=n_ack)


def new_table(units: int):
    table = new_leases.LeaseTable()
    table.define(DS, [(ROWS_PER_UNIT, units)])
    return table, lambda s: table.acquire(s, DS, 0, LEASE_ROWS, parts=SESSIONS)


def old_table(mod, units: int):
    table = mod.LeaseTable()
    unit_rows = [ROWS_PER_UNIT] * units

    def acquire(s):
        got = table.acquire(s, DS, 0, unit_rows)
        return None if got is None else got[1]

    return table, acquire


def measure(make, units: int) -> dict:
    table, acquire = make(units)
    timers: dict = {}
    gc.collect()
    t0 = time.perf_counter()
    run_epoch(table, acquire, units, timers)
    seconds = time.perf_counter() - t0
    rows = units * ROWS_PER_UNIT
    out = {
        "seconds": seconds, "rows_per_s": rows / seconds,
        "acks_per_s": timers["n_ack"] / seconds,
        "us_lease": 1e6 * timers["t_lease"] / timers["n_lease"],
        "us_ack": 1e6 * timers["t_ack"] / timers["n_ack"],
        "leases": timers["n_lease"], "acks": timers["n_ack"],
    }
    # memory: a second epoch under tracemalloc (slower, so not timed); the peak above
    # what the table held before the epoch began (its definition included separately)
    table, acquire = make(units)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    run_epoch(table, acquire, units)
    out["epoch_peak_bytes"] = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return out


def definition_bytes(units: int) -> tuple[int, int]:
    """Bytes of the unit definition on the scheduler: every unit of one size, and the
    worst case (every unit a different size)."""
    same = DenseUnits([(ROWS_PER_UNIT, units)]).nbytes()
    worst = DenseUnits([(ROWS_PER_UNIT + (i % 2), 1) for i in range(units)]).nbytes()
    return same, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000, 1000000])
    ap.add_argument("--old-max-units", type=int, default=10000,
                    help="largest size the pre-issue-19 table is measured at")
    args = ap.parse_args(argv)
    old = old_module()
    if old is None:
        print(f"the pre-issue-19 table (git {BASE_COMMIT}) is not available: anchors skipped")

    print(f"workload: {ROWS_PER_UNIT:,}-row units, {SESSIONS} sessions, acknowledged in "
          f"{BATCH}-row batches; leases of >= {LEASE_ROWS:,} rows (new) / one unit (old)\n")
    head = (f"{'units':>9} {'table':>5} {'seconds':>9} {'rows/s':>10} {'acks/s':>9} "
            f"{'us/lease':>9} {'us/ack':>7} {'leases':>8} {'epoch peak':>11}")
    print(head)
    results: dict[int, dict] = {}
    anchors: dict[int, dict] = {}
    for units in args.sizes:
        if old is not None and units <= args.old_max_units:
            r = anchors[units] = measure(lambda n, m=old: old_table(m, n), units)
            print(_row(units, "old", r))
        r = results[units] = measure(new_table, units)
        print(_row(units, "new", r))
        sys.stdout.flush()

    print("\nold -> new, same run:")
    for units, a in anchors.items():
        n = results[units]
        line = (f"  {units:>9,} units: {a['seconds']:.2f} s -> {n['seconds']:.3f} s "
                f"({a['seconds'] / n['seconds']:.0f}x faster), "
                f"{a['rows_per_s'] / 1e6:.2f} -> {n['rows_per_s'] / 1e6:.1f} M rows/s")
        if units < max(anchors):
            print(line)
            continue
        record(line, what=f"lease bookkeeping rows/s at {units:,} units, against the "
               "earlier table", ours=n["rows_per_s"], unit="rows/s",
               anchor="one lease per unit, its row list sent and compared every lease "
               "(from git)", anchor_value=a["rows_per_s"])

    print("\nunit definition on the scheduler (once per dataset):")
    for units in args.sizes:
        same, worst = definition_bytes(units)
        print(f"  {units:>9,} units: {same} bytes (one row-group size), {worst:,} bytes = "
              f"{worst / units:.1f} bytes/unit (every unit a different size)")

    print("\ntargets:")
    small, large = min(results), max(results)
    ratio = results[large]["rows_per_s"] / results[small]["rows_per_s"]
    ok = ratio >= 0.5
    record(f"  rows/s at {large:,} units / at {small:,} units: {ratio:.2f}x "
           f"(target >= 0.5x, within 2x)  {'ok' if ok else 'MISS'}",
           what=f"lease bookkeeping rows/s, {large:,} vs {small:,} units of "
           f"{ROWS_PER_UNIT:,} rows",
           ours=results[large]["rows_per_s"], unit="rows/s",
           anchor=f"the same at {small:,} units", anchor_value=results[small]["rows_per_s"],
           target="≥ 0.5x", met=ok)
    for units, r in results.items():
        per = r["us_lease"] + r["us_ack"]
        good = per <= 20.0
        ok &= good
        record(f"  {units:>9,} units: {r['us_lease']:.1f} us/lease + {r['us_ack']:.1f} us/ack"
               f" = {per:.1f} us (target <= 20 us)  {'ok' if good else 'MISS'}",
               what=f"a lease + an acknowledgement, {units:,} units", ours=per, unit="µs",
               anchor="the target's bound", anchor_value=20.0, target="≤ 20 µs", met=good)
    return 0 if ok else 1


def _row(units: int, which: str, r: dict) -> str:
    return (f"{units:>9,} {which:>5} {r['seconds']:>9.3f} {r['rows_per_s'] / 1e6:>8.2f} M "
            f"{r['acks_per_s'] / 1e3:>7.1f}k {r['us_lease']:>9.1f} {r['us_ack']:>7.1f} "
            f"{r['leases']:>8,} {r['epoch_peak_bytes'] / 1024:>8.1f} KB")


if __name__ == "__main__":
    sys.exit(main())
