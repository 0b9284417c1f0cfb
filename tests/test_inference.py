"""Batch inference (``Coordinator.map_batches``, SPEC §7) on real LocalClusters (worker
processes, 1 and 2 threads a worker): files and a lazy frame predicted, every row once,
the model built once per worker; bad arguments refused before anything runs; a
different source under the same name refused, ``overwrite=True`` starting over; a bad
unit named after ``max_worker_failures`` and a fixed re-run resuming without
recomputing what was committed; an object store's semantics (``memory://``)."""

from __future__ import annotations

import functools
import logging
import os

import pyarrow.dataset as pads
import pytest

import daskdist as dd
from tests import inference_jobs as jobs
from tests.conftest import THREADS, wait_for_workers, wait_until

pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")


@pytest.fixture(scope="module", params=THREADS)
def threads(request) -> int:
    return request.param


def output_ids(path: str) -> list[int]:
    """What a directory reader sees now."""
    return sorted(pads.dataset(path, format="parquet").to_table()["id"].to_pylist())


@pytest.mark.timeout(180)
def test_files_and_a_lazy_frame_every_row_once_the_model_built_once(coord, tmp_path):
    glob = jobs.write_files(str(tmp_path / "in"))
    built = str(tmp_path / "built")
    job = coord.map_batches(functools.partial(jobs.predict, log=str(tmp_path / "rows")),
                            glob, output=str(tmp_path / "out"),
                            model=functools.partial(jobs.model, log=built),
                            batch_size=96, keep=["id"], unit_rows=500, name="files")
    jobs.exactly_once(job.result(timeout=120), 4000)
    p = job.progress()
    assert (p["state"], p["rows"], p["total"], p["out_rows"]) == ("complete", 4000, 4000, 4000)
    # a file a unit: 500 rows (two row groups), fewer at the tail (its leases shrink so
    # that the members end together)
    files = job.files()
    sizes = [pads.dataset(f, format="parquet").count_rows() for f in files]
    assert max(sizes) == 500 and sum(sizes) == 4000 and len(files) == p["units"] >= 8
    pids = jobs.builds(built)
    assert len(pids) == len(set(pids)) <= 2  # once per worker (that ran a unit)
    assert sum(w["units"] for w in p["workers"]) == p["units"]
    # each row predicted once: nothing ran twice without a failure
    rows = sorted(r for a, b in jobs.predicted(str(tmp_path / "rows")) for r in range(a, b))
    assert rows == list(range(4000))
    out = tmp_path / "out"
    assert (out / "_SUCCESS").exists() and (out / "_manifest.json").exists()
    assert not (out / "_daskdist" / "staging").exists()
    assert output_ids(str(out)) == list(range(4000))
    assert files == sorted(files)  # in row order

    computed = str(tmp_path / "computed")
    built2 = str(tmp_path / "built2")
    fjob = coord.map_batches(jobs.predict, jobs.frame(6, 300, log=computed),
                             output=str(tmp_path / "fout"),
                             model=functools.partial(jobs.model, log=built2), batch_size=128,
                             keep=["id"], name="frame")
    fjob.progress(bar=True)
    jobs.exactly_once(fjob.result(timeout=120), 1800)
    assert sorted(jobs.computed(computed)) == list(range(6))  # each partition once
    assert fjob.progress()["units"] == 6
    pids = jobs.builds(built2)
    assert len(pids) == len(set(pids)) <= 2
    # a small output returned in memory: each committed unit's rows once, no file
    small = coord.map_batches(jobs.predict, jobs.frame(4, 100), output=None, model=jobs.model,
                              keep=["id"], batch_size=32, name="scores")
    jobs.exactly_once(small.result(timeout=120), 400)
    assert small.files() == [] and small.progress()["units"] == 4
    jobs.exactly_once(small.result(), 400)  # read once from the scheduler, then kept

    # the job is seen: in the coordinator's status, on the dashboard (status.json's
    # rows, per worker) and in the metrics
    status = coord.status()["inference"]
    assert status["frame"]["state"] == "complete" and status["frame"]["rows"] == 1800
    rows, samples = coord.client.run_on_scheduler(jobs.seen, coordinator=coord.name)
    shown = {r["name"]: r for r in rows}
    assert shown["files"]["rows"] == 4000 and shown["frame"]["units"] == 6
    assert sum(w["units"] for w in shown["frame"]["workers"]) == 6
    assert all(w["rows_per_second"] > 0 for w in shown["frame"]["workers"])
    assert samples[("daskdist_infer_rows_total", "files", None)] == 4000
    assert samples[("daskdist_infer_running", "frame", None)] == 0
    assert sum(v for (n, job, w), v in samples.items()
               if n == "daskdist_infer_worker_units_total" and job == "frame") == 6


@pytest.mark.timeout(180)
def test_bad_arguments_and_another_source_under_the_same_name_are_refused(coord, tmp_path,
                                                                         threads):
    glob = jobs.write_files(str(tmp_path / "in"), files=2, rows=400, group=200)
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="batch_size"):
        coord.map_batches(jobs.predict, glob, output=out, batch_size=0)
    with pytest.raises(ValueError, match=r"\['nope'\].*columns"):
        coord.map_batches(jobs.predict, glob, output=out, keep=["nope"])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="a-file.*not writable"):
        coord.map_batches(jobs.predict, glob, output=str(tmp_path / "a-file" / "out"))
    with pytest.raises(TypeError, match="predict must be callable"):
        coord.map_batches(None, glob, output=out)
    assert not os.path.exists(out)  # nothing ran, nothing written

    model = jobs.model
    job = coord.map_batches(jobs.predict, glob, output=out, model=model, name="scores",
                            keep=["id"], unit_rows=200)
    jobs.exactly_once(job.result(timeout=120), 800)
    other = jobs.write_files(str(tmp_path / "other"), files=1, rows=300, group=100)
    with pytest.raises(dd.InputError, match="another source"):
        coord.map_batches(jobs.predict, other, output=out, model=model, name="scores")
    with pytest.raises(ValueError, match="holds the output of job 'scores'"):
        coord.map_batches(jobs.predict, glob, output=out, model=model, name="renamed")
    again = coord.map_batches(jobs.predict, glob, output=out, model=model, name="scores",
                              keep=["id"])  # complete already: nothing runs
    assert again.state == "complete" and again.progress()["resumed_units"] == 4
    fresh = coord.map_batches(jobs.predict, other, output=out, model=model, name="scores",
                              keep=["id"], overwrite=True)
    jobs.exactly_once(fresh.result(timeout=120), 300)

    # a model that cannot be built fails the job (not a closure loop), naming why
    broken = coord.map_batches(jobs.predict, glob, output=str(tmp_path / "broken"),
                               model=jobs.broken_model, name="broken")
    with pytest.raises(dd.InputError, match="no weights at /nowhere"):
        broken.result(timeout=120)

    # cancelled: nothing more is committed, what was stays, the same call resumes it
    slow = functools.partial(jobs.predict, pause=0.1)
    kw = {"output": str(tmp_path / "slow"), "model": model, "name": "slow", "keep": ["id"],
          "unit_rows": 200, "batch_size": 50}
    job = coord.map_batches(slow, glob, **kw)
    wait_until(lambda: job.progress()["units"] >= 1, 60, "a unit committed")
    job.cancel()
    assert job.state == "cancelled"
    with pytest.raises(dd.CancelledError):
        job.result(timeout=30)
    resumed = coord.map_batches(slow, glob, **kw)
    jobs.exactly_once(resumed.result(timeout=120), 800)
    assert resumed.progress()["resumed_units"] >= 1


@pytest.mark.timeout(240)
def test_a_bad_unit_is_named_and_a_fixed_rerun_resumes(coord, tmp_path, threads):
    glob = jobs.write_files(str(tmp_path / "in"), files=3, rows=600, group=200)
    flag = tmp_path / "bad"
    flag.write_text("")
    rows_log = str(tmp_path / "rows")
    predict = functools.partial(jobs.predict, log=rows_log, bad=(1234, str(flag)))
    out = str(tmp_path / "out")
    job = coord.map_batches(predict, glob, output=out, model=jobs.model, name="bad",
                            keep=["id"], unit_rows=200, batch_size=100)
    with pytest.raises(dd.InputError) as e:
        job.result(timeout=180)
    text = str(e.value)  # the unit (file, row group, rows) and the error
    assert "part2.parquet row group 0, rows [12" in text  # [1200, 1400) or a tail's part
    assert "ZeroDivisionError: row 1234 is bad" in text and "3 times" in text
    with pytest.raises(dd.InputError):
        job.progress()
    p = job.wait()
    # the other units committed, but for those still in flight when the job failed
    # (with 2 threads a worker one may be): never a duplicate, never the bad unit's rows
    committed = p["units"]
    assert p["state"] == "failed" and 1 <= committed <= 8
    assert any("row 1234 is bad" in msg for _, msg in p["errors"])
    ids = output_ids(out)
    assert len(ids) == len(set(ids)) == 200 * committed
    assert not set(ids) & set(range(1200, 1400))

    flag.unlink()  # fixed: the same call resumes
    before = len(jobs.predicted(rows_log))
    rerun = coord.map_batches(predict, glob, output=out, model=jobs.model, name="bad",
                              keep=["id"], unit_rows=200, batch_size=100)
    jobs.exactly_once(rerun.result(timeout=120), 1800)
    assert rerun.resumed and rerun.progress()["resumed_units"] == committed
    # a committed row is never predicted again; every other one is (a unit of the failed
    # job still in flight at its end may log its rows here too)
    again = {r for a, b in jobs.predicted(rows_log)[before:] for r in range(a, b)}
    assert not again & set(ids) and again >= set(range(1800)) - set(ids)


@pytest.mark.timeout(120)
def test_an_object_store_output_is_committed_by_its_manifest(tmp_path):
    """fsspec's ``memory://`` (a move is a copy and a delete, as on object stores) is
    one process's: the workers are threads of this process here."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      silence_logs=logging.ERROR, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client)
        wait_for_workers(client, coord, 2)
        url = f"memory://daskdist-test-{os.getpid()}/preds"
        job = coord.map_batches(jobs.predict, jobs.frame(5, 200), output=url, model=jobs.model,
                                keep=["id"], batch_size=64)
        jobs.exactly_once(job.result(timeout=60), 1000)
        assert all(f.startswith("memory://") for f in job.files()) and len(job.files()) == 5
        jobs.exactly_once(ddf.read_parquet(url), 1000)  # no staged file read
        coord.close()

