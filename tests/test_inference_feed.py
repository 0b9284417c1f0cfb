"""A member's unit feed (``inference/feed.py``) without a cluster (an in-process lease
service and Dask's synchronous scheduler): every row in exactly one unit, its rows
recorded for the closure that takes it; a partition that cannot be computed given back
deferred, its failure counted and reported while the others are read; units staged
through the device stage (a stand-in transfer whose copies complete late) come out
right; closing gives back what was read ahead."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from daskdist.core.intervals import normalize, size_of
from daskdist.data.leased.service import LocalLeaseService
from daskdist.data.sources import ReadSpec, as_source
from daskdist.data.staging import DeviceStage
from daskdist.inference.engine import batches
from daskdist.inference.feed import UnitFeed
from daskdist.session.scope import ClosureScope, closure_scope
from tests import inference_jobs as jobs
from tests.test_staging import LateTransfer

pytestmark = pytest.mark.timeout(120)
pd = pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")


def feed_of(source, svc, stage=None, failures=None, lease_rows: int = 200) -> UnitFeed:
    src = as_source(source)
    svc.define(src.definition("ds", "test", 0, False))
    spec = ReadSpec(tuple(src.columns), 50, False, 0, 50, None, False, 2, "ds", "test",
                    lease_rows, svc)
    report = None if failures is None else (lambda *a: failures.append(a))
    return UnitFeed(src.open(spec), svc, "ds", "test", stage, on_failure=report)


def drain(feed: UnitFeed) -> tuple[list, list]:
    """Every unit a closure would take now, and the tokens recorded for it."""
    scope = ClosureScope()
    units = []
    with closure_scope(scope):
        while (unit := feed.take()) is not None:
            units.append(unit)
    return units, scope.end()


def test_every_row_in_one_unit_recorded_for_its_closure(tmp_path):
    svc = LocalLeaseService()
    feed = feed_of(jobs.write_files(str(tmp_path), files=3, rows=500, group=100), svc)
    units, tokens = drain(feed)
    rows = [r for u in units for r in u.ranges]
    assert normalize(rows) == [(0, 1500)] and size_of(rows) == 1500  # each row once
    assert all(u.rows == size_of(u.ranges) <= 500 for u in units)
    got = [b["id"].tolist() for u in units for b, _ in batches(u.items, 50)]
    assert sorted(i for ids in got for i in ids) == list(range(1500))
    assert svc.ack_tokens(tokens) and svc.progress("ds", 0)["complete"]
    feed.close()


def bad_part(i: int, bad: int):
    if i == bad:
        raise ZeroDivisionError(f"partition {i} cannot be made")
    return jobs.part(i, 100)


def test_a_partition_that_cannot_be_computed_is_deferred_counted_and_reported():
    svc = LocalLeaseService()
    meta = pd.DataFrame({"id": np.array([], np.int64), "x": np.array([], np.float32)})
    frame = ddf.from_map(functools.partial(bad_part, bad=2), range(5), meta=meta)
    failures: list = []
    feed = feed_of(frame, svc, failures=failures)
    units, tokens = drain(feed)
    assert sorted(u.ranges[0][0] >> 30 for u in units) == [0, 1, 3, 4]
    assert svc.ack_tokens(tokens)
    p = svc.progress("ds", 0)
    assert not p["complete"] and p["free"] == 0  # partition 2: deferred (length unknown)
    ((source, rows, message),) = failures[:1]
    assert source == "partition 2" and rows[0][0] == 2 << 30
    assert "ZeroDivisionError" in message and "partition 2" in message
    feed.close()


def test_units_staged_through_the_device_stage_are_ready_when_taken(tmp_path):
    svc = LocalLeaseService()
    transfer = LateTransfer()
    stage = DeviceStage(transfer, slots=2, max_bytes=4096)  # units staged in row pieces
    feed = feed_of(jobs.write_files(str(tmp_path), files=2, rows=400, group=100), svc, stage)
    units, tokens = drain(feed)
    assert transfer.waits >= len(units) > 0 and transfer.fences
    for u in units:
        for b, n in batches(u.items, 64):
            assert torch.equal(b["x"], (b["id"] / 2).float()) and len(b["id"]) == n
    assert svc.ack_tokens(tokens) and svc.progress("ds", 0)["complete"]
    feed.close()


def test_closing_gives_back_what_was_read_ahead(tmp_path):
    svc = LocalLeaseService()
    feed = feed_of(jobs.write_files(str(tmp_path), files=2, rows=400, group=100), svc)
    with closure_scope(ClosureScope()) as scope:
        first = feed.take()
    assert first is not None
    feed.close()  # the unit read ahead (and its lease) go back
    p = svc.progress("ds", 0)
    assert p["leased"] == first.rows and p["free"] == 800 - first.rows
    assert feed.take() is None
    assert svc.ack_tokens(scope.end())
