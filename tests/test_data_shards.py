"""ArrowShards: discovery (dir, glob, list, pyarrow dataset, fsspec), units, named errors."""

from __future__ import annotations

import pickle

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.feather as feather
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from daskdist.data import ArrowShards


def _table(start: int, n: int) -> pa.Table:
    ids = np.arange(start, start + n, dtype=np.int64)
    return pa.table({"id": ids, "x": ids.astype(np.float32)})


def write_parquet(root, files=3, rows=100, row_group=40, prefix="part"):
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        p = root / f"{prefix}-{f}.parquet"
        pq.write_table(_table(f * rows, rows), p, row_group_size=row_group)
        paths.append(p)
    return paths


def test_directory_units_are_row_groups_in_stable_order(tmp_path):
    write_parquet(tmp_path / "d", files=3, rows=100, row_group=40)
    (tmp_path / "d" / "README.txt").write_text("not data")
    sh = ArrowShards(tmp_path / "d")
    assert sh.num_files == 3
    assert [(u.file_index, u.piece, u.num_rows) for u in sh.units] == [
        (f, p, n) for f in range(3) for p, n in enumerate([40, 40, 20])]
    assert [u.start for u in sh.units] == list(np.cumsum([0] + [40, 40, 20] * 3)[:-1])
    assert sh.num_rows == 300 and len(sh) == 9
    assert sh.schema.names == ["id", "x"]
    # the same files found another way give the same units and fingerprint
    again = ArrowShards(str(tmp_path / "d" / "*.parquet"))
    assert again.units == sh.units and again.fingerprint() == sh.fingerprint()


def test_glob_list_and_single_file(tmp_path):
    paths = write_parquet(tmp_path, files=4, rows=10, row_group=10)
    assert ArrowShards(str(tmp_path / "part-[12].parquet")).num_files == 2
    sh = ArrowShards([paths[3], paths[0]])
    assert [u.path for u in sh.units] == sorted(str(p) for p in [paths[0], paths[3]])
    assert ArrowShards(paths[2]).num_rows == 10


def test_feather_record_batches_are_units(tmp_path):
    t = _table(0, 30)
    feather.write_feather(t, tmp_path / "a.feather", chunksize=8)
    pq.write_table(_table(30, 5), tmp_path / "b.parquet")
    sh = ArrowShards(tmp_path)
    assert [u.num_rows for u in sh.units] == [8, 8, 8, 6, 5]
    table = sh.reader().read(sh.units[1], ["id"])
    assert table.column("id").to_pylist() == list(range(8, 16))


def test_pyarrow_dataset_and_filesystem(tmp_path):
    write_parquet(tmp_path, files=2, rows=10, row_group=5)
    ds = pads.dataset(str(tmp_path), format="parquet")
    sh = ArrowShards(ds)
    assert len(sh.units) == 4 and sh.num_rows == 20
    sh2 = ArrowShards(str(tmp_path), filesystem=pafs.LocalFileSystem())
    assert sh2.units == ArrowShards(tmp_path).units


def test_fsspec_memory_urls():
    fs = fsspec.filesystem("memory")
    for f in range(2):
        with fs.open(f"/shards-test/m{f}.parquet", "wb") as fh:
            pq.write_table(_table(f * 7, 7), fh, row_group_size=3)
    try:
        sh = ArrowShards("memory://shards-test/*.parquet")
        assert [u.num_rows for u in sh.units] == [3, 3, 1, 3, 3, 1]
        assert all(u.path.startswith("memory://") for u in sh.units)
        t = sh.reader().read(sh.units[4], None)
        assert t.column("id").to_pylist() == [10, 11, 12]
        assert ArrowShards("memory://shards-test").num_files == 2
        clone = pickle.loads(pickle.dumps(sh))
        assert clone.units == sh.units
    finally:
        fs.rm("/shards-test", recursive=True)


def test_empty_source_names_the_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        ArrowShards(str(tmp_path / "nothing-here" / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        ArrowShards(tmp_path / "empty")


def test_corrupt_file_is_named_before_reading(tmp_path):
    write_parquet(tmp_path, files=2, rows=10)
    bad = tmp_path / "part-9.parquet"
    bad.write_bytes(b"PAR1 this is not really parquet")
    sh = ArrowShards(tmp_path)  # discovery does not read footers
    with pytest.raises(ValueError, match="part-9.parquet"):
        sh.validate()
    junk = tmp_path / "zz.bin"
    junk.write_bytes(b"hello")
    with pytest.raises(ValueError, match="zz.bin"):
        ArrowShards(junk).validate()


def test_schema_mismatch_is_named(tmp_path):
    write_parquet(tmp_path, files=2, rows=10)
    pq.write_table(pa.table({"id": pa.array([1.5]), "x": pa.array([1.0], pa.float32())}),
                   tmp_path / "part-5.parquet")
    with pytest.raises(ValueError, match="part-5.parquet.*schema mismatch"):
        ArrowShards(tmp_path).validate()
    # selecting only the columns that agree is fine
    assert ArrowShards(tmp_path, columns=["x"]).num_rows == 21
    with pytest.raises(ValueError, match="missing column"):
        ArrowShards(tmp_path, columns=["nope"]).validate()
