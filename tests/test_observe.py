"""Status, the /daskdist dashboard page and Prometheus metrics on a real scheduler."""

from __future__ import annotations

import urllib.request

import pytest
from distributed import Client

import daskdist as dd
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
    coord.close()
