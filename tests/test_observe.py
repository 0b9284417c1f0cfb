"""Status, the /daskdist dashboard page and Prometheus metrics on a real scheduler."""

from __future__ import annotations

import urllib.request

import pytest
from distributed import Client

import daskdist as dd
from daskdist.plugins.scheduler.web import pages
from tests.conftest import make_cluster, wait_for_workers


def double(x):
    return 2 * x


@pytest.fixture(scope="module")
def dash_client():
    with make_cluster(1, dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        yield c


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_dashboard_page_and_metrics(dash_client):
    coord = dd.Coordinator(dash_client, name="observed")
    wait_for_workers(dash_client, coord, 1)
    assert coord.fetch([coord.schedule(double, args=(i,)) for i in range(7)]) == [
        0, 2, 4, 6, 8, 10, 12]
    base = dash_client.dashboard_link.rsplit("/", 1)[0]
    page = get(base + "/daskdist")
    assert "observed" in page and "done" in page
    metrics = get(base + "/metrics")
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith('daskdist_closures_done_total{coordinator="observed"}'))
    assert float(line.split()[-1]) == 7.0
    assert 'daskdist_workers{coordinator="observed"} 1.0' in metrics
    # per worker closures, recoveries, re-formations, lease expiries: Prometheus names
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
              for ln in metrics.splitlines() if ln.startswith("daskdist_")}
    worker = coord.client.scheduler_info()["workers"]
    (address,) = worker
    assert values[f'daskdist_worker_closures_total{{coordinator="observed",worker="{address}"}}'
                  ] == 7.0
    for name in ("daskdist_recoveries_total", "daskdist_group_reformations_total",
                 "daskdist_lease_expiries_total", "daskdist_group_member_losses_total",
                 "daskdist_group_formation_seconds"):
        assert values[f'{name}{{coordinator="observed"}}'] == 0.0
    # Prometheus naming: counters end in _total (and only there), gauges do not
    names = {n.split("{")[0] for n in values}
    for key in pages.COUNTERS:
        assert f"daskdist_closures_{key}_total" in names, key
    for key in pages.GAUGES:
        assert f"daskdist_{key}" in names and f"daskdist_{key}_total" not in names, key
    assert not [n for n in names if "_total" in n and not n.endswith("_total")]
    coord.close()


def step(it):
    try:
        return len(next(it)["y"])
    except StopIteration:
        return 0


def test_dataset_rows_metric(dash_client, tmp_path):
    from daskdist.cli import write_shards

    write_shards(tmp_path, 1000, 2)
    coord = dd.Coordinator(dash_client, name="rows")
    wait_for_workers(dash_client, coord, 1)
    ds = coord.distribute_dataset(str(tmp_path / "*.parquet"), global_batch_size=100,
                                  policy="dynamic", name="metered")
    it = iter(ds)
    rows = 0
    while not ds.progress()["complete"]:
        rows += sum(coord.fetch([coord.schedule(step, args=(it,)) for _ in range(4)]))
    assert rows == 1000
    base = dash_client.dashboard_link.rsplit("/", 1)[0]
    lines = [ln for ln in get(base + "/metrics").splitlines()
             if ln.startswith("daskdist_dataset") and 'coordinator="rows"' in ln]
    acked = [ln for ln in lines if ln.startswith("daskdist_dataset_rows_acknowledged_total")]
    assert len(acked) == 1 and float(acked[0].split()[-1]) == 1000.0
    assert any('state="acknowledged"' in ln and ln.endswith(" 1000.0") for ln in lines)
    assert any('state="free"' in ln and ln.endswith(" 0.0") for ln in lines)
    coord.close()
