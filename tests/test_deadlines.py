"""Preemption deadlines from every source (SPEC §4.6), on a real LocalCluster of 3 worker
processes started with a lifetime (1 h), ``daskdist.preemption.signals: {USR1: 5}``
and the AWS spot and Azure scheduled-event pollers pointed at a local fake metadata
service the test runs.

- Every worker's closures know its lifetime's deadline from the start.
- ``notify_preemption(worker, deadline)`` gives that worker the exact deadline, and no
  other worker any.
- SIGUSR1 gives a running closure its worker's deadline (now + 5 s) within a second.
- The fake service's Azure ``Preempt`` event, then its AWS ``instance-action``, reach
  every worker as their ``NotBefore`` and ``time``.
- A worker with a deadline starts only closures expected to end before it: the others
  run elsewhere.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dask
import pytest
from distributed import Client

import daskdist as dd
from tests.conftest import make_cluster, wait_for_workers, wait_until

pytestmark = pytest.mark.timeout(120)


class FakeMetadata(BaseHTTPRequestHandler):
    """A cloud's instance metadata service: ``notices`` maps a path to the JSON body it
    answers (none: 404, as AWS answers until there is a notice)."""

    notices: dict[str, dict] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = self.notices.get(self.path.split("?")[0])
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def fake():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeMetadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    FakeMetadata.notices.clear()


@pytest.fixture(scope="module")
def client(fake):
    settings = {
        "distributed.worker.lifetime.duration": "1h",
        "distributed.worker.lifetime.stagger": "0s",
        "daskdist.preemption.signals": {"USR1": 5},
        "daskdist.preemption.horizon": "1s",  # the group keeps the notified workers here
        "daskdist.preemption.unknown-duration": "5s",
        "daskdist.preemption.pollers": ["aws", "azure"],
        "daskdist.preemption.poll-interval": "200ms",
        "daskdist.preemption.endpoints": {"aws": f"{fake}/aws", "aws-token": None,
                                          "azure": f"{fake}/azure?api-version=2020-07-01"},
    }
    with dask.config.set(settings), make_cluster(3) as cluster, Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def coord(client):
    co = dd.Coordinator(client, name="deadlines")
    wait_for_workers(client, co, 3)
    co.collective_group(timeout=60)
    yield co
    co.close()


def probe() -> tuple[str, dd.Preemption | None]:
    ctx = dd.get_worker_context()
    return ctx.address, ctx.preemption


def probe_every_worker(coord) -> dict[str, dd.Preemption | None]:
    """Every member's ``ctx.preemption``, read by a closure on it (a gang)."""
    return dict(coord.fetch(coord.schedule_on_all(probe)))


def notices(client) -> dict:
    from daskdist.session.preemption import preemption_of

    return client.run(lambda dask_worker: preemption_of(dask_worker.address))


def test_notify_preemption_gives_its_exact_deadline_to_that_worker_only(coord, client):
    started = time.time()
    before = probe_every_worker(coord)
    assert len(before) == 3
    for notice in before.values():  # the worker lifetime, known at start
        assert notice.reason == "worker lifetime"
        assert started + 3600 - 120 < notice.deadline <= started + 3600
    worker = coord.members()["members"][1]["address"]  # index 1
    deadline = time.time() + 120.123456
    coord.notify_preemption(worker, deadline)
    wait_until(lambda: any(p["reason"] == "notify_preemption"
                           for p in coord.status()["preemptions"]), 30, "the scheduler to hear")
    after = probe_every_worker(coord)
    assert after[worker] == dd.Preemption(deadline, "notify_preemption")  # exactly
    assert {w: p for w, p in after.items() if w != worker} == \
        {w: p for w, p in before.items() if w != worker}
    listed = {p["worker"]: p for p in coord.status()["preemptions"]}
    assert listed[worker]["deadline"] == deadline and listed[worker]["index"] == 1
    with pytest.raises(ValueError, match="tcp://nowhere:1"):
        coord.notify_preemption("tcp://nowhere:1", deadline)


def wait_for_reason(reason: str, started: str, seconds: float) -> tuple:
    """A closure that says where it runs, then waits for a notice of ``reason``."""
    ctx = dd.get_worker_context()
    Path(started).write_text(ctx.address)
    end = time.time() + seconds
    while (ctx.preemption is None or ctx.preemption.reason != reason) and time.time() < end:
        time.sleep(0.01)
    return ctx.address, ctx.preemption, time.time()


def test_usr1_with_a_5_s_lead_reaches_running_closures_within_a_second(coord, client,
                                                                       tmp_path):
    started = tmp_path / "started"
    rv = coord.schedule(wait_for_reason, args=("SIGUSR1", str(started), 30.0))
    wait_until(started.exists, 30, "the closure to start")
    address = started.read_text()
    pid = client.run(os.getpid, workers=[address])[address]
    sent = time.time()
    os.kill(pid, signal.SIGUSR1)
    where, notice, seen = rv.fetch(timeout=60)
    assert where == address and notice.reason == "SIGUSR1"
    assert seen - sent < 1.0, seen - sent
    assert notice.deadline == pytest.approx(sent + 5.0, abs=0.5)
    print(f"SIGUSR1 -> ctx.preemption in the running closure: {seen - sent:.3f} s")


def _rfc1123(t: float) -> str:
    return email.utils.format_datetime(datetime.datetime.fromtimestamp(t, datetime.timezone.utc),
                                       usegmt=True)


def test_cloud_notices_reach_every_worker(coord, client):
    usr1 = {w for w, p in notices(client).items() if p.reason == "SIGUSR1"}
    azure = int(time.time()) + 90
    FakeMetadata.notices["/azure"] = {"DocumentIncarnation": 1, "Events": [
        {"EventId": "1", "EventType": "Freeze", "NotBefore": _rfc1123(azure - 30)},
        {"EventId": "2", "EventType": "Preempt", "ResourceType": "VirtualMachine",
         "EventStatus": "Scheduled", "NotBefore": _rfc1123(azure)}]}
    wait_until(lambda: sum(p.reason == "azure-scheduled-event"
                           for p in notices(client).values()) == 3 - len(usr1), 30,
               "the Azure event on every worker")
    assert {p.deadline for w, p in notices(client).items() if w not in usr1} == {azure}
    aws = int(time.time()) + 60
    FakeMetadata.notices["/aws"] = {"action": "terminate", "time": datetime.datetime.fromtimestamp(
        aws, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    wait_until(lambda: all(p.reason == "aws-spot" for w, p in notices(client).items()
                           if w not in usr1), 30, "the AWS notice on every worker")
    assert {p.deadline for w, p in notices(client).items() if w not in usr1} == {aws}
    listed = {p["worker"]: p for p in coord.status()["preemptions"]}
    assert all(listed[w]["reason"] == "aws-spot" for w in listed if w not in usr1)


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return dd.get_worker_context().address


def test_a_worker_starts_only_closures_that_end_before_its_deadline(coord, client):
    workers = sorted(notices(client))
    coord.fetch([coord.schedule(nap, args=(0.5,)) for _ in range(4)])  # durations known
    near = min(workers, key=lambda w: notices(client)[w].deadline)  # SIGUSR1's, passed
    soon = next(w for w in workers if w != near)
    coord.notify_preemption(soon, time.time() + 2.2)  # 0.5 s + the 2 s margin do not fit
    wait_until(lambda: notices(client)[soon].reason == "notify_preemption", 30,
               "the notice on the worker")
    ran = coord.fetch([coord.schedule(nap, args=(0.5,)) for _ in range(4)])
    far = next(w for w in workers if w not in (near, soon))
    assert set(ran) == {far}, (ran, near, soon)  # only the worker they end on time on
