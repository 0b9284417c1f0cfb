"""DaskdistStrategy (SPEC §4.4) on real LocalClusters with worker processes and gloo:
Trainer.fit over a "dynamic" dataset trains every row exactly once in the committed
module; a member SIGKILLed mid-fit (3 workers) re-runs fit from the committed
global_step on every rank; a worker that joins mid-fit is taken in at the next commit;
running the same cell 5 times leaves worker memory and threads flat."""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from distributed import Client  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist.integrations.lightning import DaskdistStrategy  # noqa: E402
from tests.conftest import (  # noqa: E402
    THREADS,
    make_cluster,
    sigkill,
    wait_for_workers,
    wait_until,
)
from tests.framework_rows import (  # noqa: E402
    committed_counts,
    count_ids,
    log_event,
    read_events,
    write_rows,
)
from tests.row_ledger import assert_every_row_once  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


class RowModule(L.LightningModule):
    """y = 2x + 1 with a counts buffer: every step adds the ids the ranks trained on."""

    def __init__(self, n: int, logdir: str | None = None, pause: float = 0.0):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.register_buffer("counts", torch.zeros(n, dtype=torch.float64))
        self.logdir = logdir
        self.pause = pause

    def training_step(self, batch, batch_idx):
        count_ids(self.counts, batch["id"])
        n = len(batch["id"])
        pred = self.net(batch["x"].unsqueeze(-1)).squeeze(-1)
        time.sleep(self.pause)
        return (pred - batch["y"]).pow(2).sum() / max(1, n)  # a rank may get 0 rows

    def on_train_start(self):
        log_event(self.logdir, "start", self.trainer.global_step)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        log_event(self.logdir, "step", self.trainer.global_step)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def make_module(ctx, n, logdir=None, pause=0.0):
    torch.manual_seed(100 + ctx.worker_index)  # fresh replicas differ: sync() must fix it
    return RowModule(n, logdir, pause)


def fit(module, it, commit_every=1):
    """The SPEC's gang closure: a plain Trainer.fit over the per-worker batches."""
    trainer = L.Trainer(strategy=DaskdistStrategy(commit_every=commit_every), max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, train_dataloaders=dd.collective.synced(it))
    return dd.collective.get_group().rank, trainer.global_step


def drive(coord, ds, module, it, commit_every=1, deadline=240.0):
    """The driver's loop: fit until every row of the epoch is acknowledged."""
    end = time.monotonic() + deadline
    runs = []
    while not ds.progress()["complete"]:
        assert time.monotonic() < end, ds.progress()
        runs.append(coord.fetch(coord.schedule_on_all(fit, args=(module, it, commit_every))))
    return runs


def _members(coord) -> list[str]:
    return coord._call("daskdist_group_info")["members"]


@pytest.mark.parametrize("threads", THREADS)
def test_fit_over_a_dynamic_dataset_trains_every_row_once(tmp_path, threads):
    n = 2000
    glob = write_rows(tmp_path, n)
    with make_cluster(2, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-once")
        wait_for_workers(client, coord, 2)
        coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(functools.partial(make_module, n=n))
        ds = coord.distribute_dataset(glob, global_batch_size=40, policy="dynamic",
                                      shuffle=True, seed=1, prefetch=0)
        it = iter(ds)
        runs = drive(coord, ds, module, it, commit_every=3)
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        steps = [s for s, _ in out]
        assert len(set(steps)) == 1 and steps[0] == runs[-1][0][1] > 0
        assert_every_row_once(out, n)
        assert ds.progress()["acknowledged"] == n
        coord.close()


def test_member_sigkilled_mid_fit_resumes_from_the_committed_step(tmp_path):
    n = 3000
    glob = write_rows(tmp_path, n)
    logdir = tmp_path / "log"
    logdir.mkdir()
    with make_cluster(3) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-kill")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(
            functools.partial(make_module, n=n, logdir=str(logdir), pause=0.02))
        ds = coord.distribute_dataset(glob, global_batch_size=30, policy="dynamic",
                                      shuffle=True, seed=2, prefetch=0)
        it = iter(ds)
        killed: list[tuple[float, int]] = []

        def kill_rank0_mid_fit():
            wait_until(lambda: sum(e[1] == "step" for e in read_events(logdir)) > 15,
                       120, "steps")
            addr = _members(coord)[0]  # rank 0: the rank whose state DDP broadcasts
            pid = client.run(os.getpid, workers=[addr])[addr]
            killed.append((time.time(), pid))
            sigkill(pid)

        killer = threading.Thread(target=kill_rank0_mid_fit, daemon=True)
        killer.start()
        drive(coord, ds, module, it)
        killer.join(60)
        assert killed, "the member was not killed"
        t_kill, victim = killed[0]
        events = read_events(logdir)
        committed = max(e[2] for e in events if e[1] == "step" and e[0] < t_kill)
        starts = [e for e in events if e[1] == "start" and e[0] > t_kill]
        assert starts, "fit did not run again after the kill"
        first_gen = min(e[3] for e in starts)
        rerun = [e for e in starts if e[3] == first_gen]
        assert len({e[4] for e in rerun}) == rerun[0][5]  # every rank of it started ...
        assert {e[2] for e in rerun} == {rerun[0][2]}  # ... at the same step ...
        assert committed - 1 <= rerun[0][2] <= committed and rerun[0][2] > 0  # ... committed
        assert victim not in {e[6] for e in rerun}
        print(f"killed rank 0 after step {committed}; fit ran again on "
              f"{rerun[0][5]} ranks from global_step {rerun[0][2]}")
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        assert_every_row_once(out, n)
        coord.close()


def test_worker_joining_mid_fit_is_taken_in_at_the_next_commit(tmp_path):
    n = 4000
    glob = write_rows(tmp_path, n)
    logdir = tmp_path / "log"
    logdir.mkdir()
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-join")
        wait_for_workers(client, coord, 2)
        first = coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(
            functools.partial(make_module, n=n, logdir=str(logdir), pause=0.02))
        ds = coord.distribute_dataset(glob, global_batch_size=24, policy="dynamic",
                                      shuffle=True, seed=3, prefetch=0)
        it = iter(ds)
        gang = coord.schedule_on_all(fit, args=(module, it, 2))
        wait_until(lambda: any(e[1] == "step" for e in read_events(logdir)), 120, "steps")
        cluster.scale(3)
        coord.fetch(gang)
        events = read_events(logdir)
        grown = [e for e in events if e[1] == "start" and e[5] == 3]
        assert grown, "the newcomer never trained"
        assert all(e[3] > first.generation for e in grown)
        # the 2 members' last step ended in the commit that raised HostsUpdatedInterrupt
        # (before the module's own batch-end hook logged it); the 3 members began there
        last = max(e[2] for e in events if e[1] == "step" and e[5] == 2) + 1
        assert {e[2] for e in grown} == {last}
        assert last % 2 == 0  # commit_every=2: the join waited for a commit
        print(f"joined at the commit of step {last}")
        drive(coord, ds, module, it, commit_every=2)
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        assert len(out) == 3
        assert_every_row_once(out, n)
        coord.close()


def test_sigterm_notice_mid_fit_leaves_at_a_commit(tmp_path):
    """Daskdist's SIGTERM handler (Lightning's own is installed on the main thread
    only): the member leaves at its next commit, nothing counts as lost, every row once."""
    import signal

    import dask

    n = 3000
    glob = write_rows(tmp_path, n)
    logdir = tmp_path / "log"
    logdir.mkdir()
    with dask.config.set({"daskdist.preemption.grace": "20s"}), \
            make_cluster(3) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-sigterm")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=30)
        module = coord.create_per_worker_resource(
            functools.partial(make_module, n=n, logdir=str(logdir), pause=0.02))
        ds = coord.distribute_dataset(glob, global_batch_size=30, policy="dynamic",
                                      shuffle=True, seed=8, prefetch=0)
        it = iter(ds)
        noticed: list[int] = []

        def notice():
            wait_until(lambda: sum(e[1] == "step" for e in read_events(logdir)) > 15,
                       120, "steps")
            addr = _members(coord)[0]
            pid = client.run(os.getpid, workers=[addr])[addr]
            noticed.append(pid)
            os.kill(pid, signal.SIGTERM)

        t = threading.Thread(target=notice, daemon=True)
        t.start()
        drive(coord, ds, module, it, commit_every=2)
        t.join(60)
        assert noticed
        status = coord.status()
        assert status["workers_lost"] == 0 and status["failed"] == 0, status
        wait_until(lambda: noticed[0] not in client.run(os.getpid).values(), 30,
                   "the notified worker to leave")
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
        assert len(out) == 2
        assert_every_row_once(out, n)
        coord.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fit_with_nccl_on_the_workers_gpu(tmp_path):
    """One worker on its GPU, an NCCL group: the module, the batches and the group's
    calls on cuda:0, every row once (a second GPU is not needed for the device path)."""
    n = 1000
    glob = write_rows(tmp_path, n)
    with make_cluster(1) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-nccl")
        wait_for_workers(client, coord, 1)
        assert coord.collective_group(backend="nccl", timeout=60).backend == "nccl"
        module = coord.create_per_worker_resource(functools.partial(make_module, n=n))
        ds = coord.distribute_dataset(glob, global_batch_size=50, policy="dynamic",
                                      shuffle=True, seed=9)
        drive(coord, ds, module, iter(ds), commit_every=2)
        assert_every_row_once(coord.fetch(coord.schedule_on_all(committed_counts,
                                                                args=(module,))), n)
        coord.close()


def _rss_and_threads() -> tuple[int, list[str]]:
    import psutil

    return psutil.Process().memory_info().rss, sorted(t.name for t in threading.enumerate())


def test_running_the_cell_five_times_leaves_memory_and_threads_flat(tmp_path):
    n = 1000
    glob = write_rows(tmp_path, n)
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="lightning-cells")
        wait_for_workers(client, coord, 2)
        coord.collective_group(timeout=30)
        samples = []
        for _ in range(5):  # the notebook cell: a module, a dataset, the driver's loop
            module = coord.create_per_worker_resource(functools.partial(make_module, n=n))
            ds = coord.distribute_dataset(glob, global_batch_size=40, policy="dynamic",
                                          shuffle=True, seed=4)
            it = iter(ds)
            drive(coord, ds, module, it)
            out = coord.fetch(coord.schedule_on_all(committed_counts, args=(module,)))
            assert_every_row_once(out, n)
            del module, ds, it
            samples.append(client.run(_rss_and_threads))
        for addr in samples[0]:
            rss = [s[addr][0] for s in samples]
            threads = [s[addr][1] for s in samples]
            print(f"{addr}: RSS after each cell {[r // 2**20 for r in rss]} MB, "
                  f"threads {[len(t) for t in threads]}")
            # after the first cell (imports, first allocations), flat: the last cell's
            # RSS within 30 MB of the second's, and the same threads every time
            assert rss[-1] - rss[1] < 30 * 2**20, [r // 2**20 for r in rss]
            assert threads[-1] == threads[1], (threads[1], threads[-1])
        coord.close()
