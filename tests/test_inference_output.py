"""A batch-inference job's output, without a cluster (``inference/storage.py``,
``inference/outputs.py``): readers (``pyarrow.dataset``, ``dask.dataframe.read_parquet``)
never see a staged file; a unit's commit is idempotent and rolled forward by a new run;
files without a ledger record and leftover staging go; the manifest lists every
committed unit once, on a local directory and on fsspec's ``memory://`` (an object
store's semantics); ``predict``'s outputs become Arrow with the kept columns."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest
import torch

from daskdist.core.inference import JobState
from daskdist.data.convert import Chunk
from daskdist.data.sources import ChunkItem
from daskdist.inference.engine import batches
from daskdist.inference.outputs import UnitWriter, to_table
from daskdist.inference.storage import Output, manifest_files

pytestmark = pytest.mark.timeout(120)
ddf = pytest.importorskip("dask.dataframe")


def stage(out: Output, pool: ThreadPoolExecutor, first: int, n: int) -> str:
    """A unit of ``n`` rows from id ``first``, staged as an attempt would: its path."""
    path = out.staged(f"c-{first}#1")
    w = UnitWriter(out, path, pool, row_group_rows=1000)
    for a in range(first, first + n, 4):
        ids = torch.arange(a, min(a + 4, first + n))
        w.put({"y": ids * 2}, {"id": ids}, ["id"], len(ids))
    assert w.close() == n
    return path


def commit(out: Output, job: JobState, path: str, first: int, n: int) -> dict:
    unit = job.commit("s1", f"c-{first}#1", [(first, first + n)], path, n)
    return unit.record()


def record(out: Output, rec: dict) -> None:
    """A unit's ledger record written, as a worker lost before its move leaves it."""
    out.fs.makedirs(out.path("_daskdist/ledger"), exist_ok=True)
    out.fs.pipe_file(out.path("_daskdist/ledger", f"{rec['first']:016x}.json"),
                     json.dumps(rec).encode())


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as p:
        yield p


@pytest.fixture(params=["local", "memory"])
def out(request, tmp_path):
    if request.param == "local":
        yield Output(str(tmp_path / "out"))
        return
    url = f"memory://infer-{uuid.uuid4().hex[:8]}/out"
    yield Output(url)
    o = Output(url)
    o.fs.rm(o.root, recursive=True)


def read_ids(out: Output, files: list[str] | None = None) -> list[int]:
    if files is not None:
        return sorted(ddf.read_parquet(files).compute()["id"].tolist())
    by_dask = sorted(ddf.read_parquet(out.url).compute()["id"].tolist())
    by_arrow = sorted(pads.dataset(out.root, filesystem=out.fs, format="parquet")
                      .to_table()["id"].to_pylist())
    assert by_dask == by_arrow
    return by_dask


def test_readers_never_see_staging_and_a_commit_is_idempotent(out, pool):
    job = JobState("j")
    out.check_writable()
    out.start({"name": "j", "fingerprint": "f", "source": "test"})
    a = stage(out, pool, 0, 10)
    b = stage(out, pool, 10, 6)
    out.fs.makedirs(out.root, exist_ok=True)
    assert out.fs.exists(a) and not a.endswith(".parquet")
    # a staged unit is invisible to both readers until committed
    rec = commit(out, job, a, 0, 10)
    out.publish(rec)
    assert read_ids(out) == list(range(10))
    out.publish(rec)  # again (a finalization after the attempt): nothing changes
    assert read_ids(out) == list(range(10))
    assert out.fs.exists(b)  # b, not committed, stays out of sight
    manifest = out.finalize([])
    assert manifest["units"] == 1 and manifest["rows"] == 10 and manifest["out_rows"] == 10
    assert not out.fs.exists(b)  # staging goes at the job's end
    assert out.fs.exists(out.path("_SUCCESS"))
    assert read_ids(out, manifest_files(out.url)) == list(range(10))


def test_a_new_run_rolls_forward_forgets_and_cleans(out, pool):
    job = JobState("j")
    out.start({"name": "j", "fingerprint": "f", "source": "test"})
    # unit 0: committed and published; unit 10: its record written, the worker lost
    # before the move; unit 20: a record whose staging is gone; unit 30: a file with no
    # record (an attempt that lost); unit 40: staged only
    out.publish(commit(out, job, stage(out, pool, 0, 10), 0, 10))
    for rec in (commit(out, job, stage(out, pool, 10, 10), 10, 10),
                commit(out, job, out.staged("gone#1"), 20, 10)):
        record(out, rec)
    lost = stage(out, pool, 30, 10)
    out.fs.mv(lost, out.path(f"part-{30:016x}.parquet"))
    stage(out, pool, 40, 10)
    r = out.resume()
    assert r.committed == [(0, 20)] and (r.units, r.out_rows, r.complete) == (2, 20, False)
    assert read_ids(out) == list(range(20))
    assert not out.fs.exists(out.path("_daskdist/staging"))
    assert [rec["first"] for rec in out.records()] == [0, 10]


def test_foreign_files_and_an_unwritable_output_are_named(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "other.parquet").write_bytes(b"x")
    assert Output(str(d)).foreign() == ["other.parquet"]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="a-file.*not writable"):
        Output(str(blocker / "out")).check_writable()


def test_predict_outputs_become_arrow_with_the_kept_columns():
    batch = {"id": torch.arange(3), "text": ["a", "b", "c"]}
    t = to_table({"emb": torch.ones(3, 4), "score": np.zeros(3)}, batch, ["id", "text"], 3)
    assert t.column_names == ["emb", "score", "id", "text"]
    assert t.schema.field("emb").type == pa.list_(pa.float32(), 4)
    assert t["text"].to_pylist() == ["a", "b", "c"]
    pd = pytest.importorskip("pandas")
    t = to_table(pd.DataFrame({"label": [1, 0]}), batch, [], 3)  # a filter: 2 rows of 3
    assert t.num_rows == 2
    with pytest.raises(ValueError, match="keep= .* one output row per input row"):
        to_table({"y": torch.ones(2)}, batch, ["id"], 3)
    with pytest.raises(ValueError, match="clashes"):
        to_table({"id": torch.ones(3)}, batch, ["id"], 3)
    with pytest.raises(ValueError, match="differ in length"):
        to_table({"a": torch.ones(3), "b": torch.ones(2)}, batch, [], 3)
    with pytest.raises(TypeError, match="must return a dict"):
        to_table(torch.ones(3), batch, [], 3)


def test_a_unit_is_cut_into_batches_across_its_blocks():
    def item(a, b):
        ids = np.arange(a, b)
        return ChunkItem(Chunk(["x"], {"x": torch.arange(a, b)}), ids, b - a, ascending=True)

    got = [(b["x"].tolist(), n) for b, n in batches([item(0, 5), item(5, 7)], 3)]
    assert got == [([0, 1, 2], 3), ([3, 4, 5], 3), ([6], 1)]


def test_the_ledger_record_is_json(out, pool):
    job = JobState("j")
    rec = commit(out, job, stage(out, pool, 0, 4), 0, 4)
    out.publish(rec)
    data = json.loads(out.fs.cat_file(out.path("_daskdist/ledger", f"{0:016x}.json")))
    assert data["rows"] == [[0, 4]] and data["file"] == f"part-{0:016x}.parquet"
