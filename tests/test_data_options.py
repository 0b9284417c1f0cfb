"""A loader's options are checked once, before anything runs: garbage raises
``TypeError`` (wrong type) or ``ValueError`` (out of range) naming the option and the
value, on files, a dask DataFrame and a dict of dask Arrays alike, and through
``Coordinator.distribute_dataset`` on a real LocalCluster (2 worker processes)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import daskdist as dd
from daskdist.data import ArrowLoader, InputContext
from daskdist.data.options import CHECKS, check_options
from tests.conftest import wait_for_workers
from tests.test_imports import loaded_after

ddf = pytest.importorskip("dask.dataframe")
da = pytest.importorskip("dask.array")
pd = pytest.importorskip("pandas")

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]

BAD = [  # (option, value, error, what it says)
    ("batch_size", 2.7, TypeError, "batch_size must be an int, got float 2.7"),
    ("batch_size", 0, ValueError, "batch_size must be between 1 and"),
    ("batch_size", True, TypeError, "batch_size must be an int, got bool True"),
    ("batch_size", "8", TypeError, "batch_size must be an int, got str '8'"),
    ("shuffle", "false", TypeError, "shuffle must be a bool, got str 'false'"),
    ("shuffle", 1, TypeError, "shuffle must be a bool, got int 1"),
    ("drop_last", "no", TypeError, "drop_last must be a bool, got str 'no'"),
    ("seed", 1.5, TypeError, "seed must be an int, got float 1.5"),
    ("seed", False, TypeError, "seed must be an int, got bool False"),
    ("seed", 1 << 64, ValueError, "seed must be between"),
    ("prefetch", -1, ValueError, "prefetch must be between 0 and .*got -1"),
    ("prefetch", 2.0, TypeError, "prefetch must be an int, got float 2.0"),
    ("shuffle_buffer", 0, ValueError, "shuffle_buffer must be between 1"),
    ("policy", "dynamc", ValueError, "unknown sharding policy 'dynamc'"),
    ("policy", 3, TypeError, "policy must be a str"),
    ("columns", "x", TypeError, "columns must be a list of column names, got str 'x'"),
    ("columns", [], ValueError, "columns must name at least one column"),
    ("columns", ["x", "x"], ValueError, "columns names column\\(s\\) 'x' more than once"),
    ("columns", [["x"]], TypeError, "columns must be a list of column names, got \\['x'\\]"),
    ("fill_null", "zero", TypeError, "fill_null must be a number, got str 'zero'"),
    ("fill_null", {"x": "zero"}, TypeError, "fill_null\\['x'\\] must be a number"),
    ("collate", 3, TypeError, "collate must be callable, got int 3"),
    ("device", "cuda 0", ValueError, "device must name a device like .*'cuda 0'"),
    ("device", 1.5, TypeError, "device must be a torch.device.*got float 1.5"),
    ("name", 3, TypeError, "name must be a str, got int 3"),
    ("lease_rows", 0, ValueError, "lease_rows must be between 1"),
    ("lease_rows", 1.5, TypeError, "lease_rows must be an int"),
    ("partitions_ahead", 0, ValueError, "partitions_ahead must be between 1"),
]
IDS = [f"{o}={v!r}" for o, v, _, _ in BAD]


def test_every_loader_option_has_a_check():
    import inspect

    params = inspect.signature(ArrowLoader).parameters
    assert set(CHECKS) == set(params) - {"shards", "ctx"}


@pytest.mark.parametrize(("option", "value", "error", "says"), BAD, ids=IDS)
def test_a_bad_option_is_named_with_its_value(option, value, error, says):
    with pytest.raises(error, match=says):
        check_options({option: value})


def test_good_options_come_back_normalised():
    opts = check_options({"batch_size": np.int64(8), "shuffle": np.True_, "seed": np.int32(3),
                          "columns": ("a", 1), "fill_null": {"a": np.float32(0)},
                          "device": torch.device("cpu"), "policy": None, "prefetch": 0})
    assert opts["batch_size"] == 8 and type(opts["batch_size"]) is int
    assert opts["shuffle"] is True and type(opts["seed"]) is int
    assert opts["columns"] == ("a", 1) and opts["policy"] is None
    assert check_options({"device": "cuda:1"})["device"] == "cuda:1"
    with pytest.raises(TypeError, match="unknown option\\(s\\) 'shufle'; its options are"):
        check_options({"shufle": True}, "distribute_dataset")


def test_the_checks_import_neither_torch_nor_pyarrow():
    loaded = loaded_after("import daskdist.data.options")
    assert "daskdist.data.options" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "pyarrow", "numpy")]


# -- on each kind of source ------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    ids = np.arange(100, dtype=np.int64)
    pq.write_table(pa.table({"x": ids.astype(np.float64), "y": ids}), root / "p.parquet",
                   row_group_size=25)
    return str(root)


def frame():
    return ddf.from_pandas(pd.DataFrame({"x": np.arange(100.0), "y": np.arange(100)}),
                           npartitions=4)


def arrays():
    return {"x": da.arange(100.0, chunks=25), "y": da.arange(100, chunks=25)}


SOURCES = {"files": None, "dataframe": frame, "arrays": arrays}


@pytest.fixture(params=list(SOURCES))
def source(request, files):
    make = SOURCES[request.param]
    return files if make is None else make()


@pytest.mark.parametrize(("option", "value", "error", "says"), BAD, ids=IDS)
def test_arrow_loader_names_a_bad_option_on_each_source(source, option, value, error, says):
    with pytest.raises(error, match=says):
        ArrowLoader(source, **{option: value})


def test_options_are_checked_before_the_source_is_read(tmp_path):
    """A bad option is reported, not the missing files it would have read."""
    with pytest.raises(TypeError, match="batch_size must be an int"):
        ArrowLoader(str(tmp_path / "nothing-here" / "*.parquet"), batch_size=2.7)
    with pytest.raises(TypeError, match="ctx must be an InputContext, got dict"):
        ArrowLoader(str(tmp_path), ctx={"services": None})


def test_fill_null_names_columns_of_the_source(source):
    """A key that is no column (a typo) is named; one of a column not selected is fine
    (one dict for several loaders)."""
    with pytest.raises(ValueError, match="fill_null names column\\(s\\) \\['zz'\\] not in"):
        ArrowLoader(source, fill_null={"zz": 0})
    ArrowLoader(source, columns=["x"], fill_null={"y": 0}).close()
    ld = ArrowLoader(source, batch_size=np.int64(50), shuffle=np.False_, fill_null={"x": 0})
    assert ld.batch_size == 50 and ld.shuffle is False
    assert sorted(int(v) for b in ld for v in b["y"].tolist()) == list(range(100))
    ld.close()


def test_a_device_torch_does_not_know_is_named(source):
    with pytest.raises(ValueError, match="device must name a torch device, got 'gpu'"):
        ArrowLoader(source, device="gpu", ctx=InputContext())


# -- through distribute_dataset on a cluster --------------------------------------------------
DISTRIBUTED_BAD = [  # options a worker's loader would otherwise take, or fail on later
    ({"shuffle": "false"}, TypeError, "shuffle must be a bool, got str 'false'"),
    ({"prefetch": -1}, ValueError, "prefetch must be between 0"),
    ({"policy": "dynamc"}, ValueError, "unknown sharding policy 'dynamc'"),
    ({"drop_last": 1}, TypeError, "drop_last must be a bool, got int 1"),
    ({"shufle": True}, TypeError, "'shufle'"),
]


@pytest.mark.parametrize("kind", ["files", "dataframe"])
def test_distribute_dataset_names_a_bad_option(client, coord, files, kind):
    """The client checks the options before anything is registered: the error names the
    option, and nothing was scheduled; good options train."""
    wait_for_workers(client, coord, 2)
    shards = files if kind == "files" else frame()
    for options, error, says in DISTRIBUTED_BAD:
        with pytest.raises(error, match=says):
            coord.distribute_dataset(shards, global_batch_size=20, **options)
    assert coord.done()  # nothing was scheduled, no error waits
    ds = coord.distribute_dataset(shards, global_batch_size=20, shuffle=False,
                                  policy="dynamic", prefetch=0)
    rows = coord.schedule(lambda it: next(it)["y"].tolist(), args=(iter(ds),)).fetch(
        timeout=60)
    assert len(rows) == 10 and isinstance(ds, dd.DistributedDataset)
