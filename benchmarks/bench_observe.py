"""What measuring a gang member's phases costs (SPEC §5.1, §6: at most 1% of a 20 ms step).

One process, a one-member gloo group formed with daskdist's worker-side bootstrap, and a
training step of the SPEC's shape: a batch from a daskdist ``ArrowLoader`` through
``dd.collective.synced`` (its agreement allreduce), about 20 ms of compute (a calibrated
matmul loop), ``allreduce_gradients`` and ``State.commit()`` every step. Its hooks: the
synced data phase (with the loader's and the allreduce's nested inside), the gradient
allreduce, the commit (with its allgather nested), the step mark.

- **anchor**: the step with no measurement (no gang recorder active: each hook is one
  global read), what a daskdist without observation costs;
- **ours**: the same step with the recorder of a gang closure active (what every gang
  member runs), alternating with the anchor in rounds so the machine's load hits both.

Printed: the median step of each, their ratio and difference; and, more precisely (a
step's noise is larger than the hooks), the hooks alone: the same sequence of hook calls
a step makes, timed on and off over many repetitions, as microseconds a step and a share
of a 20 ms step (target <= 1%). Run:

    python benchmarks/bench_observe.py [--rounds 6] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from figures import record

import daskdist as dd
from daskdist.collective import create_store, destroy_member, init_member
from daskdist.context import InputContext
from daskdist.data import ArrowLoader
from daskdist.observe import phases
from daskdist.observe.steptimes import COLLECTIVE, COMMIT, DATA

STEP = 0.020  # seconds of compute a step (the SPEC's 20 ms step)


def calibrate(target: float) -> tuple[torch.Tensor, int]:
    """A matrix and a repeat count whose matmul loop takes about ``target`` seconds on
    this machine unloaded (the fastest of several timings: a shared machine's load only
    slows a timing down)."""
    a = torch.randn(192, 192)
    reps = 16
    best = min(_timed(a, reps) for _ in range(7))
    return a, max(1, round(reps * target / best))


def _timed(a: torch.Tensor, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ a
    return time.perf_counter() - t0


def write_rows(root: Path, n: int) -> str:
    x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
                             "y": x.sum(1)}), root / "rows.parquet", row_group_size=4096)
    return str(root / "rows.parquet")


def run_steps(path: str, steps: int, work: tuple[torch.Tensor, int], on: bool) -> list[float]:
    """``steps`` training steps; the seconds of each (after the first two)."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), 0.01)
    state = dd.collective.State(model=model, optimizer=opt, step=0)
    loader = ArrowLoader(path, InputContext(), batch_size=32, policy="off", prefetch=2)
    a, reps = work
    rec = phases.Recorder(10.0, "bench") if on else None
    times: list[float] = []
    with phases.recording(rec) if rec is not None else _nothing():
        t0 = time.perf_counter()
        for batch in dd.collective.synced(loader):
            for _ in range(reps):  # the step's compute
                a @ a
            opt.zero_grad()
            ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean().backward()
            dd.collective.allreduce_gradients(model, average=True)
            opt.step()
            state.step += 1
            state.commit()
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
            if len(times) >= steps + 2:
                break
    loader.close()
    if rec is not None:
        assert rec.total >= steps, rec.total  # the recorder saw every step
    return times[2:]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def hooks_alone(repeat: int, on: bool) -> float:
    """Seconds a step's hook calls take (no work inside them): synced's data phase with
    the loader's and the agreement allreduce's nested, the gradients' allreduce, the
    commit with its allgather nested, the step mark."""
    @phases.timed(COLLECTIVE)
    def collective() -> None:
        pass

    @phases.timed(DATA, counts_rows=True)
    def loader_next() -> dict:
        return BATCH

    @phases.timed(COMMIT, ends_step=True)
    def commit() -> None:
        collective()  # its allgather

    rec = phases.Recorder(10.0, "bench") if on else None
    with phases.recording(rec) if rec is not None else _nothing():
        t0 = time.perf_counter()
        for _ in range(repeat):
            phases.step(phases.SYNCED)
            with phases.phase(DATA) as waited:
                batch = loader_next()
                collective()  # the agreement
                waited.rows(phases.batch_rows(batch))
            collective()  # the gradients
            commit()
        return (time.perf_counter() - t0) / repeat


BATCH = {"x": torch.zeros(32, 4), "y": torch.zeros(32)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="on/off rounds, alternating")
    p.add_argument("--steps", type=int, default=60, help="steps a round")
    p.add_argument("--repeat", type=int, default=20_000, help="hook sequences timed")
    args = p.parse_args()
    torch.set_num_threads(1)
    host, port = create_store(1, "127.0.0.1")
    init_member(0, 1, host, port, "gloo", 1, 60.0)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_rows(Path(tmp), 32 * (args.steps + 8) * 2)
            work = calibrate(STEP)
            steps: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    steps[on] += run_steps(path, args.steps, work, on)
            hooks: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    hooks[on].append(hooks_alone(args.repeat, on))
    finally:
        destroy_member()
    off, on = statistics.median(steps[False]), statistics.median(steps[True])
    print(f"A training step (synced loader batch, ~{STEP * 1e3:.0f} ms compute, gradient "
          f"allreduce, State.commit), {args.rounds} rounds x {args.steps} steps, "
          "alternating:")
    print(f"  anchor (no measurement):  {off * 1e3:8.3f} ms a step (median)")
    print(f"  ours (phases measured):   {on * 1e3:8.3f} ms a step (median)")
    noise = float(np.percentile(steps[False], 90)) - off
    record(f"  ours / anchor = {on / off:.4f}x ({(on - off) * 1e6:+.0f} µs a step; a step's "
           f"noise: p90 - median of the anchor {noise * 1e3:.2f} ms)",
           what=f"a whole ~{STEP * 1e3:.0f} ms training step, per-rank phases measured "
           f"(a step's noise, p90 - median: {noise * 1e3:.2f} ms)", ours=on * 1e3, unit="ms",
           anchor="the same step unmeasured, alternating", anchor_value=off * 1e3)
    h_off, h_on = min(hooks[False]), min(hooks[True])
    cost = h_on - h_off
    print(f"The hooks alone (a step's sequence, best of {args.rounds} rounds of "
          f"{args.repeat:,}):")
    print(f"  anchor (idle hooks):      {h_off * 1e6:8.2f} µs a step")
    print(f"  ours (recording):         {h_on * 1e6:8.2f} µs a step")
    record(f"  ours / anchor = {h_on / h_off:.2f}x; the measurement costs {cost * 1e6:.2f} µs "
           f"a step = {cost / STEP:.3%} of a {STEP * 1e3:.0f} ms step (target <= 1%) "
           f"{'ok' if cost / STEP <= 0.01 else 'MISSED'}",
           what=f"per-rank phases: the hooks' cost a step ({h_on * 1e6:.1f} µs recording, "
           f"{h_off * 1e6:.1f} µs idle)", ours=cost * 1e6, unit="µs",
           anchor=f"a {STEP * 1e3:.0f} ms step", anchor_value=STEP * 1e6,
           target="≤ 1% of the step", met=cost / STEP <= 0.01)


if __name__ == "__main__":
    main()
