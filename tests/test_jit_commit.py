"""The just-in-time commit (SPEC §4.6), on a real LocalCluster of 3 workers x 2 threads
training the row ledger (a State with ``checkpoint_to``, never due: ``every`` is far).

- A member that is not the writer gets a deadline (``notify_preemption``): the commit
  is written durably before the deadline (rank 0 writes it), the member leaves the
  group at that commit and the gang goes on without it (the worker itself stays,
  showing its deadline in ``status()``). The checkpoint holds the commit that decided
  the leave, the one the survivors resume at, with its rows in its ledger.
- Then the writer itself gets a deadline while its write is slow, and is SIGKILLed
  mid-write: the survivor re-forms as on a loss and commits again before the deadline
  (it never waited on the leaving member's write past it), the cut-off checkpoint is
  never loaded, and the epoch still trains every row exactly once.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import dask
import pytest
import torch
from distributed import Client

import daskdist as dd
from tests.checkpoint_job import BATCH, N_ROWS, final_counts, train_rows
from tests.conftest import make_cluster, wait_for_workers, wait_until
from tests.row_ledger import assert_every_row_once
from tests.test_checkpoint import complete, write_rows

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]


class SlowToSave:
    """A committed object whose checkpoint write (pickled in the checkpoint store's
    thread) is slow once ``arm`` exists: it creates ``saving`` and sleeps, so the test
    can kill the writer mid-write. Copies and broadcasts of it are instant."""

    def __init__(self, arm: str, saving: str) -> None:
        self.arm, self.saving = arm, saving

    def __deepcopy__(self, memo: dict) -> SlowToSave:
        return self

    def __reduce__(self):
        if (os.path.exists(self.arm)
                and threading.current_thread().name.startswith("daskdist-ckpt")):
            with open(self.saving, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)
        return (SlowToSave, (self.arm, self.saving))


class MakeSlowCounts:
    """The row ledger State with a :class:`SlowToSave`, checkpointed only just in time."""

    def __init__(self, url: str, arm: str, saving: str) -> None:
        self.url, self.arm, self.saving = url, arm, saving

    def __call__(self, ctx):
        return dd.collective.State(counts=torch.zeros(N_ROWS, dtype=torch.float64),
                                   slow=SlowToSave(self.arm, self.saving)).checkpoint_to(
            self.url, every=10**6)


def rows_held_and_acknowledged(url, commits: int) -> tuple[int, int]:
    """Checkpoint ``commits``'s rows: those its State trained (its ``counts``) and those
    its ledger says the scheduler acknowledged. A resume trains every row once only when
    they are the same."""
    from daskdist.collective.state.checkpoint import Durable

    _, objects, record = Durable(str(url), every=1).load(commits, None)
    trained = int(torch.as_tensor(objects["counts"]).sum())
    (ledger,) = record["ledger"].values()
    return trained, sum(hi - lo for lo, hi in ledger["acknowledged"])


def train_logged(state, it, pause: float, log: str):
    """:func:`train_rows`, each ``sync`` first (a closure's start, every re-formation's
    re-run) logged to ``log`` as ``<time> <commits resumed at> <rank>``."""
    g = dd.collective.get_group()
    state.sync()
    with open(log, "a") as f:
        f.write(f"{time.time()} {state.commits} {g.rank}\n")
    return train_rows(state, it, pause)


def resumed_after(log, t0: float, t1: float) -> list[int]:
    """The commits the members resumed at between ``t0`` and ``t1``, in time order."""
    rows = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    return [int(c) for t, c, _ in rows if t0 < t < t1]


def _members(coord) -> list[str]:
    return coord._call("daskdist_group_info")["members"]


@pytest.mark.slow
def test_a_deadline_commits_just_in_time_and_survivors_never_wait_past_it(tmp_path):
    data = write_rows(tmp_path / "shards")
    url, arm, saving = tmp_path / "ckpt", tmp_path / "arm", tmp_path / "saving"
    log = tmp_path / "resumed"
    log.touch()
    with dask.config.set({"daskdist.preemption.margin": "1s"}), \
            make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="jit")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=60)
        state = coord.create_per_worker_resource(MakeSlowCounts(str(url), str(arm),
                                                                str(saving)))
        ds = coord.distribute_dataset(data, global_batch_size=BATCH, policy="dynamic",
                                      shuffle=True, seed=3, prefetch=0, name="train")
        it = iter(ds)
        seen: dict = {}

        def acked() -> int:
            return ds.progress()["acknowledged"]

        def preempt() -> None:
            wait_until(lambda: acked() >= N_ROWS // 6 and len(_members(coord)) == 3, 120,
                       "a sixth of the epoch on 3 members")
            # 1. rank 1 (rank 0 writes): written before its deadline, the gang goes on
            leaving = _members(coord)[1]
            seen["noticed"] = time.time()
            seen["first_deadline"] = time.time() + 30
            coord.notify_preemption(leaving, seen["first_deadline"])
            seen["first"] = wait_until(lambda: complete(url), 30, "a just-in-time checkpoint")
            seen["first_written"] = max(
                (url / f"commit-{c:012d}" / ".metadata").stat().st_mtime
                for c in seen["first"])
            wait_until(lambda: len(_members(coord)) == 2 and leaving not in _members(coord),
                       30, "the group re-formed without the member")
            before = acked()
            wait_until(lambda: acked() > before, 30, "a commit of the group without it")
            seen["leaving"] = leaving
            seen["status"] = coord.status()
            # 2. the writer itself, its write slow: SIGKILLed in the middle of it
            arm.touch()
            writer = _members(coord)[0]
            pid = client.run(os.getpid, workers=[writer])[writer]
            seen["deadline"] = time.time() + 25
            coord.notify_preemption(writer, seen["deadline"])
            wait_until(saving.exists, 25, "the writer writing its just-in-time checkpoint")
            os.kill(pid, signal.SIGKILL)
            seen["killed"] = time.time()
            before = acked()
            wait_until(lambda: acked() > before or ds.progress()["complete"], 25,
                       "the survivor's next committed step")
            seen["resumed"] = time.time()

        t = threading.Thread(target=preempt, daemon=True)
        t.start()
        deadline = time.monotonic() + 200
        runs = []
        while not ds.progress()["complete"]:
            assert time.monotonic() < deadline, (ds.progress(), seen)
            runs.append(coord.fetch(coord.schedule_on_all(train_logged,
                                                          args=(state, it, 0.05, str(log)))))
        t.join(60)
        assert "resumed" in seen, seen
        # 1: written while the member had its deadline ahead; it left, the others went on
        assert seen["first_written"] < seen["first_deadline"]
        assert seen["first"][-1] > 0
        # it holds the commit whose rows were acknowledged as the member left, the one
        # the commit that decided the leave sent included
        trained, acknowledged = rows_held_and_acknowledged(url, seen["first"][-1])
        assert trained == acknowledged == seen["first"][-1] * BATCH, (trained, acknowledged)
        # the commit whose flag decided the leave is the one the survivors resume at when
        # they re-form without the member: the just-in-time checkpoint holds that one, not
        # the one before it (the writer settles the commit in flight before writing)
        after = resumed_after(log, seen["noticed"], seen["killed"])
        assert after and after[0] == seen["first"][-1], (after, seen["first"])
        notices = {p["worker"]: p for p in seen["status"]["preemptions"]}
        assert notices[seen["leaving"]]["deadline"] == pytest.approx(seen["first_deadline"])
        assert notices[seen["leaving"]]["reason"] == "notify_preemption"
        assert seen["leaving"] in client.scheduler_info()["workers"]  # it was not killed
        # 2: the survivor committed again before the killed writer's deadline
        assert seen["resumed"] < seen["deadline"], seen
        print(f"kill mid-write -> the survivor's next commit: "
              f"{seen['resumed'] - seen['killed']:.2f} s "
              f"({seen['deadline'] - seen['resumed']:.1f} s before the deadline)")
        assert complete(url) == seen["first"]  # the write cut off is not a checkpoint
        assert_every_row_once(coord.fetch(coord.schedule_on_all(final_counts, args=(state,))))
        assert coord.status()["workers_lost"] == 1  # the SIGKILL, a loss; the notice, none
        coord.close()

