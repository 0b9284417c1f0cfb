"""An asynchronously trained model's checkpoints (``am.checkpoint_to``) on real worker
processes: with every holder of the model SIGKILLed at once, a worker loads the newest
checkpoint and the datasets' ledger goes back to it (the rows learned since are learned
again); a new cluster resumes from the checkpoint with a dataset of the same name and
finishes the epoch. Across both jobs every row is learned exactly once."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from distributed import Client

import daskdist as dd
from tests.async_rounds import Counting, local_round, sgd, write_rows
from tests.conftest import make_cluster, wait_for_workers, wait_until, worker_pids

pytestmark = [pytest.mark.timeout(150),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ROWS = 1200


def model():
    return Counting(ROWS)


def rounds_until(coord, ds, am, it, rows: int) -> None:
    """Rounds until ``rows`` rows are acknowledged (or the epoch is complete)."""
    while ds.progress()["acknowledged"] < rows and not ds.progress()["complete"]:
        for rv in [coord.schedule(local_round, args=(am.replica, it, 2, 0.002))
                   for _ in range(6)]:
            try:
                rv.fetch(timeout=60)
            except TimeoutError as e:
                raise AssertionError(f"a round took over 60 s: {ds.progress()} "
                                     f"{am.report()} {coord.status()}") from e


def start(coord, rows, url: str, batch: int):
    """The dataset named "train" and the model checkpointed under ``url``."""
    ds = coord.distribute_dataset(str(rows), global_batch_size=batch, policy="dynamic",
                                  name="train")
    am = coord.async_model(model=model, optimizer=sgd, outer=dd.asynchronous.Average(),
                           max_staleness=50).checkpoint_to(url, every=2)
    return ds, am


@pytest.mark.slow
def test_every_holder_lost_loads_the_checkpoint_and_a_new_cluster_resumes(tmp_path):
    (tmp_path / "rows").mkdir()
    rows = write_rows(tmp_path / "rows", ROWS)
    url = str(tmp_path / "checkpoints")
    with make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="async-ckpt")
        wait_for_workers(client, coord, 3)
        ds, am = start(coord, rows, url, 60)
        it = iter(ds)
        rounds_until(coord, ds, am, it, ROWS // 3)
        wait_until(lambda: (am.report()["checkpoint"] or {}).get("version", 0) > 0, 30,
                   "a checkpoint")
        pids = worker_pids(client)
        lost = am.holders()
        assert len(lost) == 2
        for address in lost:  # the holder and its standby, at once
            os.kill(pids[address], signal.SIGKILL)
        # a report from before the scheduler saw the kills still says "ready": the
        # holders listed after it say whether a new one serves the model
        wait_until(lambda: am.report()["phase"] == "ready"
                   and (holders := am.holders()) and holders[0] not in lost,
                   60, "a worker serving the model from its checkpoint")
        report = am.report()
        assert report["holder_losses"] >= 1 and report["failed"] == ""
        # one wave more (240 rows at most): rows are acknowledged a copy after their
        # push, so a loop until a count could train the epoch out before the new cluster
        for rv in [coord.schedule(local_round, args=(am.replica, it, 2, 0.002))
                   for _ in range(6)]:
            rv.fetch(timeout=60)
        wait_until(lambda: am.report()["open_pushes"] == 0, 30, "every push durable")
        first_job = am.version
        written = am.report()["checkpoint"]["version"]
        assert 0 < written <= first_job
    # a new cluster (new scheduler, 2 workers, new client): the same URL and dataset name
    with make_cluster(2, threads=1) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="async-ckpt")
        wait_for_workers(client, coord, 2)
        ds, am = start(coord, rows, url, 40)
        assert am.version >= written  # resumed, never a fresh start
        resumed = ds.progress()["acknowledged"]
        assert 0 < resumed < ROWS
        counts = am.state_dict()["counts"].numpy()
        assert int(counts.sum()) == resumed  # the ledger matches the model it came with
        rounds_until(coord, ds, am, iter(ds), ROWS)
        c = am.state_dict()["counts"].numpy()
        assert np.all(c == 1), (int((c == 0).sum()), int((c > 1).sum()))
        coord.close()
