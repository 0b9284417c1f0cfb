"""ArrowLoader: tensors from Arrow buffers, nulls, policies, shuffle, resume, prefetch."""

from __future__ import annotations

import json
from collections import Counter

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch

from daskdist.data import ArrowLoader, ArrowShards, InputContext
from daskdist.data.files.arrow import UnitReader

# Arrow buffers are read-only; the loader silences torch's one-time warning in its own
# module, but pytest re-enables warnings per test.
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


def write(root, files=4, rows=250, row_group=64, with_extras=True):
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows, dtype=np.int64)
        cols = {"id": ids, "x": ids.astype(np.float32) / 2}
        if with_extras:
            cols["v"] = pa.FixedSizeListArray.from_arrays(
                pa.array(np.repeat(ids, 3).astype(np.float64)), 3)
            cols["flag"] = pa.array(ids % 2 == 0)
            cols["s"] = pa.array([f"r{i}" for i in ids])
        pq.write_table(pa.table(cols), root / f"p{f:02d}.parquet", row_group_size=row_group)
    return root


def ids_of(loader):
    return np.concatenate([b["id"].numpy() for b in loader]).tolist()


@pytest.fixture
def data(tmp_path):
    return write(tmp_path / "d")


def test_batches_are_tensors_of_the_right_shapes(data):
    ld = ArrowLoader(ArrowShards(data), InputContext(), batch_size=100)
    batches = list(ld)
    assert len(batches) == len(ld) == 10
    b = batches[0]
    assert set(b) == {"id", "x", "v", "flag", "s"}
    assert b["id"].dtype == torch.int64 and b["id"].shape == (100,)
    assert b["x"].dtype == torch.float32 and torch.equal(b["x"], b["id"].float() / 2)
    assert b["v"].shape == (100, 3) and torch.equal(b["v"][:, 2], b["id"].double())
    assert b["flag"].dtype == torch.bool and bool(b["flag"][0]) and not bool(b["flag"][1])
    assert b["s"] == [f"r{i}" for i in range(100)]
    assert ids_of(ld) == list(range(1000))
    assert batches[-1]["id"].shape == (100,)  # last batch straddles chunks: concatenated
    assert [len(b["id"]) for b in ArrowLoader(data, batch_size=300)] == [300, 300, 300, 100]
    assert [len(b["id"]) for b in ArrowLoader(data, batch_size=300, drop_last=True)] == [300] * 3


def test_batches_are_views_of_one_arrow_buffer(tmp_path):
    write(tmp_path, files=1, rows=1000, row_group=1000, with_extras=False)
    it = iter(ArrowLoader(tmp_path, batch_size=100, columns=["x"]))
    a, b = next(it), next(it)
    # consecutive batches of a chunk are views of one buffer, not copies
    assert b["x"].data_ptr() == a["x"].data_ptr() + 100 * 4
    assert a["x"].untyped_storage().data_ptr() == b["x"].untyped_storage().data_ptr()


def test_columns_feather_and_memory_fs(tmp_path):
    t = pa.table({"id": np.arange(50), "y": np.ones(50, np.float16)})
    feather.write_feather(t, tmp_path / "a.feather", chunksize=16)
    ld = ArrowLoader(tmp_path, batch_size=20, columns=["y"])
    out = list(ld)
    assert [set(b) for b in out] == [{"y"}] * 3 and out[0]["y"].dtype == torch.float16
    with pytest.raises(ValueError, match="nope"):
        ArrowLoader(tmp_path, columns=["nope"])
    fs = fsspec.filesystem("memory")
    with fs.open("/loader-test/a.parquet", "wb") as fh:
        pq.write_table(t, fh, row_group_size=7)
    try:
        assert ids_of(ArrowLoader("memory://loader-test", batch_size=8)) == list(range(50))
    finally:
        fs.rm("/loader-test", recursive=True)


def test_nulls_raise_naming_the_column_unless_filled(tmp_path):
    t = pa.table({"id": pa.array([1, None, 3]), "x": pa.array([1.0, 2.0, None])})
    pq.write_table(t, tmp_path / "n.parquet")
    with pytest.raises(ValueError, match="'id'"):
        list(ArrowLoader(tmp_path, columns=["id"]))
    with pytest.raises(ValueError, match="'x'"):
        list(ArrowLoader(tmp_path, columns=["x"]))
    (b,) = ArrowLoader(tmp_path, fill_null=-1)
    assert b["id"].tolist() == [1, -1, 3] and b["x"].tolist() == [1.0, 2.0, -1.0]
    (b,) = ArrowLoader(tmp_path, columns=["id", "x"], fill_null={"id": 0, "x": 0.5})
    assert b["id"].tolist() == [1, 0, 3] and b["x"].tolist() == [1.0, 2.0, 0.5]


@pytest.mark.skipif(int(pa.__version__.split(".")[0]) < 26,
                    reason="pyarrow < 26 cannot read a null fixed-size list back from Parquet")
def test_a_null_fixed_size_list_raises_naming_the_column_unless_filled(tmp_path):
    t = pa.table({"v": pa.array([[1, 2], None, [5, 6]], pa.list_(pa.int32(), 2))})
    pq.write_table(t, tmp_path / "n.parquet")
    with pytest.raises(ValueError, match="'v'"):
        list(ArrowLoader(tmp_path, columns=["v"]))
    (b,) = ArrowLoader(tmp_path, fill_null=-1)
    assert b["v"].tolist() == [[1, 2], [-1, -1], [5, 6]]


@pytest.mark.parametrize("policy", ["file", "row_group", "data", "auto"])
@pytest.mark.parametrize("n", [2, 3])
def test_static_policies_partition_rows(data, policy, n):
    seen = Counter()
    for i in range(n):
        ctx = InputContext(num_input_pipelines=n, input_pipeline_id=i)
        ld = ArrowLoader(ArrowShards(data), ctx, batch_size=64, policy=policy,
                         shuffle=True, seed=3)
        got = ids_of(ld)
        assert len(got) == ld.num_rows
        seen.update(got)
    assert sorted(seen) == list(range(1000)) and set(seen.values()) == {1}


def test_off_gives_every_pipeline_everything_and_file_needs_enough_files(data):
    for i in range(2):
        ctx = InputContext(num_input_pipelines=2, input_pipeline_id=i)
        assert sorted(ids_of(ArrowLoader(data, ctx, batch_size=128, policy="off"))) == list(
            range(1000))
    ctx = InputContext(num_input_pipelines=5, input_pipeline_id=0)
    with pytest.raises(ValueError, match="4 files for 5 pipelines"):
        ArrowLoader(data, ctx, policy="file")
    with pytest.raises(ValueError, match="unknown sharding policy"):
        ArrowLoader(data, policy="bogus")


def test_shuffle_is_deterministic_per_seed_and_epoch(data):
    def order(seed, epoch):
        ld = ArrowLoader(data, batch_size=50, shuffle=True, seed=seed, shuffle_buffer=128)
        ld.set_epoch(epoch)
        return ids_of(ld)

    a = order(0, 0)
    assert a == order(0, 0) and sorted(a) == list(range(1000))
    assert a != list(range(1000))
    assert a != order(0, 1) and a != order(1, 0)
    # rows move across row groups inside the buffer, not only between units
    first = a[:64]
    assert len({i // 64 for i in first}) > 1


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_repeats_and_skips_nothing(data, shuffle, prefetch):
    def make():
        ld = ArrowLoader(data, batch_size=48, shuffle=shuffle, seed=7, prefetch=prefetch,
                         shuffle_buffer=100)
        ld.set_epoch(2)
        return ld

    full = ids_of(make())
    ld = make()
    it = iter(ld)
    head = [next(it)["id"].tolist() for _ in range(7)]
    state = ld.state_dict()
    assert len(json.dumps(state)) < 400 and state["position"] == 7 * 48
    ld.close()

    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    resumed.set_epoch(2)  # the usual training loop: same epoch keeps the position
    tail = ids_of(resumed)
    assert sum(head, []) + tail == full
    assert resumed.state_dict()["position"] == 1000
    assert ids_of(resumed) == full  # the next pass starts the epoch again
    resumed.set_epoch(3)
    assert resumed.state_dict()["position"] == 0


def test_state_of_another_dataset_is_refused(data, tmp_path):
    other = write(tmp_path / "other", files=1, with_extras=False)
    with pytest.raises(ValueError, match="other files"):
        ArrowLoader(data).load_state_dict(ArrowLoader(other).state_dict())
    # a loader is a dataset of its own (its identity is not its files); a state resumes
    # any loader over the same files
    assert ArrowLoader(data, name="a").dataset_id != ArrowLoader(data, name="a").dataset_id
    ArrowLoader(data).load_state_dict(ArrowLoader(ArrowShards(data)).state_dict())


def test_prefetch_memory_is_bounded(tmp_path, monkeypatch):
    write(tmp_path, files=2, rows=640, row_group=32, with_extras=False)  # 40 units
    reads = []
    orig = UnitReader.read

    def counting(self, unit, columns):
        reads.append(unit.index)
        return orig(self, unit, columns)

    monkeypatch.setattr(UnitReader, "read", counting)
    ld = ArrowLoader(tmp_path, batch_size=8, prefetch=2)
    it = iter(ld)
    for _ in range(3):
        next(it)
    # consumed < 1 unit; the producer may hold: current + queued (>= 2 batches) + building
    assert len(reads) <= 3
    rest = sum(len(b["id"]) for b in it)
    assert rest == 1280 - 24 and len(reads) == 40


def test_collate_receives_arrow_tables(data):
    seen = []

    def collate(table):
        assert isinstance(table, pa.Table)
        seen.append(table.num_rows)
        return {"id": torch.from_numpy(table.column("id").to_numpy()),
                "s": table.column("s").to_pylist()}

    ld = ArrowLoader(data, batch_size=300, collate=collate, shuffle=True)
    out = list(ld)
    assert seen == [300, 300, 300, 100]
    assert sorted(torch.cat([b["id"] for b in out]).tolist()) == list(range(1000))
    assert all(b["s"] == [f"r{i}" for i in b["id"].tolist()] for b in out)


def test_errors_in_the_prefetch_thread_reach_the_consumer(data):
    ld = ArrowLoader(data, batch_size=64)
    for path in sorted(data.iterdir())[1:]:
        path.write_bytes(b"garbage")  # the footers were read when the loader was built
    it = iter(ld)
    with pytest.raises(ValueError, match="p01.parquet"):
        while True:
            next(it)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_are_pinned_and_copied(data):
    ld = ArrowLoader(data, batch_size=100, device="cuda")
    b = next(iter(ld))
    assert b["id"].device.type == "cuda" and b["s"][0] == "r0"
    assert b["v"].device.type == "cuda" and b["v"].shape == (100, 3)
    batches = list(ArrowLoader(data, batch_size=100, device="cuda"))
    assert torch.cat([b["id"].cpu() for b in batches]).tolist() == list(range(1000))
    assert all(torch.equal(b["x"].cpu(), b["id"].cpu().float() / 2) for b in batches)


def test_shuffled_batches_stay_valid_while_held(tmp_path):
    write(tmp_path, files=2, rows=600, row_group=50, with_extras=False)

    def run():
        return ArrowLoader(tmp_path, batch_size=40, shuffle=True, seed=5, shuffle_buffer=100)

    dropped = [i for b in run() for i in b["id"].tolist()]  # each batch released at once
    held = list(run())  # every batch kept alive while later blocks are built
    kept = [i for b in held for i in b["id"].tolist()]
    assert kept == dropped and sorted(kept) == list(range(1200))
    assert all(torch.equal(b["x"], b["id"].float() / 2) for b in held)


@pytest.mark.parametrize("buffer", [64, 200])  # one piece a block (2-D gathers), several
def test_shuffle_gathers_columns_of_one_dtype_together_keeping_order(tmp_path, buffer):
    ids = np.arange(500, dtype=np.int64)
    table = pa.table({
        "a": ids.astype(np.float32) / 2,
        "id": ids,
        "b": ids.astype(np.float32) * 2,
        "s": pa.array([f"r{i}" for i in ids]),
        "c": ids.astype(np.float32) + 1,
        "k": ids * 3,
        "v": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 2).astype(np.float64)), 2),
    })
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=64)
    batches = list(ArrowLoader(tmp_path, batch_size=48, shuffle=True, seed=1,
                               shuffle_buffer=buffer))
    seen = []
    for bt in batches:
        assert list(bt) == table.column_names  # the schema's order, whatever the layout
        i = bt["id"]
        assert torch.equal(bt["a"], i.float() / 2) and torch.equal(bt["b"], i.float() * 2)
        assert torch.equal(bt["c"], i.float() + 1) and torch.equal(bt["k"], i * 3)
        assert bt["v"].shape == (len(i), 2) and torch.equal(bt["v"][:, 1], i.double())
        assert bt["s"] == [f"r{j}" for j in i.tolist()]
        assert all(t.is_contiguous() for t in bt.values() if isinstance(t, torch.Tensor))
        seen.extend(i.tolist())
    assert sorted(seen) == list(range(500)) and seen != list(range(500))


def test_reader_keeps_files_open_up_to_its_bound(tmp_path, monkeypatch):
    write(tmp_path, files=3, rows=100, row_group=50, with_extras=False)
    shards = ArrowShards(tmp_path)
    units = shards.units  # footers read (and their files opened) here, before counting
    opened = []
    orig = ArrowShards._open

    def counting(self, path):
        opened.append(path)
        return orig(self, path)

    monkeypatch.setattr(ArrowShards, "_open", counting)
    by_file = {}
    for u in units:
        by_file.setdefault(u.path, []).append(u)
    f0, f1, f2 = (by_file[p] for p in sorted(by_file))
    reader = UnitReader(shards, max_open=2)
    for u in (f0[0], f1[0], f0[1], f1[1]):  # alternating between two files: opened once each
        assert reader.read(u, None).num_rows == 50
    assert len(opened) == 2
    reader.read(f2[0], None)  # a third file evicts the least recently used (f0)
    reader.read(f1[0], None)
    assert len(opened) == 3
    reader.read(f0[0], None)
    assert len(opened) == 4 and opened[-1] == f0[0].path
    reader.close()


def test_chunk_map_tensors_keeps_layout_and_order():
    """What pinning for CUDA does to a gathered chunk, checked with a copy on the CPU."""
    from daskdist.data.convert import convert_chunk

    ids = np.arange(10, dtype=np.int64)
    table = pa.table({"a": ids.astype(np.float32), "id": ids, "b": -ids.astype(np.float32),
                      "s": pa.array([str(i) for i in ids])})
    chunk = convert_chunk(table, index=np.arange(10)[::-1].copy())
    assert chunk.stacks and chunk.rows == 10  # a and b share one 2-D buffer
    copied = chunk.map_tensors(torch.clone)
    orig, new = chunk.slice(2, 7), copied.slice(2, 7)
    assert list(new) == ["a", "id", "b", "s"]
    assert new["id"].tolist() == [7, 6, 5, 4, 3] and new["s"] == ["7", "6", "5", "4", "3"]
    assert torch.equal(new["b"], -new["a"])
    assert all(torch.equal(orig[k], new[k]) for k in ("a", "id", "b"))
    assert new["a"].data_ptr() != orig["a"].data_ptr()
