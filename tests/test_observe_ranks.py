"""Why is my training slow (SPEC §5.1), on one LocalCluster of 3 worker processes (one
thread each, gloo), with 1 s windows: a rank slowed by a sleep is named the straggler
with cause compute (report, one warning, dashboard panel, Prometheus), a lazy frame whose
partitions take 0.3 s each makes every rank wait on data, a rank blocked in a function of
this file shows in ``coord.stacks()`` and in the hang warning while the others wait in
their allreduce, and a group timeout's ``CollectiveError`` names where the ranks were."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import urllib.request
from pathlib import Path

import dask
import numpy as np
import pytest
import torch
from distributed import Client

import daskdist as dd
from tests.browser import CHROMIUM, browse
from tests.conftest import make_cluster, wait_for_workers, wait_until

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]

SETTINGS = {"daskdist.observe.window": "1s", "daskdist.observe.hang-after": "3s",
            "daskdist.observe.straggler-windows": 3}
SLOW = 0.1  # seconds the straggler sleeps in each step


class Notices(logging.Handler):
    """The warnings the client logs on ``daskdist.observe``, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def of(self, text: str) -> list[str]:
        return [m for m in self.messages if text in m]


@pytest.fixture(scope="module")
def gang():
    """The cluster (its scheduler in this process reads the settings, its workers get
    them at start), a coordinator with a formed group, and the notices it logs."""
    notices = Notices()
    logger = logging.getLogger("daskdist.observe")
    logger.addHandler(notices)
    with dask.config.set(SETTINGS), \
            make_cluster(3, threads=1, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client, name="observed")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=60)
        yield {"client": client, "coord": coord, "notices": notices,
               "base": client.dashboard_link.rsplit("/", 1)[0]}
        coord.close()
    logger.removeHandler(notices)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


# -- a straggler --------------------------------------------------------------------------
def make_state(ctx):
    model = torch.nn.Linear(4, 1)
    return dd.collective.State(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                               step=0)


def straggle(state, stop: str, slow_rank: int, pause: float):
    """A training loop committing every step; rank ``slow_rank`` computes ``pause`` s more
    each step. Stops (on every rank at the same step) once ``stop`` exists."""
    g = dd.collective.get_group()
    state.sync()
    while True:
        state.optimizer.zero_grad()
        state.model(torch.ones(2, 4)).pow(2).mean().backward()
        time.sleep(pause if g.rank == slow_rank else 0.005)  # the slow rank's compute
        dd.collective.allreduce_gradients(state.model, average=True)
        state.optimizer.step()
        state.step += 1
        flag = torch.tensor([float(os.path.exists(stop) or state.step >= 3000)])
        g.allreduce(flag, op="max")
        state.commit()
        if flag.item():
            return state.step


@pytest.fixture(scope="class")
def straggling(gang, tmp_path_factory):
    """A gang whose rank 1 is slow, running until the class's tests are done, once the
    report names its straggler."""
    coord = gang["coord"]
    stop = tmp_path_factory.mktemp("straggler") / "stop"
    state = coord.create_per_worker_resource(make_state)
    run = coord.schedule_on_all(straggle, args=(state, str(stop), 1, SLOW))
    report = wait_until(lambda: (r := coord.report()).stragglers and r, 60,
                        "the report to name a straggler")
    yield {**gang, "report": report}
    stop.touch()
    steps = coord.fetch(run)
    assert len(set(steps)) == 1 and steps[0] > 10


class TestAStraggler:
    def test_the_slow_rank_is_named_with_cause_compute_and_the_others_wait(self,
                                                                          straggling):
        report = straggling["report"]
        (s,) = report.stragglers
        assert s["rank"] == 1 and s["cause"] == "compute", s
        assert s["own_seconds"] >= 1.5 * s["median_seconds"]
        assert s["own_seconds"] >= SLOW
        d = report.to_dict()
        assert set(d) == {"ranks", "stragglers", "bottleneck", "stacks"}
        assert [r["rank"] for r in d["ranks"]] == [0, 1, 2]
        workers = straggling["coord"]._call("daskdist_group_info")["members"]
        for r in d["ranks"]:
            assert r["worker"] == workers[r["rank"]]
            assert r["steps"] > 3
            ph = r["phases"]
            assert sum(ph.values()) == pytest.approx(r["step_seconds"]["median"], rel=0.3)
            assert r["step_seconds"]["p90"] >= r["step_seconds"]["median"] > SLOW * 0.8
            assert ph["commit"] > 0 and r["rows_per_second"] == 0.0  # no loader
            if r["rank"] == 1:
                assert ph["compute"] > ph["collective"], r
            else:  # they wait for rank 1 inside the gradients' allreduce
                assert ph["collective"] > 0.5 * SLOW and ph["collective"] > ph["compute"], r
        assert d["bottleneck"] is None and d["stacks"] is None
        frame = report.to_pandas()
        assert list(frame.index) == [0, 1, 2] and frame.loc[1, "straggler"]
        assert frame.loc[1, "cause"] == "compute" and not frame.loc[0, "straggler"]
        html = report._repr_html_()
        assert "straggler (compute)" in html and "<svg" in html

    def test_one_warning_names_the_rank_its_worker_and_the_cause(self, straggling):
        got = wait_until(lambda: straggling["notices"].of("straggler"), 10, "the warning")
        (msg,) = got  # one episode, one warning
        s = straggling["report"].stragglers[0]
        assert f"straggler: rank 1 ({s['worker']}): " in msg and "cause: compute" in msg
        assert "a step against the median" in msg

    def test_prometheus_names_on_metrics(self, straggling):
        values: dict[tuple, float] = {}  # (name, labels) -> value
        for ln in get(straggling["base"] + "/metrics").splitlines():
            if ln.startswith("daskdist_rank_"):
                series, value = ln.rsplit(" ", 1)
                name, _, labels = series.partition("{")
                pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(","))
                values[(name, tuple(sorted((k, v.strip('"')) for k, v in pairs.items())))] = \
                    float(value)

        def of(name: str, rank: int, **more: str) -> list[float]:
            return [v for (n, labels), v in values.items() if n == name
                    and ("rank", str(rank)) in labels and ("coordinator", "observed") in labels
                    and all((k, w) in labels for k, w in more.items())]

        worker1 = straggling["report"].stragglers[0]["worker"]
        assert of("daskdist_rank_straggler", 1, worker=worker1) == [1.0]
        assert of("daskdist_rank_straggler", 0) == of("daskdist_rank_straggler", 2) == [0.0]
        (step,) = of("daskdist_rank_step_seconds", 1, worker=worker1)
        assert step > SLOW * 0.8
        (compute,) = of("daskdist_rank_phase_seconds_total", 1, phase="compute")
        assert compute > SLOW
        assert of("daskdist_rank_rows_total", 1) == [0.0]  # no loader in this loop
        phases = {dict(labels)["phase"] for (n, labels) in values
                  if n == "daskdist_rank_phase_seconds_total"}
        assert phases == {"data", "collective", "commit", "compute"}
        snap = json.loads(get(straggling["base"] + "/daskdist/status.json"))
        ranks = snap["coordinators"]["observed"]["ranks"]
        assert [s["rank"] for s in ranks["stragglers"]] == [1]
        assert "straggler" in get(straggling["base"] + "/daskdist")

    def test_the_dashboard_panel_marks_the_straggler(self, straggling, tmp_path):
        if CHROMIUM is None:
            pytest.skip("chromium is not installed (.ci/run installs Debian's package)")
        shot = tmp_path / "observe.png"
        probe = """(() => {
          const doc = window.Bokeh && Bokeh.documents && Bokeh.documents[0];
          const fig = doc && doc.get_model_by_name("daskdist-ranks");
          if (!fig) return null;
          const src = fig.renderers[0].data_source;
          return JSON.stringify({ranks: src.get_length() || 0,
                                 labels: fig.y_range.factors});
        })()"""
        result = browse(straggling["base"] + "/daskdist-dashboard", shot, probe,
                        lambda r: r and r["ranks"] == 3 and any("straggler" in f
                                                                for f in r["labels"]))
        print(f"screenshot: {shot} result: {result}")
        assert result and result["ranks"] == 3, result
        (marked,) = [f for f in result["labels"] if "straggler" in f]
        assert marked.startswith("rank 1 ") and "compute" in marked
        assert shot.stat().st_size > 10_000
        keep = os.environ.get("DASKDIST_OBSERVE_SHOT")  # docs/observe.png is taken so
        if keep:
            Path(keep).write_bytes(shot.read_bytes())


# -- a data stall -------------------------------------------------------------------------
def slow_partition(df):
    time.sleep(0.15)  # preprocessing: Dask computes each partition in 0.15 s
    return df


def consume(it) -> int:
    """A training loop over ``synced`` to the epoch's end (so no producer of it is left
    computing partitions into the next test's run): steps of 5 ms compute."""
    n = 0
    for _batch in dd.collective.synced(it):
        time.sleep(0.005)
        n += 1
    return n


def test_a_lazy_frame_of_slow_partitions_makes_every_rank_wait_on_data(gang):
    pd = pytest.importorskip("pandas")
    ddf = pytest.importorskip("dask.dataframe")
    coord = gang["coord"]
    rows = np.arange(900)  # a partition a rank's batch: every step, even the last
    frame = ddf.from_pandas(pd.DataFrame({"x": rows.astype(np.float32), "y": rows}),
                            npartitions=90).map_partitions(slow_partition)
    ds = coord.distribute_dataset(frame, global_batch_size=30, policy="dynamic",
                                  name="lazy")
    steps = coord.fetch(coord.schedule_on_all(consume, args=(iter(ds),)))
    assert steps == [steps[0]] * 3 and 30 <= steps[0] <= 32, steps  # 900 rows, 30 a step
    # the last windows travel on the workers' streams, beside the results
    d = wait_until(lambda: (d := coord.report().to_dict()) and len(d["ranks"]) == 3
                   and all(r["steps"] == steps[0] for r in d["ranks"]) and d, 30,
                   "every rank's last window")
    assert d["bottleneck"] == "data", d
    assert len(d["ranks"]) == 3 and d["stragglers"] == []
    for r in d["ranks"]:
        assert r["data_share"] >= 0.5, r
        assert r["phases"]["data"] > r["phases"]["compute"], r
        assert r["data_source"] == "computing", r  # waiting for Dask, not reading
        assert r["rows_per_second"] > 0


# -- a framework's loop ---------------------------------------------------------------------
def test_a_lightning_fit_shows_the_same_figures(gang, tmp_path):
    """Nothing of Lightning's is hooked: its DDP's gradient allreduce goes through the
    group, its data through ``synced``, its commits through ``State.commit``. The fit
    takes 40 steps, more than the gang run of the test before it: a report whose ranks
    count that many steps is the fit's, not one that has not heard of the fit yet."""
    pytest.importorskip("lightning")
    from tests.framework_rows import write_rows
    from tests.lightning_job import fit, make_module

    coord, n = gang["coord"], 960
    module = coord.create_per_worker_resource(functools.partial(make_module, n=n,
                                                                pause=0.02))
    ds = coord.distribute_dataset(write_rows(tmp_path, n), global_batch_size=24,
                                  policy="dynamic", prefetch=0)
    out = coord.fetch(coord.schedule_on_all(fit, args=(module, iter(ds), 1)))
    assert [rank for rank, _ in out] == [0, 1, 2] and out[0][1] > 30
    d = wait_until(lambda: (d := coord.report().to_dict()) and len(d["ranks"]) == 3
                   and all(r["steps"] >= out[0][1] for r in d["ranks"]) and d, 30,
                   "every rank's last window")
    assert [r["rank"] for r in d["ranks"]] == [0, 1, 2]
    for r in d["ranks"]:
        assert min(r["phases"].values()) > 0, r  # data, DDP's allreduce, commits, compute
        assert r["phases"]["compute"] >= 0.015, r  # the module's 20 ms a step
        assert r["rows_per_second"] > 0 and "data_source" not in r


# -- a hang -------------------------------------------------------------------------------
def blocked_here(release: str, most: float) -> None:
    """This file's function a rank blocks in."""
    deadline = time.monotonic() + most
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)


def hang_in_rank1(release: str, most: float):
    g = dd.collective.get_group()
    if g.rank == 1:
        blocked_here(release, most)
    t = torch.ones(1)
    try:
        g.allreduce(t)
    except dd.CollectiveError as e:
        return str(e)
    return t.item()


def test_a_blocked_rank_shows_in_stacks_and_the_hang_warning(gang, tmp_path):
    coord, notices = gang["coord"], gang["notices"]
    release = tmp_path / "release"
    before = len(notices.of("no step for"))
    run = coord.schedule_on_all(hang_in_rank1, args=(str(release), 60.0))

    def blocked():
        stacks = coord.stacks()
        return (len(stacks) == 3 and "in blocked_here" in stacks[1] and stacks) or None

    stacks = wait_until(blocked, 30, "rank 1 in blocked_here", interval=0.2)
    for rank in (0, 2):  # the others wait in the collective
        assert "in allreduce" in stacks[rank] and "blocked_here" not in stacks[rank]
        assert "in hang_in_rank1" in stacks[rank]
    # hang-after (3 s here) without a step: a warning naming rank 1 where it is
    hang = wait_until(lambda: notices.of("no step for")[before:], 30, "the hang warning")
    workers = coord._call("daskdist_group_info")["members"]
    print("the hang warning:", hang[0])
    assert f"rank 1 ({workers[1]}) is in blocked_here (test_observe_ranks.py:" in hang[0]
    assert "ranks 0, 2 are in hang_in_rank1" in hang[0]
    assert coord.report().stacks[1] == stacks[1] or "blocked_here" in coord.report().stacks[1]
    release.touch()
    assert coord.fetch(run) == [3.0] * 3


def test_a_group_timeout_names_the_rank_stuck_and_where(gang, tmp_path):
    coord = gang["coord"]
    coord.collective_group(timeout=2)  # collective calls give up after 2 (+2) s
    try:
        out = coord.fetch(coord.schedule_on_all(hang_in_rank1,
                                                args=(str(tmp_path / "never"), 6.0)))
    finally:
        coord.collective_group(timeout=60)
    workers = coord._call("daskdist_group_info")["members"]
    print("the timed-out rank's error:", out[0])
    for rank in (0, 2):
        assert "allreduce" in out[rank] and "imed out" in out[rank], out  # gloo's or ours
        assert f"rank 1 ({workers[1]}) is in blocked_here" in out[rank], out
