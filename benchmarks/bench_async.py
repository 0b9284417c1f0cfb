"""One model trained asynchronously (``coord.async_model``) beside the synchronous gang
(``schedule_on_all`` + ``synced`` + ``allreduce_gradients`` with ``dd.collective.State``),
on the same data and workers, in one run.

Run: ``python benchmarks/bench_async.py [--workers 3] [--rows 60000] [--steps 50,10]``.

The gang trains one epoch; the asynchronous side then trains once per ``H`` of
``--steps`` (inner steps a round), each on the same data in the same seeded order, from
the same seeded initial weights as the gang: ``H`` trades bytes (a pull and a push a
round) for what a row teaches (rounds merged into one model learn less per row the
longer they are), and the figures show both ends. Both sides run ``--repeat`` times
(3); each figure is the run whose ratio is the median, every run's ratio printed
beside it: near its end the loss curve is flat and noisy, and one run says little.

Each inner step of a worker takes ``--step-ms`` (a ``sleep`` beside the real forward and
backward: an accelerator's step on this CPU-only machine); in the slow run one worker's
steps take ``--slowdown`` times as long. The gang runs at its slowest member's pace;
asynchronous rounds do not wait for anyone (dynamic local updates: the slow worker takes
fewer inner steps a round). Figures, each for the slow run and for the run with no slow
worker:

- time to the target loss (the evaluation set's MSE: ``--target``, by default the loss
  the gang ends its epoch at): asynchronous / gang (target with a worker 3x slower:
  <= 0.6x). The gang trains one epoch first; the asynchronous side then trains epoch
  after epoch until it reaches the target, for at most 3x the gang's time. Both curves
  are smoothed alike (the mean of the last 4 evaluations, about 1 s): the loss of one
  step is noisy near the inner optimizer's floor, and the first crossing of a noisy
  curve says more of the noise than of the training;
- the final loss after one epoch: asynchronous / gang (target <= 1.1x); the inner
  optimizer is AdamW on both sides (the gang's steps on averaged gradients). The outer
  step is FedAsync's ``Mixing()``: each push moves the model half of the way to its
  worker's weights (``2 / (N + 1)`` with N = 3 workers; a slow worker's shorter round
  less, by its inner steps), so a stale push does not overshoot where the versions
  since its pull already went (``--alpha`` sets another share; ``--outer delayed`` is
  ``DelayedNesterov(--outer-lr, --momentum)``). With a few dozen versions an epoch, an
  outer momentum amplifies stale deltas here; the papers' outer momentum pays over
  thousands of outer steps;
- bytes a worker moves per inner step: the gang's ring allreduce of the gradients
  (2 (N-1)/N of the model a step) / the asynchronous rounds' pull and push (twice the
  model a round of H steps) (target at H = 50: >= 20x; at a smaller H, context), and the
  scheduler's share of the asynchronous bytes (target < 1%).
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time

import numpy as np
from distributed import Client, LocalCluster
from figures import record

import daskdist as dd
from daskdist.cli import FEATURES, write_shards


def make_model(width: int):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 1))


class Factory:
    """The model, the inner optimizer, the per-step pause: the same on both sides."""

    def __init__(self, width: int, lr: float, step_s: float, slowdown: float) -> None:
        self.width, self.lr, self.step_s, self.slowdown = width, lr, step_s, slowdown

    def model(self):
        """The same initial weights on both sides and in every run (seed 0): the two
        sides' curves differ by how they train, not by where they start."""
        import torch

        with torch.random.fork_rng():
            torch.manual_seed(0)
            return make_model(self.width)

    def optimizer(self, params):
        import torch

        return torch.optim.AdamW(params, lr=self.lr)

    def pace(self) -> float:
        return self.step_s * (self.slowdown if dd.get_worker_context().worker_index == 0
                              else 1.0)


def mse(model, x, y) -> float:
    import torch

    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(torch.as_tensor(x)).squeeze(-1),
                                                  torch.as_tensor(y)))


def step(model, opt, batch) -> None:
    import torch

    loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
    opt.zero_grad()
    loss.backward()
    return loss


# -- asynchronous: rounds of H inner steps, nothing waits ---------------------------------
def local_round(replica, it, steps: int, f: Factory) -> dict:
    pace = f.pace()
    replica.pull()
    taken = 0
    for _ in range(replica.suggested_steps(steps)):
        batch = next(it, None)
        if batch is None:
            break
        step(replica.model, replica.optimizer, batch)
        replica.optimizer.step()
        time.sleep(pace)
        taken += 1
    if not taken:  # the epoch's tail: nothing learned, nothing to push
        return {"applied": False, "steps": 0}
    return {**replica.push(), "steps": taken}


def run_async(coord, ds, f: Factory, steps: int, ev, outer, target: float,
              cap: float, max_staleness: int) -> dict:
    """Rounds, two a worker in flight, epoch after epoch until the first epoch is done and
    the evaluation loss reached ``target``, or ``cap`` seconds passed; the loss at the end
    of the first epoch is its ``final``."""
    am = coord.async_model(model=f.model, optimizer=f.optimizer, outer=outer,
                           max_staleness=max_staleness)
    in_flight = 2 * coord.num_workers
    trace, taken, pending, ends = [], 0, [], []
    t0 = time.perf_counter()
    last_eval, epoch, first_epoch = 0.0, 0, None

    def finished() -> bool:
        if not trace:
            return False
        return trace[-1][0] > cap or (first_epoch is not None
                                      and not math.isnan(first_below(trace, target)))

    while not finished():
        ds.set_epoch(epoch)
        it = iter(ds)
        while not ds.progress(epoch)["complete"] and not finished():
            while len(pending) < in_flight:
                pending.append(coord.schedule(local_round, args=(am.replica, it, steps, f)))
            done = [rv for rv in pending if rv.done()]
            for rv in done:
                pending.remove(rv)
                taken += rv.fetch()["steps"]
            now = time.perf_counter()
            if now - last_eval > 0.25:
                last_eval = now
                trace.append((now - t0, evaluate(am.state_dict(), f, ev)))
            if not done:
                time.sleep(0.005)
        if ds.progress(epoch)["complete"]:
            trace.append((time.perf_counter() - t0, evaluate(am.state_dict(), f, ev)))
            ends.append(trace[-1][0])
            if first_epoch is None:  # every row of the epoch learned: its deltas applied
                first_epoch = trace[-1]
            epoch += 1
    seconds = time.perf_counter() - t0
    taken += sum(r["steps"] for r in coord.fetch(pending))
    report = am.report()
    moved = sum(w["bytes_per_round"] * w["rounds"] for w in report["workers"])
    if first_epoch is None:  # the cap came inside the first epoch
        first_epoch = (seconds, trace[-1][1])
    at = first_below(trace, target)
    return {"trace": trace, "final": first_epoch[1], "epoch_seconds": first_epoch[0],
            "seconds": seconds, "steps": taken,
            "epochs": 1 + sum(t < at for t in ends) if at == at else 1 + len(ends),
            "bytes_per_step": moved / max(1, taken), "report": report}


def evaluate(state: dict, f: Factory, ev) -> float:
    model = f.model()
    model.load_state_dict(state)
    return mse(model, *ev)


SMOOTH = 4  # evaluations (about 1 s of either side's training) a point of the curve spans


def smoothed(trace: list) -> list:
    """``(t, the mean of the losses of the last SMOOTH evaluations up to t)``: the loss
    at a step is noisy (each side sits at its inner AdamW's noise floor by the epoch's
    end), and where a noisy curve first crosses a level is a lottery; both sides'
    curves are compared smoothed alike."""
    out = []
    for i, (t, _) in enumerate(trace):
        window = trace[max(0, i - SMOOTH + 1):i + 1]
        out.append((t, sum(loss for _, loss in window) / len(window)))
    return out


def first_below(trace: list, target: float) -> float:
    return next((t for t, loss in smoothed(trace) if loss <= target), float("nan"))


# -- synchronous: the gang at its slowest member's pace --------------------------------------
def make_state(f: Factory):
    def build(ctx):
        model = f.model()
        return dd.collective.State(model=model, optimizer=f.optimizer(model.parameters()),
                                   step=0)
    return build


def gang_epoch(state, it, f: Factory, ev, t0: float, every: int) -> list:
    state.sync()
    g = dd.collective.get_group()
    pace = f.pace()
    trace = []
    for batch in dd.collective.synced(it):
        step(state.model, state.optimizer, batch)
        dd.collective.allreduce_gradients(state.model, average=True)
        state.optimizer.step()
        time.sleep(pace)
        state.step += 1
        if state.step % 10 == 0:
            state.commit()
        if g.rank == 0 and state.step % every == 0:
            trace.append((time.time() - t0, mse(state.model, *ev)))
    state.commit()
    if g.rank == 0:
        trace.append((time.time() - t0, mse(state.model, *ev)))
    return trace


def run_gang(coord, ds, f: Factory, ev) -> dict:
    coord.collective_group(backend="gloo", timeout=60)
    state = coord.create_per_worker_resource(make_state(f))
    it = iter(ds)
    t0 = time.time()
    trace: list = []
    while not ds.progress()["complete"]:
        out = coord.fetch(coord.schedule_on_all(gang_epoch, args=(state, it, f, ev, t0, 5)))
        trace += out[0]
    return {"trace": trace, "final": trace[-1][1], "seconds": time.time() - t0}


def first_batch(it) -> int:
    return len(next(it)["y"])


def warm(f: Factory) -> None:
    """A step of the model on a worker: its first optimizer imports what a step needs
    (seconds, once per process), before either side is timed (:func:`one_run` reads a
    batch on every worker too, for the data pipeline's imports)."""
    import torch

    model = f.model()
    opt = f.optimizer(model.parameters())
    model(torch.zeros(2, FEATURES)).sum().backward()
    opt.step()


def one_run(client, coord, data: str, args, slowdown: float) -> tuple[list, dict]:
    """The gang's epoch, then the asynchronous side at each ``H`` of ``--steps`` on the
    same data (the same seeded order), against the gang's target: ``([ours per H],
    theirs)``."""
    f = Factory(args.width, args.lr, args.step_ms / 1e3, slowdown)
    client.run(warm, f)
    warm_ds = coord.distribute_dataset(f"{data}/*.parquet", global_batch_size=args.workers,
                                       policy="dynamic")
    coord.fetch(coord.schedule_on_all(first_batch, args=(iter(warm_ds),)))
    rng = np.random.default_rng(1)
    w = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)
    x = rng.standard_normal((2000, FEATURES)).astype(np.float32)
    ev = (x, x @ w)  # the shards' own rule (write_shards, seed 0), new rows
    batch = args.batch_size * args.workers

    def outer():
        return {"delayed": lambda: dd.asynchronous.DelayedNesterov(lr=args.outer_lr,
                                                                 momentum=args.momentum),
                "nesterov": lambda: dd.asynchronous.Nesterov(lr=args.outer_lr,
                                                             momentum=args.momentum),
                "mixing": lambda: dd.asynchronous.Mixing(alpha=args.alpha),
                "average": dd.asynchronous.Average}[args.outer]()
    ds_gang = coord.distribute_dataset(f"{data}/*.parquet", global_batch_size=batch,
                                       policy="dynamic", shuffle=True, seed=2)
    theirs = run_gang(coord, ds_gang, f, ev)
    # the target: the given MSE, else the loss the gang ends its epoch at (its smoothed
    # curve's end); the asynchronous side trains until its smoothed curve reaches it, or
    # for 3x the gang's epoch at most
    target = args.target or smoothed(theirs["trace"])[-1][1]
    runs = []
    for steps in args.steps:
        ds_async = coord.distribute_dataset(f"{data}/*.parquet", global_batch_size=batch,
                                            policy="dynamic", shuffle=True, seed=2)
        runs.append(run_async(coord, ds_async, f, steps, ev, outer(), target,
                              cap=3 * theirs["seconds"], max_staleness=args.max_staleness))
        runs[-1]["H"] = steps
    for side in (*runs, theirs):
        side["target"] = target
        side["to_target"] = first_below(side["trace"], target)
    return runs, theirs


def took(ours: dict) -> float:
    """Seconds to the target; not reached within 3x the gang's epoch: that time, a bound
    the time is above."""
    return ours["seconds"] if math.isnan(ours["to_target"]) else ours["to_target"]


def median_pair(pairs: list, key) -> tuple[dict, dict, str]:
    """The ``(ours, theirs)`` of the run whose ratio ``key(ours, theirs)`` is the median
    (the middle one of an odd count, the upper of an even one), and every run's ratio
    in order, for the printed line."""
    ranked = sorted(pairs, key=lambda p: key(*p))
    ours, theirs = ranked[len(ranked) // 2]
    return ours, theirs, ", ".join(f"{key(*p):.2f}" for p in pairs)


def report(pairs: list, args, slowdown: float) -> None:
    """The three figures of one ``H`` against the gang, each from the run that is the
    median of ``--repeat`` runs for that figure (``pairs``: ``(ours, theirs)`` a run)."""
    H = pairs[0][0]["H"]
    runs = f"median of {len(pairs)} runs" if len(pairs) > 1 else "one run"
    slow = (f"one of {args.workers} workers {slowdown:g}x slower" if slowdown != 1
            else f"{args.workers} workers, none slower")
    size = f"H={H}, {args.rows:,} rows, {args.step_ms:g} ms steps, {runs}"
    goal = 0.6 if slowdown != 1 else None
    if any(math.isnan(theirs["to_target"]) for _, theirs in pairs):
        print(f"time to the target, {slow}, {size}: a --target the gang did not reach")
    else:
        ours, theirs, each = median_pair(pairs, lambda o, t: took(o) / t["to_target"])
        reached = not math.isnan(ours["to_target"])
        ratio = took(ours) / theirs["to_target"]
        record(f"time to MSE {ours['target']:.3g}, {slow}, H={H}: asynchronous "
               f"{took(ours):.2f} s in {ours['epochs']} epochs"
               f"{'' if reached else ' (not reached)'} | gang "
               f"{theirs['to_target']:.2f} s | ratio {ratio:.2f}x"
               + (f" (target <= {goal}x)" if goal else "") + f"; runs: {each}",
               what=f"time to the loss the gang ends its epoch at, {slow}, {size}"
                    + ("" if reached else " (not reached in 3x the gang's time)"),
               ours=took(ours), unit="s",
               anchor="the synchronous gang (`schedule_on_all` + `synced`)",
               anchor_value=theirs["to_target"], target=f"≤ {goal}x" if goal else None,
               met=reached and ratio <= goal if goal else None)
    ours, theirs, each = median_pair(pairs, lambda o, t: o["final"] / t["final"])
    final = ours["final"] / theirs["final"]
    record(f"final loss after an epoch, {slow}, H={H}: asynchronous "
           f"{ours['final']:.4f} ({ours['epoch_seconds']:.2f} s) | gang "
           f"{theirs['final']:.4f} ({theirs['seconds']:.2f} s) | "
           f"ratio {final:.2f}x (target <= 1.1x); runs: {each}",
           what=f"the loss after one epoch, {slow}, {size}", ours=ours["final"],
           unit="MSE", anchor="the synchronous gang", anchor_value=theirs["final"],
           target="≤ 1.1x", met=final <= 1.1)
    ours, _, each = median_pair(pairs, lambda o, t: o["bytes_per_step"])
    rep = ours["report"]
    n = args.workers
    gang_bytes = 2 * (n - 1) / n * rep["model_bytes"]
    fewer = gang_bytes / ours["bytes_per_step"]
    share = rep["scheduler_bytes_per_round"] / max(1.0, rep["bytes_per_round"])
    # the bytes target is set at H = 50; at another H the figure is context
    goal_bytes = H >= 50
    record(f"bytes a worker moves per inner step, {slow}, H={H}: asynchronous "
           f"{ours['bytes_per_step'] / 1e3:.1f} kB | gang's allreduce "
           f"{gang_bytes / 1e3:.1f} kB | {fewer:.1f}x fewer"
           + (" (target >= 20x)" if goal_bytes else "")
           + f"; through the scheduler {100 * share:.3f}% (target < 1%); staleness "
           f"median {rep['staleness']['median']:g}, {rep['refused']} refused",
           what=f"bytes per inner step, {slow}, H={H} "
                f"(scheduler {100 * share:.2f}% of them)",
           ours=ours["bytes_per_step"], unit="bytes",
           anchor="the gang's ring allreduce of the gradients", anchor_value=gang_bytes,
           target="≥ 20x fewer, < 1% via the scheduler" if goal_bytes else "< 1% via the "
                  "scheduler",
           met=fewer >= 20 and share < 0.01 if goal_bytes else share < 0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--files", type=int, default=16,
                    help="Parquet files (4 row groups each, the units leases cover)")
    ap.add_argument("--steps", type=lambda v: [int(h) for h in v.split(",")],
                    default=[50, 10], help="inner steps a round (H), comma-separated: "
                    "the asynchronous side runs once per H against one gang run")
    ap.add_argument("--step-ms", type=float, default=20.0, help="a fast worker's step")
    ap.add_argument("--slowdown", type=float, default=3.0)
    ap.add_argument("--width", type=int, default=256, help="hidden units (model size)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the inner AdamW's")
    ap.add_argument("--outer", choices=("mixing", "delayed", "nesterov", "average"),
                    default="mixing")
    ap.add_argument("--alpha", type=float, default=None,
                    help="Mixing's share (default 2 / (N + 1))")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--momentum", type=float, default=0.0,
                    help="the outer momentum (delayed, nesterov)")
    ap.add_argument("--max-staleness", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="runs of both sides; each "
                    "figure is the median run's (the loss near the end is noisy)")
    ap.add_argument("--only-slow", action="store_true", help="skip the run with no slow "
                    "worker")
    ap.add_argument("--target", type=float, default=0.0,
                    help="the target MSE (0: the loss the gang ends its epoch at)")
    args = ap.parse_args()

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client, name="bench-async")
        coord.wait_for_workers(args.workers, timeout=120)
        data = tempfile.mkdtemp(prefix="daskdist-bench-async-")
        write_shards(data, rows=args.rows, files=args.files)
        for slowdown in (args.slowdown,) if args.only_slow else (args.slowdown, 1.0):
            repeats = [one_run(client, coord, data, args, slowdown)
                       for _ in range(args.repeat)]
            for i in range(len(args.steps)):
                report([(runs[i], theirs) for runs, theirs in repeats], args, slowdown)
        coord.close()


if __name__ == "__main__":
    main()
