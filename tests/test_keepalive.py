"""A job outlives its notebook (SPEC §4.6), on real LocalClusters of 3 worker processes.

- A driver process (a notebook's kernel) with ``Coordinator(keep_alive=True)`` schedules
  closures and a gang, fetches a few values and is SIGKILLed: the work goes on past
  ``client-grace``, and a new client's ``Coordinator.attach`` gets every other value,
  each once (``pending()``), finds the dataset by its label, reports; a second attach
  takes over from the first; attaching to a closed name raises an error naming it.
- Without ``keep_alive``, a client gone for ``client-grace`` closes its work.
- A keep-alive owner nobody attaches to closes after ``keep-alive-timeout``.
- With no client attached, values nobody read hold the owner's queue past
  ``keep-results`` (none is dropped); a client attaching lets it go on.
- A keep-alive owner's batch-inference job goes on past ``client-grace`` (a plain
  owner's is cancelled then), and the same ``map_batches`` call of an attached client
  takes it up.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import child_env, make_cluster, wait_for_workers, wait_until
from tests.keepalive_job import FETCHED, LONG, N, square
from tests.test_checkpoint import write_rows
from tests.test_owners import wait_for_file

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


def _exists(client, name: str) -> bool:
    """Whether the scheduler still holds coordinator ``name``."""
    return client.run_on_scheduler(
        lambda dask_scheduler: name in dask_scheduler.extensions["daskdist"].coordinators)


def _status(client, name: str) -> dict:
    return client.sync(client.scheduler.daskdist_status, name=name)


@pytest.mark.slow
def test_a_killed_kernels_work_goes_on_and_a_new_client_reads_each_value_once(tmp_path):
    data = write_rows(tmp_path / "shards")
    with dask.config.set({"daskdist.coordinator.client-grace": "1s"}), \
            make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        log = open(tmp_path / "job.log", "w")
        job = subprocess.Popen([sys.executable, "-m", "tests.keepalive_job",
                                cluster.scheduler_address, "nightly", str(tmp_path), data],
                               cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: (tmp_path / "fetched.json").exists() or job.poll() is not None,
                       120, "the driver to fetch its first values")
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            os.kill(job.pid, signal.SIGKILL)  # the kernel restarts
            job.wait(30)
        finally:
            if job.poll() is None:
                job.kill()
            log.close()
        fetched = {int(i): v for i, v in json.loads((tmp_path / "fetched.json").read_text())
                   .items()}
        assert fetched == {i: i * i for i in range(FETCHED)}
        gone = time.monotonic()
        # past client-grace the work goes on, to its end: nobody reads it meanwhile
        wait_until(lambda: (s := _status(client, "nightly"))["queued"] == 0
                   and s["running"] == 0 and s["gangs_pending"] == 0, 60, "the work to end")
        assert time.monotonic() - gone > 1.0 and _exists(client, "nightly")
        status = _status(client, "nightly")
        assert status["done"] == N + 3 and status["cancelled"] == 0, status  # 3 gang members

        with Client(cluster) as notebook:  # the restarted kernel's client
            coord = dd.Coordinator.attach(notebook, "nightly")
            pending = coord.pending()
            assert len(pending) == N - FETCHED + 1  # every value not read, once
            values = coord.fetch(pending)
            gang = [v for v in values if isinstance(v, list)]
            assert gang == [[("rank", 0), ("rank", 1), ("rank", 2)]]
            assert sorted(v for v in values if not isinstance(v, list)) == \
                [i * i for i in range(FETCHED, N)]
            assert coord.pending() == []
            train = coord.datasets()["train"]
            assert train.progress()["total"] == 3000 and train.progress()["acknowledged"] == 0
            assert coord.report().to_dict()["ranks"] is not None
            assert coord.status()["owners"] == 1
            # it goes on as the owner: new closures, numbered after the old ones
            assert coord.schedule(square, args=(7, 0.0)).fetch(timeout=60) == 49
            # another client takes it over: nothing is left unread
            with Client(cluster) as laptop:
                again = dd.Coordinator.attach(laptop, "nightly")
                assert again.pending() == []
                assert again.schedule(square, args=(8, 0.0)).fetch(timeout=60) == 64
                again.close()
            with pytest.raises(dd.CoordinatorClosedError, match="'nightly'"):
                dd.Coordinator.attach(client, "nightly")
        print(f"killed kernel: {LONG} closures and a gang still running, "
              f"{N - FETCHED - LONG} finished unread; all {N - FETCHED + 1} read once")


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(3, threads=1) as c:  # the killed kernel's test runs 2 threads
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster) as c:
        yield c


def test_without_keep_alive_the_work_closes_after_client_grace(cluster, client, tmp_path):
    gate = str(tmp_path / "gate")
    with dask.config.set({"daskdist.coordinator.client-grace": "2s"}):
        other = Client(cluster)
        coord = dd.Coordinator(other, name="graced")
        wait_for_workers(other, coord, 3)
        for _ in range(12):
            coord.schedule(wait_for_file, args=(gate,))
        wait_until(lambda: coord.status()["running"] >= 3, 30, "closures running")
        with pytest.raises(dd.CoordinatorClosedError, match="'graced' has no keep_alive"):
            dd.Coordinator.attach(client, "graced")  # nothing to take over
        with pytest.raises(dd.CoordinatorClosedError, match="'never-made' is not"):
            dd.Coordinator.attach(client, "never-made")
        other.close()
        left = time.monotonic()
        wait_until(lambda: not _exists(client, "graced"), 30, "the work to close")
        closed_after = time.monotonic() - left
    open(gate, "w").close()  # the closures still running end (their results dropped)
    assert closed_after >= 1.8, closed_after  # client-grace held it, then it closed
    with pytest.raises(dd.CoordinatorClosedError, match="'graced'"):
        dd.Coordinator.attach(client, "graced")


def test_a_keep_alive_owner_nobody_attaches_to_closes_after_its_timeout(cluster, client):
    with dask.config.set({"daskdist.coordinator.client-grace": "0.5s",
                          "daskdist.coordinator.keep-alive-timeout": "3s"}):
        other = Client(cluster)
        coord = dd.Coordinator(other, name="forgotten", keep_alive=True)
        coord.schedule(square, args=(3, 0.0))  # never read
        wait_until(lambda: coord.status()["done"] == 1, 30, "the closure to finish")
        other.close()
        left = time.monotonic()
        wait_until(lambda: not _exists(client, "forgotten"), 30, "the owner to close")
        closed_after = time.monotonic() - left
    assert closed_after >= 2.7, closed_after  # not at client-grace: at its own timeout
    with pytest.raises(dd.CoordinatorClosedError, match="'forgotten'"):
        dd.Coordinator.attach(client, "forgotten")


def blob(n: int, seconds: float) -> bytes:
    time.sleep(seconds)
    return b"x" * n


def test_with_no_client_unread_values_past_keep_results_hold_the_queue(cluster, client):
    other = Client(cluster)
    with dask.config.set({"daskdist.coordinator.keep-results": "4KiB"}):
        coord = dd.Coordinator(other, name="bounded", keep_alive=True)
    for _ in range(40):
        coord.schedule(blob, args=(1000, 0.1))
    wait_until(lambda: _status(client, "bounded")["scheduled"] == 40, 30, "the closures sent")
    other.close()  # nobody reads them now
    wait_until(lambda: (s := _status(client, "bounded"))["done"] >= 4 and s["running"] == 0
               and s["queued"] > 0, 30, "the queue held")
    held = _status(client, "bounded")  # workers idle, closures queued: held
    # 4 KiB hold ~3 values; the closures already handed to workers ended too
    assert held["done"] + held["queued"] == 40 and held["queued"] > 0, held
    coord = dd.Coordinator.attach(client, "bounded")  # a client again: the queue goes on
    try:
        assert coord.fetch(coord.pending()) == [b"x" * 1000] * 40  # every value, once
        assert coord.status()["done"] == 40
    finally:
        coord.close()


def test_a_keep_alive_owners_inference_job_goes_on_and_an_attached_client_takes_it_up(
        cluster, client, tmp_path):
    from tests import inference_jobs as jobs

    gate = str(tmp_path / "gate")  # every batch waits for it: the jobs run, commit nothing
    glob = jobs.write_files(str(tmp_path / "in"), files=3, rows=200, group=100)

    def start(coord, name):
        return coord.map_batches(functools.partial(jobs.predict, gate=gate), glob,
                                 output=str(tmp_path / name), model=jobs.model, keep=["id"],
                                 unit_rows=200, name=name)

    try:
        with dask.config.set({"daskdist.coordinator.client-grace": "1s"}):
            other = Client(cluster)
            kept = dd.Coordinator(other, name="inferring", keep_alive=True)
            plain = dd.Coordinator(other, name="inferring")  # a second owner, not kept
            wait_for_workers(other, kept, 3)
            start(kept, "kept")
            start(plain, "plain")
            other.close()  # the kernel restarts
            wait_until(lambda: _status(client, "inferring")["inference"]["plain"]["state"]
                       == "cancelled", 30, "the plain owner's job to end past client-grace")
        jobs_now = _status(client, "inferring")["inference"]
        assert jobs_now["kept"]["state"] == "running" and jobs_now["kept"]["rows"] == 0
        coord = dd.Coordinator.attach(client, "inferring")
        try:
            job = start(coord, "kept")  # the same call: the running job's handle
            assert job.attached and job.state == "running"
            open(gate, "w").close()
            jobs.exactly_once(job.result(timeout=60), 600)
        finally:
            coord.close()
    finally:
        open(gate, "w").close()
