"""Batch inference through real faults and splits (worker processes): two members
SIGKILLed mid-job leave the output exactly once, and a reader of the output directory
sees no row twice (and no staged file) at any moment while the job runs; a whole cluster
killed mid-job, the same call on a new cluster resumes it without reading or computing
again the partitions committed before; GPU members (``resources=``) predict while a
plain worker computes the frame's partitions for them."""

from __future__ import annotations

import functools
import threading

import pyarrow.dataset as pads
import pytest

import daskdist as dd
from daskdist.inference.storage import Output
from tests import inference_jobs as jobs
from tests.conftest import (
    gpu_and_plain_cluster,
    make_cluster,
    sigkill,
    wait_for_workers,
    wait_until,
    worker_pids,
)

pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")


class Reader(threading.Thread):
    """Reads the output directory over and over while the job runs, as a user would
    (``pyarrow.dataset``, and ``dask.dataframe.read_parquet`` every tenth read): the
    largest number of rows seen and any row seen twice in one read."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.stop = threading.Event()
        self.reads = 0
        self.most = 0
        self.twice: list[int] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ds = pads.dataset(self.path, format="parquet")
                if not ds.files:  # nothing committed yet
                    ids = []
                elif self.reads % 10 == 9:
                    ids = ddf.read_parquet(self.path, columns=["id"]).compute()["id"].tolist()
                else:
                    ids = ds.to_table(columns=["id"])["id"].to_pylist()
            except Exception as e:  # noqa: BLE001 - a partial file would land here
                self.errors.append(repr(e))
                ids = []
            if len(ids) != len(set(ids)):
                self.twice.append(len(ids) - len(set(ids)))
            self.most = max(self.most, len(ids))
            self.reads += 1
            self.stop.wait(0.03)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_sigkills_mid_job_leave_every_row_once_and_readers_never_see_one_twice(tmp_path):
    glob = jobs.write_files(str(tmp_path / "in"), files=6, rows=600, group=100)
    out = str(tmp_path / "out")
    with make_cluster(3, threads=2) as cluster:
        from distributed import Client

        with Client(cluster) as client:
            coord = dd.Coordinator(client, name="sigkills")
            wait_for_workers(client, coord, 3)
            predict = functools.partial(jobs.predict, pause=0.03)
            job = coord.map_batches(predict, glob, output=out, model=jobs.model, keep=["id"],
                                    unit_rows=200, batch_size=50, name="kills")
            reader = Reader(out)
            reader.start()
            killed = []
            for at in (6, 14):  # units committed before each kill
                wait_until(lambda at=at: job.progress()["units"] >= at, 120, f"{at} units")
                pid = sorted(set(worker_pids(client).values()) - set(killed))[0]
                killed.append(pid)
                sigkill(pid)
            jobs.exactly_once(job.result(timeout=180), 3600)
            reader.stop.set()
            reader.join(30)
            p = job.progress()
            assert p["state"] == "complete" and p["rows"] == 3600
            assert coord.status()["workers_lost"] >= 2
            assert not reader.twice and not reader.errors, (reader.twice, reader.errors)
            assert reader.reads >= 5 and reader.most <= 3600
            # the manifest lists each unit once; nothing staged is left
            files = job.files()
            assert len(files) == len(set(files)) == p["units"]
            assert not (tmp_path / "out" / "_daskdist" / "staging").exists()
            coord.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_whole_cluster_killed_mid_job_resumes_without_recomputing_what_was_committed(
        tmp_path):
    from distributed import Client

    log = str(tmp_path / "computed")
    source = jobs.frame(12, 200, log=log)
    out = str(tmp_path / "out")
    predict = functools.partial(jobs.predict, pause=0.05)

    def run(client):
        coord = dd.Coordinator(client, name="whole")
        wait_for_workers(client, coord, 2)
        return coord, coord.map_batches(predict, source, output=out, model=jobs.model,
                                        keep=["id"], batch_size=50, name="resumable")

    with make_cluster(2, threads=1) as cluster, Client(cluster) as client:
        coord, job = run(client)
        wait_until(lambda: job.progress()["units"] >= 4, 120, "4 units committed")
        for pid in worker_pids(client).values():  # every worker at once, then the rest
            sigkill(pid)
    # what the output held when the cluster went: units committed and published
    records = Output(out).records()
    before = {int(r["first"]) >> 30 for r in records if (tmp_path / "out" / r["file"]).exists()}
    assert len(before) >= 3
    mark = len(jobs.computed(log))

    with make_cluster(2, threads=1) as cluster, Client(cluster) as client:
        coord, job = run(client)
        jobs.exactly_once(job.result(timeout=180), 2400)
        p = job.progress()
        assert job.resumed and p["resumed_units"] >= len(before)
        again = set(jobs.computed(log)[mark:])
        assert not again & before, f"partitions {sorted(again & before)} computed again"
        assert again | before == set(range(12))
        coord.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_members_predict_while_a_helper_computes_the_partitions(tmp_path):
    log = str(tmp_path / "computed")
    with gpu_and_plain_cluster(threads=2) as (cluster, client, members, cpu):
        coord = dd.Coordinator(client, name="helpers", resources={"GPU": 1})
        wait_until(lambda: coord.status()["workers"] == 2, 60, "the two GPU workers")
        job = coord.map_batches(jobs.predict, jobs.frame(16, 100, log=log, pause=0.02),
                                output=str(tmp_path / "out"), model=jobs.model,
                                keep=["id"], batch_size=64)
        jobs.exactly_once(job.result(timeout=120), 1600)
        p = job.progress()
        assert {w["address"] for w in p["workers"]} <= members  # units only on members
        assert sum(w["units"] for w in p["workers"]) == p["units"] == 16
        made = [where for _, where in jobs.computed_where(log)]
        # preferred, a loose restriction: on a loaded machine Dask moves a few of the
        # helper's queued partitions to the members, never most
        assert set(made) <= members | {cpu} and made.count(cpu) > 0.5 * len(made), made
        coord.close()
