"""ArrowLoader over Dask collections in one process (a LocalLeaseService, Dask's
synchronous scheduler): every row once under "dynamic", N-D array batches, shuffle,
static policies, columns, fill_null, collate, state_dict, errors that name the
partition, and a TypeError for anything that is not a source."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
import torch

pd = pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")
da = pytest.importorskip("dask.array")

from daskdist.context import InputContext  # noqa: E402
from daskdist.core.leases.partitions import STRIDE  # noqa: E402
from daskdist.data import ArrowLoader, LocalLeaseService  # noqa: E402
from daskdist.data.collections.source import DaskCollection  # noqa: E402
from daskdist.data.sources import as_source  # noqa: E402
from daskdist.errors import InputError  # noqa: E402
from daskdist.session.scope import ClosureScope, closure_scope  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

PARTS = 12
ROWS = 37  # rows per partition (the last partitions shorter, below)


def part_len(i: int) -> int:
    return ROWS - (i % 3) * 5


def make_part(i: int) -> pd.DataFrame:
    n = part_len(i)
    return pd.DataFrame({"id": np.arange(n) + 1000 * i, "x": np.full(n, float(i)),
                         "name": [f"p{i}r{k}" for k in range(n)]})


def frame(parts: int = PARTS):
    return ddf.from_map(make_part, range(parts))


def all_ids(parts: int = PARTS) -> set[int]:
    return {1000 * i + k for i in range(parts) for k in range(part_len(i))}


def drain(loader, svc):
    """Run every batch as a completed closure (acknowledged); ids seen."""
    return drain_iter(iter(loader), svc)


def acked_batches(it, svc):
    """Each batch of ``it``, taken in a closure's scope whose tokens ``svc`` acknowledges."""
    while True:
        scope = ClosureScope()
        with closure_scope(scope):
            try:
                batch = next(it)
            except StopIteration:
                return
        assert svc.ack_tokens(scope.tokens)
        yield batch


def drain_iter(it, svc):
    """:func:`drain` on an iterator already started."""
    seen: Counter = Counter()
    for batch in acked_batches(it, svc):
        seen.update(batch["id"].tolist())
    return seen


def test_a_lazy_frame_streams_every_row_once_under_dynamic():
    svc = LocalLeaseService()
    ld = ArrowLoader(frame(), InputContext(services=svc), batch_size=16)
    assert ld.policy == "dynamic"  # the default for a collection with a lease service
    p = ld.progress()
    assert not p["known"] and p["total"] == 0 and p["units"] == PARTS
    seen = drain(ld, svc)
    assert set(seen) == all_ids() and set(seen.values()) == {1}
    p = ld.progress()
    assert p["complete"] and p["known"] and p["total"] == len(all_ids())


def test_batches_keep_types_strings_become_lists():
    svc = LocalLeaseService()
    ld = ArrowLoader(frame(2), InputContext(services=svc), batch_size=10)
    b = next(iter(ld))
    assert b["id"].dtype == torch.int64 and b["x"].dtype == torch.float64
    assert isinstance(b["name"], list) and b["name"][0] == "p0r0"
    ld.close()


def test_columns_and_shuffle_are_deterministic_per_seed_and_epoch():
    def order(seed, epoch):
        svc = LocalLeaseService()
        ld = ArrowLoader(frame(), InputContext(services=svc), batch_size=8, shuffle=True,
                         seed=seed, columns=["id"])
        ld.set_epoch(epoch)
        out = []
        it = iter(ld)
        for b in it:
            assert list(b) == ["id"]
            out += b["id"].tolist()
        return out

    a = order(0, 0)
    assert sorted(a) == sorted(all_ids()) and a != sorted(a)
    assert order(0, 0) == a and order(0, 1) != a and order(1, 0) != a
    # the partition order is shuffled too, not only rows inside each
    firsts = [i // 1000 for i in a[:: ROWS]]
    assert firsts[:4] != sorted(firsts[:4]) or firsts[0] != 0


def test_a_dict_of_arrays_gives_nd_batches_and_dense_ids():
    x = da.arange(90 * 6, chunks=60).reshape(90, 2, 3).rechunk((20, 1, 3))
    y = da.arange(90, chunks=20)
    svc = LocalLeaseService()
    ld = ArrowLoader({"image": x, "label": y}, InputContext(services=svc), batch_size=16)
    assert ld.num_rows == 90
    p = ld.progress()
    assert p["known"] and p["total"] == 90  # lengths known from the chunks
    labels = []
    for b in acked_batches(iter(ld), svc):
        assert b["image"].shape[1:] == (2, 3) and b["image"].dim() == 3
        assert torch.equal(b["image"][:, 0, 0], b["label"] * 6)
        labels += b["label"].tolist()
    assert sorted(labels) == list(range(90))


def test_static_policies_split_partitions_like_files():
    got = []
    for i in range(3):
        ld = ArrowLoader(frame(), InputContext(3, i, 3), batch_size=10, policy="file")
        got += [v for b in ld for v in b["id"].tolist()]
    assert sorted(got) == sorted(all_ids())
    data = []
    for i in range(2):
        ld = ArrowLoader(frame(), InputContext(2, i, 2), batch_size=10, policy="data")
        data += [v for b in ld for v in b["id"].tolist()]
    assert sorted(data) == sorted(all_ids())
    off = ArrowLoader(frame(), batch_size=10)  # no lease service: "auto", one pipeline
    assert off.policy == "off"  # resolved as for files
    assert sorted(v for b in off for v in b["id"].tolist()) == sorted(all_ids())
    few = ArrowLoader(frame(4), InputContext(9, 0, 9), batch_size=10)  # fewer partitions
    assert few.policy == "data"  # than pipelines: every pipeline keeps its share of rows


def test_state_dict_resumes_a_static_epoch_and_checks_the_collection():
    ld = ArrowLoader(frame(), batch_size=10, shuffle=True, policy="off")
    it = iter(ld)
    first = [v for _ in range(5) for v in next(it)["id"].tolist()]
    state = ld.state_dict()
    ld2 = ArrowLoader(frame(), batch_size=10, shuffle=True, policy="off")
    ld2.load_state_dict(state)
    rest = [v for b in ld2 for v in b["id"].tolist()]
    assert sorted(first + rest) == sorted(all_ids())
    other = ArrowLoader(frame(3), batch_size=10)
    with pytest.raises(ValueError, match="fingerprint"):
        other.load_state_dict(state)


def test_fill_null_and_collate_work_as_for_files():
    def with_nulls(i):
        return pd.DataFrame({"id": [i, i + 100], "v": [1.0, None]})

    df = ddf.from_map(with_nulls, range(3))
    with pytest.raises(ValueError, match="'v'"):
        list(ArrowLoader(df, batch_size=4))
    got = [b for b in ArrowLoader(df, batch_size=6, fill_null=0.0)]
    assert sorted(got[0]["v"].tolist()) == [0.0] * 3 + [1.0] * 3
    tables = list(ArrowLoader(df, batch_size=6, fill_null=0.0, collate=lambda t: t.num_rows))
    assert tables == [6]


def boom_at_3(df):
    if int(df["id"].iloc[0]) // 1000 == 3:
        raise ZeroDivisionError("bad partition")
    return df


def test_an_error_in_the_users_graph_names_the_partition_and_gives_its_rows_back():
    svc = LocalLeaseService()
    df = frame(6).map_partitions(boom_at_3)
    ld = ArrowLoader(df, InputContext(services=svc), batch_size=1000)
    it = iter(ld)
    seen = []
    with pytest.raises(InputError, match="partition 3 .*ZeroDivisionError: bad partition") as e:
        while True:
            scope = ClosureScope()
            with closure_scope(scope):
                b = next(it)
            svc.ack_tokens(scope.tokens)
            seen += b["id"].tolist()
    assert isinstance(e.value.original, ZeroDivisionError)
    ld.close()
    p = ld.progress()
    assert p["leased"] == 0 and not p["complete"]  # nothing stays leased; it goes back


CALLS: Counter = Counter()
CALLS_LOCK = threading.Lock()


def grows_when_recomputed(i):
    """Partition i has one more row each time it is computed (not deterministic)."""
    with CALLS_LOCK:
        CALLS[i] += 1
        n = CALLS[i]
    return pd.DataFrame({"id": np.arange(4 + n) + 1000 * i})


def test_a_recomputed_partition_of_another_length_fails_the_epoch():
    CALLS.clear()
    svc = LocalLeaseService()
    df = ddf.from_map(grows_when_recomputed, range(2))
    ld = ArrowLoader(df, InputContext(services=svc), batch_size=2, partitions_ahead=1)
    it = iter(ld)
    next(it)  # partition 0 computed (5 rows); this closure fails, its worker is lost
    ld.close()
    svc.drop_session()  # its rows go back
    ld2 = ArrowLoader(df, InputContext(services=svc.for_session("b")), batch_size=2)
    ld2.dataset_id = ld.dataset_id
    with pytest.raises(InputError, match=r"partition 0 .* has \d+ rows now and had \d+"):
        list(ld2)
    assert "partition 0" in ld2.progress()["failed"]


def test_anything_else_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="pandas.*DataFrame.*from_pandas"):
        as_source(make_part(0))
    with pytest.raises(TypeError, match="builtins.int"):
        ArrowLoader(3)
    with pytest.raises(TypeError, match="dask Arrays.*'a': 'numpy.ndarray'"):
        as_source({"a": np.zeros(3)})
    with pytest.raises(ValueError, match="chunked differently"):
        DaskCollection.of({"a": da.zeros(10, chunks=5), "b": da.zeros(10, chunks=4)})
    with pytest.raises(ValueError, match=r"\['nope'\] not in"):
        ArrowLoader(frame(), batch_size=2, columns=["nope"])


def test_unknown_lengths_use_strided_ids():
    svc = LocalLeaseService()
    ld = ArrowLoader(frame(3), InputContext(services=svc), batch_size=ROWS)
    it = iter(ld)
    scope = ClosureScope()
    with closure_scope(scope):
        next(it)
    (tok,) = scope.tokens
    assert tok.ranges == [(0, ROWS)]
    with closure_scope(ClosureScope()) as s2:
        next(it)
    assert s2.tokens[0].ranges[0][0] == STRIDE  # partition 1's first row
    ld.close()


def test_a_partitions_arrow_table_is_what_pyarrow_makes_of_the_frame():
    from daskdist.data.collections.partitions import _frame_table

    pa = pytest.importorskip("pyarrow")
    n = 6
    frame = pd.DataFrame({
        "f32": np.array([0.5, np.nan, 2, 3, np.nan, 5], dtype=np.float32),
        "f64": np.arange(n, dtype=np.float64),
        "i8": np.arange(n, dtype=np.int8), "u32": np.arange(n, dtype=np.uint32),
        "b": np.arange(n) % 2 == 0,
        "nullable": pd.array([1, None, 3, 4, None, 6], dtype="Int64"),
        "s": [f"r{k}" if k != 2 else None for k in range(n)],
        "cat": pd.Categorical(list("abcabc")),
        "t": pd.date_range("2026-01-01", periods=n, tz="UTC"),
    })
    want = pa.Table.from_pandas(frame, preserve_index=False)
    got = _frame_table(frame, list(frame.columns))
    assert got.schema.remove_metadata() == want.schema.remove_metadata()
    assert got.to_pydict() == want.to_pydict()  # NaN is null, as pyarrow makes it
    assert got.column("f32").null_count == 2
    sub = _frame_table(frame, ["s", "f64"])
    assert sub.column_names == ["s", "f64"] and sub.equals(want.select(["s", "f64"]))


STARTED: list[int] = []
GATE = threading.Event()


def gated_part(i: int) -> pd.DataFrame:
    """Partition ``i``, logged as it starts; from partition 1 on, computed once ``GATE``
    is set (at most 60 s)."""
    STARTED.append(i)
    if i >= 1:
        GATE.wait(60)
    return pd.DataFrame({"id": np.arange(ROWS) + 1000 * i})


def test_a_reader_computes_the_partition_it_reads_and_partitions_ahead_more():
    """While partition 0 is read, partitions_ahead (2) partitions compute behind it,
    never more: the first batch comes with exactly 3 partitions started (read inline,
    prefetch=0: a prefetch thread would read on, one partition further)."""

    STARTED.clear()
    GATE.clear()
    svc = LocalLeaseService()
    df = ddf.from_map(gated_part, range(6), meta=pd.DataFrame({"id": np.arange(0)}))
    ld = ArrowLoader(df, InputContext(services=svc), batch_size=ROWS, partitions_ahead=2,
                     prefetch=0)
    it = iter(ld)
    try:
        scope = ClosureScope()
        with closure_scope(scope):
            first = next(it)
        assert first["id"].tolist() == list(range(ROWS))
        wait_until(lambda: len(STARTED) >= 3, 30, "two partitions computing ahead")
        assert sorted(STARTED) == [0, 1, 2], STARTED
        assert svc.ack_tokens(scope.tokens)
    finally:
        GATE.set()
    seen = Counter(first["id"].tolist())
    seen.update(drain_iter(it, svc))
    assert set(seen) == {1000 * i + k for i in range(6) for k in range(ROWS)}
    assert set(seen.values()) == {1}
    ld.close()


def test_integer_column_labels_are_the_batch_keys_as_in_pandas():
    """A frame built from a NumPy array (labels 0, 1, 2) gives ``batch[0]``, ``batch[1]``,
    ..., as ``df[0]`` does, under every policy; ``columns=`` and ``fill_null=`` take the
    labels too (each partition failed before: its columns were looked up as strings)."""
    arr = np.arange(60, dtype=np.float64).reshape(20, 3)
    arr[5, 2] = np.nan
    df = ddf.from_pandas(pd.DataFrame(arr), npartitions=4)
    svc = LocalLeaseService()
    ld = ArrowLoader(df, InputContext(services=svc), batch_size=6, fill_null={2: -1.0})
    seen: list = []
    for b in acked_batches(iter(ld), svc):
        assert list(b) == [0, 1, 2]
        seen += b[0].tolist()
        assert (b[1] == b[0] + 1).all() and set(b[2].tolist()) <= set(arr[:, 2]) | {-1.0}
    assert sorted(seen) == arr[:, 0].tolist() and ld.progress()["complete"]
    static = ArrowLoader(df, batch_size=7, columns=[2, 0], fill_null=0.0)
    batches = list(static)
    assert all(list(b) == [2, 0] for b in batches)
    assert sorted(v for b in batches for v in b[0].tolist()) == arr[:, 0].tolist()


def test_a_partition_that_fails_to_convert_fails_the_epoch_naming_it_and_the_column():
    """A null in a numeric column without ``fill_null``: each read gives the
    partition's rows back (deferred, the failure counted) and those computed ahead
    (free), naming the partition and the column; the ``max_worker_failures``-th fails
    the epoch with ``InputError``, which ``progress()`` reports, nothing left leased
    (never leased for good, the epoch neither completing nor failing)."""
    def nan_in_2(i):
        x = np.arange(10, dtype=np.float64) + 100 * i
        if i == 2:
            x[3] = np.nan
        return pd.DataFrame({"id": np.arange(10) + 100 * i, "x": x})

    df = ddf.from_map(nan_in_2, range(6))
    svc = LocalLeaseService()  # max_failures: 3, the coordinator's default
    ld = ArrowLoader(df, InputContext(services=svc), batch_size=5)
    it = iter(ld)
    errors, seen = [], []
    for _ in range(200):
        scope = ClosureScope()
        try:
            with closure_scope(scope):
                b = next(it)
        except StopIteration:
            break
        except (ValueError, InputError) as e:
            errors.append(e)
            assert "partition 2" in str(e) and "'x'" in str(e), e
            assert ld.progress()["leased"] == 0  # given back at once
            if isinstance(e, InputError):
                break
            continue
        assert svc.ack_tokens(scope.tokens)
        seen += b["id"].tolist()
    assert [type(e) for e in errors] == [ValueError, ValueError, InputError]
    assert "3 times" in str(errors[-1])
    p = ld.progress()
    assert not p["complete"] and "partition 2" in p["failed"] and p["leased"] == 0
    assert sorted(seen) == [100 * i + k for i in range(6) if i != 2 for k in range(10)]
    ld.close()


def partition_threads() -> list[threading.Thread]:
    """The partition pools' threads alive now (objects: other loaders' share the names)."""
    return [t for t in threading.enumerate() if t.name.startswith("daskdist-partition")]


def test_closing_a_loader_shuts_its_partition_pool_down():
    """Outside a coordinator a loader computes partitions in threads of its own: closing
    it (or reading its epoch to the end, then closing) ends them, and iterating again
    starts afresh."""
    before = set(partition_threads())
    ld = ArrowLoader(frame(4), batch_size=10, partitions_ahead=2)
    it = iter(ld)
    next(it)
    assert set(partition_threads()) - before
    ld.close()
    wait_until(lambda: not set(partition_threads()) - before, 10, "the pool's threads to end")
    assert sorted(v for b in ld for v in b["id"].tolist()) == sorted(all_ids(4))
    ld.close()
    wait_until(lambda: not set(partition_threads()) - before, 10, "the pool's threads to end")


READS: list[int] = []  # partitions read by read_counted, in this process


def read_counted(i: int) -> pd.DataFrame:
    READS.append(i)
    return pd.DataFrame({"a": np.arange(10.0) + 10 * i})


def test_work_partitions_share_is_done_for_each_unless_persisted():
    """Each partition is computed by itself: a centered column needs the frame's mean,
    which reads every partition, so an epoch of 6 partitions reads 6 x 6; persisted
    first, the frame is read once (by the persist) and the epoch reads nothing again
    (docs/data.md, "Work partitions share")."""
    raw = ddf.from_map(read_counted, range(6))
    centered = raw.assign(c=raw.a - raw.a.mean())
    READS.clear()
    ld = ArrowLoader(centered, batch_size=10)
    rows = sorted(v for b in ld for v in b["a"].tolist())
    assert rows == [float(v) for v in range(60)]
    assert sorted(READS) == sorted(list(range(6)) * 6)
    ld.close()
    READS.clear()
    persisted = centered.persist(scheduler="sync")
    assert sorted(READS) == list(range(6))
    READS.clear()
    ld = ArrowLoader(persisted, batch_size=10)
    assert sum(len(b["c"]) for b in ld) == 60 and READS == []
    ld.close()
