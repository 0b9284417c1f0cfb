"""The ``daskdist`` command: ``daskdist demo`` trains a small model; ``make-shards`` writes data.

The demo writes synthetic Parquet shards (or reads ``--data``), starts a ``LocalCluster``
with worker processes (or connects to ``--scheduler``), then trains a linear regression
two ways: asynchronously for ``--epochs`` epochs (one model, ``coord.async_model``:
closures pull it, train their worker's replica a few steps and push the difference; a
dynamic dataset: every row of every epoch learned exactly once, reported per epoch) and
synchronously (a gloo collective group, gang closures, averaged gradients, elastic
state). ``--kill`` SIGKILLs a worker mid-epoch to show recovery (and rank 0 of the group
in the synchronous phase). Bad input is one line
on stderr and exit status 2, before anything is created; Ctrl-C closes the cluster and
exits with status 130 (:class:`Interrupt`: never a hang). Nothing in the library imports
this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

FEATURES = 16


def write_shards(root: Path | str, rows: int, files: int, seed: int = 0) -> np.ndarray:
    """Synthetic regression shards: y = X @ w + noise. Returns the true weights."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(FEATURES).astype(np.float32)
    per_file = rows // files
    for f in range(files):
        x = rng.standard_normal((per_file, FEATURES)).astype(np.float32)
        y = x @ w + 0.01 * rng.standard_normal(per_file).astype(np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES)
        pq.write_table(pa.table({"x": features, "y": y}), root / f"part-{f:03d}.parquet",
                       row_group_size=max(1, per_file // 4))
    return w


def make_model():
    import torch

    return torch.nn.Linear(FEATURES, 1)


def make_optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=0.05)


def async_round(replica, iterator, steps, pace: float = 0.0):
    """One round of the global model: pull it, up to ``steps`` SGD steps on this
    worker's replica (each followed by ``pace`` seconds: the rest of a step on a slower
    accelerator, in examples), push the difference; the round's losses and the push's
    outcome."""
    import torch

    replica.pull()
    losses = []
    for _ in range(steps):
        batch = next(iterator, None)
        if batch is None:
            break
        loss = torch.nn.functional.mse_loss(replica.model(batch["x"]).squeeze(-1),
                                            batch["y"])
        replica.optimizer.zero_grad()
        loss.backward()
        replica.optimizer.step()
        losses.append(loss.item())
        if pace:
            time.sleep(pace)
    return losses, replica.push()


def make_state(ctx):
    import torch

    import daskdist as dd

    torch.manual_seed(ctx.worker_index)
    model = torch.nn.Linear(FEATURES, 1).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return dd.collective.State(model=model, optimizer=opt, step=0, rows=0)


def sync_steps(state, iterator, steps):
    """Data-parallel SGD on the group: averaged gradients, a commit every step.

    ``sync()`` starts every rank from the newest commit (a fresh replacement never
    overwrites the survivors); each ``commit()`` acknowledges the step's rows, so the
    committed model trains on every row exactly once across kills; ``synced`` ends all
    ranks at the same step when a rank's iterator runs dry.
    """
    import torch

    import daskdist as dd

    state.sync()
    g = dd.collective.get_group()
    losses, rows = [], 0
    for batch in dd.collective.synced(iterator):
        n = len(batch["y"])
        pred = state.model(batch["x"]).squeeze(-1)
        loss = (pred - batch["y"]).pow(2).sum() / max(1, n)  # finite on an empty tail batch
        state.optimizer.zero_grad()
        loss.backward()
        dd.collective.allreduce_gradients(state.model, average=True)
        state.optimizer.step()
        state.step += 1
        total = torch.tensor([n], device=g.device)
        g.allreduce(total)
        state.rows += int(total.item())  # rows in the model (every rank's): committed with it
        state.commit()
        losses.append(loss.item())
        rows += n
        if len(losses) >= steps:
            break
    return losses, rows, g.generation, state.rows


def rank0_pid(coord, client) -> int | None:
    """The process id of rank 0 of the coordinator's collective group."""
    members = coord._call("daskdist_group_info")["members"]
    if not members:
        return None
    pid = client.run(os.getpid, workers=[members[0]], on_error="ignore").get(members[0])
    return pid if isinstance(pid, int) else None


def sync_phase(coord, client, shards, args) -> tuple[list, int, float]:
    """Synchronous training until every row of an epoch is committed exactly once.

    The driver loops gang closures until the dynamic dataset's epoch is complete;
    ``--kill`` SIGKILLs rank 0 of the group (the member every other rank synced from
    before) once a third of the rows are trained. ``--steps`` is the steps per gang
    closure.
    """
    from tqdm.auto import tqdm

    coord.wait_for_workers(args.workers, timeout=120)  # a killed worker is back
    group = coord.collective_group(backend="auto", timeout=60)
    print(f"group     {group.backend} world_size={group.world_size} "
          f"generation={group.generation}")
    state = coord.create_per_worker_resource(make_state)
    sync_ds = coord.distribute_dataset(shards, global_batch_size=args.batch_size * args.workers,
                                       shuffle=True, seed=1, policy="dynamic", name="sync")
    sync_it = iter(sync_ds)
    t = time.perf_counter()
    sync_losses, killed, in_model = [], None, 0
    with tqdm(total=shards.num_rows, desc="sync", unit="row", unit_scale=True) as bar:
        done = 0
        while not (p := sync_ds.progress())["complete"]:
            INTERRUPT.check()
            bar.update(p["acknowledged"] - done)
            done = p["acknowledged"]
            gang = coord.schedule_on_all(sync_steps, args=(state, sync_it, args.steps))
            if args.kill and killed is None and done > shards.num_rows // 3:
                killed = rank0_pid(coord, client)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
                    bar.write(f"killed    rank 0 (pid {killed}, SIGKILL); survivors go on "
                              "from the last commit")
            out = coord.fetch(gang)
            sync_losses += out[0][0]
            in_model = out[0][3]
        bar.update(p["acknowledged"] - done)
    seconds = time.perf_counter() - t
    once = ("each exactly once" if p["acknowledged"] == p["total"] == in_model
            else "MISMATCH")
    print(f"sync      {in_model:,} rows in the committed model ({once}: "
          f"{p['acknowledged']:,} acknowledged of {p['total']:,}) in {seconds:.1f} s; "
          f"generation {coord.status()['group_generation']}")
    return sync_losses, p["acknowledged"], seconds


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class Interrupt:
    """Ctrl-C that always stops the demo, in two parts.

    Python raises ``KeyboardInterrupt`` wherever the main thread is; raised inside a
    finalizer or a ``__del__`` (the demo drops a dataset iterator every epoch, whose
    finalizer releases it) it is only printed, and the demo trained on: the Ctrl-C test
    then waited its full 90 s. So the handler raises it as Python does *and* remembers
    it, and the demo's loops raise it again at their next step (:meth:`check`).
    Closing the coordinator and the cluster is bounded (the coordinator's detach, the
    nannies' kill), but so that nothing can hold the exit, a watchdog thread ends the
    process (its worker processes first) ``daskdist.demo.stop-timeout`` after the
    Ctrl-C, and a second Ctrl-C does so at once.
    """

    def __init__(self) -> None:
        self.at: float | None = None

    def install(self) -> object:
        """Handle SIGINT (main thread only); the handler it replaces."""
        self.at = None
        return signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.at is not None:
            self._force("a second Ctrl-C")
        self.at = time.monotonic()
        threading.Thread(target=self._watch, name="daskdist-stop-watchdog",
                         daemon=True).start()
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise the Ctrl-C again if it was swallowed (see the class doc)."""
        if self.at is not None:
            raise KeyboardInterrupt

    def _watch(self) -> None:
        from daskdist import config

        limit = config.seconds("demo.stop-timeout")
        threading.Event().wait(limit)  # a deadline: the exit normally comes first
        self._force(f"the cluster did not close within {limit:g} s")

    @staticmethod
    def _force(why: str) -> None:
        """End the worker processes (children of this one) and exit with 130."""
        import psutil  # a dependency of distributed

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
        print(f"daskdist: interrupted ({why}: stopped at once)", file=sys.stderr, flush=True)
        os._exit(130)


INTERRUPT = Interrupt()


async def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_one_worker(client) -> str:
    """SIGKILL the process of one worker (its nanny starts a new one); its address."""
    address = sorted(client.scheduler_info(n_workers=-1)["workers"])[-1]
    client.run(_sigkill_self, workers=[address], on_error="ignore", wait=False)
    return address


def find_shards(data: str):
    """``ArrowShards`` of the Parquet files in ``data`` (UsageError when none)."""
    import daskdist as dd

    path = Path(data)
    if not path.is_dir():
        raise UsageError(f"--data {data}: no such directory")
    if not any(path.glob("*.parquet")):
        raise UsageError(f"--data {data}: no *.parquet shards in it "
                         "(write some with: daskdist make-shards DIR)")
    return dd.data.ArrowShards(str(path / "*.parquet"))


def _sigint_plugin():
    """The demo's worker plugin (``distributed`` imported only when the demo runs)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class LeaveCtrlCToTheDemo(WorkerPlugin):
        """A worker plugin of the demo's own LocalCluster: its worker processes ignore
        SIGINT. A Ctrl-C in a terminal goes to the whole foreground process group, the
        worker processes included: each died at once with a KeyboardInterrupt traceback,
        and its nanny (in the demo's process) started a new one in the middle of the
        stop. The demo closes them itself, gracefully (its watchdog ends them if that
        takes too long)."""

        name = "daskdist-demo-sigint"
        idempotent = True

        def setup(self, worker) -> None:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)

    return LeaveCtrlCToTheDemo()


def connect(args: argparse.Namespace, stack: ExitStack):
    """A Client of ``--scheduler`` (UsageError when unreachable) or of a new LocalCluster."""
    from distributed import Client, LocalCluster

    if args.scheduler:
        try:
            return stack.enter_context(Client(args.scheduler, timeout="5s"))
        except (OSError, TimeoutError, ValueError) as e:
            raise UsageError(f"--scheduler {args.scheduler}: cannot connect "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    cluster = stack.enter_context(LocalCluster(
        n_workers=args.workers, threads_per_worker=1, processes=True,
        dashboard_address=args.dashboard, silence_logs=logging.ERROR))
    client = stack.enter_context(Client(cluster))
    client.register_plugin(_sigint_plugin())
    return client


def async_epoch(coord, client, ds, am, epoch: int, kill: bool) -> None:
    """One epoch of the one global model, until every row is acknowledged; one line."""
    from tqdm.auto import tqdm

    ds.set_epoch(epoch)
    it = iter(ds)
    total = ds.progress()["total"]
    before = am.report()
    losses, pushed, killed = [], 0, None
    t = time.perf_counter()
    with tqdm(total=total, desc=f"epoch {epoch}", unit="row", unit_scale=True,
              leave=False) as bar:
        while not ds.progress()["complete"]:
            INTERRUPT.check()
            rvs = [coord.schedule(async_round, args=(am.replica, it, 4)) for _ in range(8)]
            if kill and killed is None and pushed > total // 3:
                killed = kill_one_worker(client)
                bar.write(f"killed    worker {killed} (SIGKILL); its work re-runs")
            for round_losses, out in coord.fetch(rvs):
                losses += round_losses
                if out["applied"]:
                    pushed += out["rows"]
                    bar.update(out["rows"])
    while am.report()["open_pushes"]:  # the last deltas: durable at the standby's copy
        INTERRUPT.check()
        time.sleep(0.05)
    after = am.report()
    rows = (after["rows"] - after["rows_lost"]) - (before["rows"] - before["rows_lost"])
    p = ds.progress()
    once = "each exactly once" if rows == p["acknowledged"] == p["total"] else "MISMATCH"
    print(f"epoch {epoch}   {rows:,} rows ({once}: {p['acknowledged']:,} acknowledged of "
          f"{p['total']:,}) in {time.perf_counter() - t:.1f} s; one model, version "
          f"{after['version']}; loss {losses[0]:.3f} -> {np.mean(losses[-8:]):.4f}",
          flush=True)
    if once == "MISMATCH":
        raise RuntimeError(f"epoch {epoch}: {rows} rows in the model, {p} acknowledged")


def demo(args: argparse.Namespace) -> int:
    import daskdist as dd

    shards = find_shards(args.data) if args.data else None  # bad input: before any work
    with ExitStack() as stack:
        t0 = time.perf_counter()
        client = connect(args, stack)
        if shards is None:
            data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="daskdist-")))
            write_shards(data, args.rows, args.files)
            shards = dd.data.ArrowShards(str(data / "*.parquet"))
        print(f"data      {shards.num_rows:,} rows in {len(shards.units)} units "
              f"({shards.pattern})", flush=True)
        coord = stack.enter_context(dd.Coordinator(client, name="demo"))
        try:
            coord.wait_for_workers(args.workers, timeout=args.wait)
        except TimeoutError as e:
            raise UsageError(f"--workers {args.workers}: {e}") from None
        print(f"cluster   {args.workers} workers ready in {time.perf_counter() - t0:.1f} s"
              + (f"; dashboard {client.dashboard_link}" if args.dashboard else ""), flush=True)

        # -- asynchronous training: one model, any worker's rounds update it -------------
        am = coord.async_model(model=make_model, optimizer=make_optimizer,
                               outer=dd.asynchronous.Average())
        ds = coord.distribute_dataset(shards, global_batch_size=args.batch_size * args.workers,
                                      shuffle=True, seed=0, policy="dynamic", name="async")
        for epoch in range(args.epochs):
            async_epoch(coord, client, ds, am, epoch,
                        kill=args.kill and epoch == args.epochs // 2)

        # -- synchronous training: a gloo group, gang closures, elastic state -----------
        if args.steps:
            sync_losses, sync_rows, sync_seconds = sync_phase(coord, client, shards, args)
            print(f"sync      {len(sync_losses)} steps, {sync_rows:,} rows in "
                  f"{sync_seconds:.1f} s; loss {sync_losses[0]:.3f} -> "
                  f"{np.mean(sync_losses[-5:]):.4f}", flush=True)
        status = coord.status()
        print(f"summary   closures done={status['done']} retried={status['retried']} "
              f"recoveries={status['recoveries']} failed={status['failed']} "
              f"workers={status['workers']} total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def make_shards(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.glob("*.parquet"))):
        raise UsageError(f"{out}: exists and is not an empty directory of shards")
    if args.files > args.rows:
        raise UsageError(f"--files {args.files}: more files than --rows {args.rows}")
    out.mkdir(parents=True, exist_ok=True)
    write_shards(out, args.rows, args.files)
    print(f"wrote {args.rows // args.files * args.files:,} rows in {args.files} files to {out}")
    return 0


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not positive")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block): ``daskdist: error: ...``."""

    def error(self, message: str):
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="daskdist", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    d = sub.add_parser("demo", help="train a small model on an embedded LocalCluster")
    d.add_argument("--epochs", type=positive_int, default=2,
                   help="asynchronous epochs, each row exactly once per epoch")
    d.add_argument("--workers", type=positive_int, default=2,
                   help="workers to start (with --scheduler: to wait for)")
    d.add_argument("--rows", type=positive_int, default=200_000, help="synthetic rows")
    d.add_argument("--files", type=positive_int, default=8, help="synthetic shard files")
    d.add_argument("--batch-size", type=positive_int, default=256, help="per-worker batch size")
    d.add_argument("--steps", type=int, default=20,
                   help="synchronous steps per gang closure (0: no synchronous phase)")
    d.add_argument("--data", default=None,
                   help="an existing directory of *.parquet shards (default: synthetic)")
    d.add_argument("--scheduler", default=None,
                   help="address of a running scheduler (default: an embedded LocalCluster)")
    d.add_argument("--dashboard", default=None, metavar="ADDRESS",
                   help="serve the embedded cluster's dashboard here, e.g. :8787")
    d.add_argument("--wait", type=positive_int, default=120,
                   help="seconds to wait for --workers workers to join")
    d.add_argument("--kill", action="store_true", help="SIGKILL a worker mid-epoch")
    m = sub.add_parser("make-shards", help="write synthetic Parquet shards for the demo")
    m.add_argument("out", help="directory to create")
    m.add_argument("--rows", type=positive_int, default=200_000)
    m.add_argument("--files", type=positive_int, default=8)
    return p


def main(argv: list[str] | None = None) -> int:
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = INTERRUPT.install()
    try:
        args = parser().parse_args(argv)
        if args.command == "demo" and args.steps < 0:
            raise UsageError(f"argument --steps: {args.steps} is negative")
        return demo(args) if args.command == "demo" else make_shards(args)
    except UsageError as e:
        print(f"daskdist: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the ExitStack closed the coordinator and the cluster
        print("daskdist: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def run() -> None:
    """The ``daskdist`` command (and ``python -m daskdist.cli``): :func:`main`, then exit.

    After a Ctrl-C everything is closed (the cluster, its worker processes, the
    synthetic shards), so the process ends at once instead of tearing down every module
    torch imported, which took 1.4-3 s more on a loaded machine."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
