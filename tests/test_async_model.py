"""One model trained asynchronously (``coord.async_model``) on a real LocalCluster of 3
worker processes, 1 and 2 threads each, over real Parquet files with a ``"dynamic"``
dataset: the model reaches its target loss and learns every row exactly once (its
``counts`` parameter, tests/async_rounds.py); a staleness bound refuses deltas and
their rows go back; FedAsync's mixing steps each push from the version it pulled;
SIGKILLs of a non-holder and of the holder mid-epoch lose nothing,
and the replacement that joins contributes; every holder lost without a checkpoint is a
clear error, never a fresh start; a holder given a preemption deadline hands the model
to its standby first, losing no delta."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import numpy as np
import pytest
from distributed import Client

import daskdist as dd
from tests.async_rounds import Counting, local_round, mse_of, sgd, write_rows
from tests.conftest import THREADS, make_cluster, wait_for_workers, wait_until, worker_pids

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]

ROWS = 1200
PAD = 100_000  # 400 kB of parameters: what a pull moves beside the scheduler's bytes


@pytest.fixture(scope="module")
def rows_dir(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("async-rows"), ROWS)


@pytest.fixture(scope="module", params=THREADS, ids=lambda t: f"{t}-threads")
def cl(request):
    with make_cluster(3, threads=request.param) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="async")
        wait_for_workers(client, coord, 3)
        yield cluster, client, coord, request.param
        coord.close()


def make(rows: int = ROWS, pad: int = 0):
    return lambda: Counting(rows, pad)


def drain(coord, ds, am, steps: int = 3, wave: int = 6, during=None, pause: float = 0.0,
          deadline: float = 60.0) -> list[dict]:
    """Rounds until every row of the epoch is acknowledged; each round's outcome."""
    it = iter(ds)
    out: list[dict] = []
    versions = []
    t = time.monotonic()
    while not ds.progress()["complete"]:
        assert time.monotonic() - t < deadline, (ds.progress(), am.report())
        rvs = [coord.schedule(local_round, args=(am.replica, it, steps, pause))
               for _ in range(wave)]
        if during is not None:
            during(ds.progress())
        out += coord.fetch(rvs)
        versions.append(am.version)
    assert versions == sorted(versions), versions  # the version never goes back
    return out


def seen_on_the_scheduler(dask_scheduler) -> tuple[list, dict]:
    """The ``daskdist_async_*`` metrics with their samples, and status.json's models."""
    from daskdist.plugins.scheduler.stats import snapshots
    from daskdist.plugins.scheduler.web.pages import MetricsCollector

    plugin = dask_scheduler.extensions["daskdist"]
    metrics = [(f.name, len(f.samples)) for f in MetricsCollector(plugin).collect()
               if f.name.startswith("daskdist_async")]
    return metrics, {n: s["async_models"] for n, s in snapshots(plugin).items()}


def assert_every_row_once(am) -> dict:
    sd = am.state_dict()
    c = sd["counts"].numpy()
    assert len(c) == ROWS
    assert (c == 1).all(), (f"rows learned 0 times: {int((c == 0).sum())}, more than "
                            f"once: {int((c > 1).sum())}")
    return sd


def test_mixing_steps_from_the_versions_pulled_and_reaches_the_target_loss(cl, rows_dir):
    """FedAsync's mixing on real workers: the holder serves pulls, keeps the versions
    pulled while they can be pushed to, and steps each push from its own base; the model
    reaches the target loss and every row's delta is applied once (the row ledger)."""
    cluster, client, coord, threads = cl
    am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Mixing(),
                           max_staleness=50)
    ds = coord.distribute_dataset(str(rows_dir), global_batch_size=60, shuffle=True,
                                  policy="dynamic")
    before = after = mse_of(am.state_dict(), rows_dir)
    rounds, epochs = [], 0
    while after >= 0.05:  # a push moves the model half of its way: epochs, not one
        assert epochs < 12, (before, after)
        ds.set_epoch(epochs)
        rounds += drain(coord, ds, am)
        epochs += 1
        after = mse_of(am.state_dict(), rows_dir)
    report = am.report()
    assert report["rows"] == epochs * ROWS and report["refused"] == 0
    assert report["applied"] == am.version == sum(r["applied"] for r in rounds)
    assert report["staleness"]["max"] >= 1  # pushes stepped from a version since replaced


@pytest.mark.slow
def test_mixing_goes_on_through_a_sigkill_of_its_holder(cl, rows_dir):
    """The holder that kept the pulled versions is SIGKILLed mid-epoch: its standby takes
    over with none kept (a new incarnation), the pushes of rounds pulled from the lost
    holder step from the current model, and the epoch completes and trains on."""
    cluster, client, coord, threads = cl
    am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Mixing(),
                           max_staleness=50)
    ds = coord.distribute_dataset(str(rows_dir), global_batch_size=30, policy="dynamic")
    killed: list[str] = []

    def during(p):
        if not killed and p["acknowledged"] > ROWS // 3:
            holder = am.holders()[0]
            os.kill(worker_pids(client)[holder], signal.SIGKILL)
            killed.append(holder)

    before = mse_of(am.state_dict(), rows_dir)
    drain(coord, ds, am, steps=2, during=during, pause=0.01, deadline=90)
    ds.set_epoch(1)
    drain(coord, ds, am, steps=2, deadline=90)
    report = am.report()
    assert killed and report["holder_losses"] == 1 and report["incarnation"] >= 1
    assert am.holders()[0] != killed[0]
    assert mse_of(am.state_dict(), rows_dir) < before / 2
    wait_for_workers(client, coord, 3)


def test_one_model_reaches_its_target_loss_with_every_row_once(cl, rows_dir):
    cluster, client, coord, threads = cl
    am = coord.async_model(model=make(pad=PAD), optimizer=sgd,
                           outer=dd.asynchronous.Average(), max_staleness=50)
    ds = coord.distribute_dataset(str(rows_dir), global_batch_size=60, shuffle=True,
                                  policy="dynamic")
    before = mse_of(am.state_dict(), rows_dir)
    rounds = drain(coord, ds, am)
    sd = assert_every_row_once(am)
    after = mse_of(sd, rows_dir)
    assert after < 0.05 < before, (before, after)  # one model, trained by every worker
    assert sum(r["rows"] for r in rounds if r["applied"]) == ROWS
    report = am.report()
    assert report["applied"] == am.version == sum(r["applied"] for r in rounds)
    assert report["rows"] == ROWS
    # the last pushes (an empty round's) are durable at the holder's next idle copy
    wait_until(lambda: am.report()["open_pushes"] == 0, 10, "every push durable")
    workers = {w["address"]: w for w in report["workers"]}
    assert len(workers) == 3 and all(w["rounds"] > 0 for w in workers.values()), workers
    assert report["staleness"]["max"] >= report["staleness"]["p90"] >= 0
    assert report["versions_per_second"] > 0
    # pulls and pushes go worker to worker: the scheduler carries under 1% of the bytes
    nbytes = report["model_bytes"]
    assert nbytes >= 4 * PAD
    assert nbytes <= report["bytes_per_round"] <= 2.1 * nbytes
    assert report["scheduler_bytes_per_round"] < 0.01 * nbytes, report
    holder, standby = am.holders()
    assert {holder, standby} <= set(client.scheduler_info()["workers"]) and holder != standby
    assert coord.status()["async_models"][am.model_id]["version"] == am.version
    metrics, models = client.run_on_scheduler(seen_on_the_scheduler)
    names = dict(metrics)
    assert names["daskdist_async_version"] >= 1 and names["daskdist_async_worker_rows"] >= 3
    assert {"daskdist_async_versions_per_second", "daskdist_async_staleness",
            "daskdist_async_deltas_refused", "daskdist_async_bytes_per_round"} <= set(names)
    shown = {r["model"]: r for r in models["async"]}
    assert shown[am.model_id]["version"] == am.version  # on /daskdist/status.json
    # each closure thread trains its own replica, kept across rounds
    by_thread = defaultdict(set)
    for r in rounds:
        by_thread[r["thread"]].add(r["model"])
    assert all(len(models) == 1 for models in by_thread.values()), by_thread
    assert len({m for models in by_thread.values() for m in models}) == len(by_thread)


def _copy_policy(settings: dict) -> dict:
    """Set the holder's copy policy in this process (a worker's): the old values."""
    import dask

    old = {k: dask.config.get(k) for k in settings}
    dask.config.set(settings)
    return old


def test_an_epoch_ends_with_the_copy_of_its_last_rows_not_at_an_idle_timer(cl, rows_dir):
    """A row is acknowledged once the standby's copy holds its delta. With copies due
    only after a minute (every timer of the copy policy), the epoch still ends at once:
    the push of its last rows is copied as soon as it is applied; the second epoch too."""
    cluster, client, coord, threads = cl
    slow = {"daskdist.asynchronous.standby-idle": "60s",
            "daskdist.asynchronous.standby-interval": "60s",
            "daskdist.asynchronous.standby-every": 100_000}
    old = client.run(_copy_policy, slow)
    try:
        am = coord.async_model(model=make(), optimizer=sgd,
                               outer=dd.asynchronous.Average(), max_staleness=50)
        ds = coord.distribute_dataset(str(rows_dir), global_batch_size=60, shuffle=True,
                                      policy="dynamic")
        for epoch in range(2):
            ds.set_epoch(epoch)
            t = time.monotonic()
            drain(coord, ds, am, deadline=30)  # asserts the end within 30 s, not 60
            took = time.monotonic() - t
            assert ds.progress(epoch)["complete"] and took < 30, took
            c = am.state_dict()["counts"].numpy()
            assert (c == epoch + 1).all(), np.unique(c, return_counts=True)
    finally:
        client.run(lambda: _copy_policy(next(iter(old.values()))))


def test_a_staleness_bound_refuses_deltas_and_their_rows_go_back(cl, rows_dir):
    cluster, client, coord, threads = cl
    am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average(),
                           max_staleness=0)
    ds = coord.distribute_dataset(str(rows_dir), global_batch_size=60, policy="dynamic")
    rounds = drain(coord, ds, am, steps=2, wave=9, pause=0.005)
    refused = [r for r in rounds if not r["applied"]]
    odd = [r["reason"] for r in refused if r["staleness"] < 1 or "stale" not in r["reason"]]
    assert refused and not odd, odd[:3]
    assert_every_row_once(am)  # the refused rows went back and were learned later
    report = am.report()
    assert report["refused"] == len(refused) and report["rows_released"] > 0
    assert report["staleness"]["max"] == 0  # no applied delta was stale


@pytest.mark.slow
def test_sigkill_of_a_non_holder_then_of_the_holder_mid_epoch(cl, rows_dir):
    """The replacement of the killed non-holder joins and contributes; the holder's
    loss loses at most the deltas since its standby's copy, whose rows go back."""
    cluster, client, coord, threads = cl
    am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average(),
                           max_staleness=50)
    ds = coord.distribute_dataset(str(rows_dir), global_batch_size=30, policy="dynamic")
    before = set(worker_pids(client))
    killed: dict[str, str] = {}

    def during(p):
        pids = worker_pids(client)
        if "other" not in killed and p["acknowledged"] > ROWS // 5:
            holder, standby = am.holders()
            other = sorted(set(pids) - {holder, standby})[0]
            os.kill(pids[other], signal.SIGKILL)
            killed["other"] = other
            wait_until(lambda: len(set(worker_pids(client)) - before) == 1, 60,
                       "the replacement")
        elif "holder" not in killed and "other" in killed and p["acknowledged"] > ROWS // 2:
            holder = am.holders()[0]
            os.kill(pids[holder], signal.SIGKILL)
            killed["holder"] = holder

    drain(coord, ds, am, steps=2, during=during, pause=0.01, deadline=90)
    assert set(killed) == {"other", "holder"}
    assert_every_row_once(am)
    report = am.report()
    assert report["holder_losses"] == 1 and report["incarnation"] >= 1
    assert am.holders()[0] != killed["holder"]
    joined = set(worker_pids(client)) - before
    contributed = {w["address"] for w in report["workers"] if w["rounds"]}
    assert joined & contributed, (joined, report["workers"])  # a joiner pulls and pushes
    wait_for_workers(client, coord, 3)


def test_every_holder_lost_without_a_checkpoint_is_a_clear_error(cl, rows_dir):
    cluster, client, coord, threads = cl
    am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average())
    ds = coord.distribute_dataset(str(rows_dir), global_batch_size=30, policy="dynamic")
    it = iter(ds)
    coord.fetch([coord.schedule(local_round, args=(am.replica, it, 2)) for _ in range(3)])
    wait_until(lambda: am.report()["durable"] > 0, 30, "a durable version")
    pids = worker_pids(client)
    for address in am.holders():
        os.kill(pids[address], signal.SIGKILL)
    wait_until(lambda: am.report()["phase"] == "failed", 30, "the model to fail")
    with pytest.raises(RuntimeError, match="no checkpoint_to was set"):
        am.version  # noqa: B018 - the client's call raises
    rv = coord.schedule(local_round, args=(am.replica, it, 2))
    with pytest.raises(RuntimeError, match="every holder of asynchronous model"):
        rv.fetch(timeout=60)
    with pytest.raises(RuntimeError):
        coord.join(timeout=60)  # the closure's error, raised to its owner
    wait_for_workers(client, coord, 3)


def test_bad_settings_are_refused_before_anything_is_registered(cl):
    cluster, client, coord, threads = cl
    before = coord.status()
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        coord.async_model(model=make(), optimizer=sgd, max_staleness=-1)
    with pytest.raises(TypeError, match="outer must be an outer optimizer"):
        coord.async_model(model=make(), optimizer=sgd, outer=sgd)
    with pytest.raises(TypeError, match="model must be a callable"):
        coord.async_model(model=Counting(3), optimizer=sgd)
    status = coord.status()
    assert status["resources"] == before["resources"]
    assert status["async_models"] == before["async_models"]


def test_a_model_factory_that_differs_between_workers_names_the_parameter(cl, tmp_path):
    cluster, client, coord, threads = cl
    flag = str(tmp_path / "other-model")
    am = coord.async_model(model=lambda: Counting(ROWS, 16 if os.path.exists(flag) else 0),
                           optimizer=sgd, outer=dd.asynchronous.Average())
    open(flag, "w").close()  # every replica built from now on has another 'pad'
    rv = coord.schedule(local_round, args=(am.replica, iter([]), 1))
    with pytest.raises(ValueError, match="parameter 'pad'"):
        rv.fetch(timeout=60)
    with pytest.raises(ValueError):
        coord.join(timeout=60)
    assert np.all(am.state_dict()["counts"].numpy() == 0)  # nothing was applied


def pull_after_local_steps(replica) -> tuple[int, int, float]:
    """Pull, move the weights as inner steps would, pull the same version again: the
    versions and what the counts hold after the second pull."""
    import torch

    first = replica.pull()
    with torch.no_grad():
        replica.model.counts.add_(1.0)
    second = replica.pull()
    return first, second, float(replica.model.counts.abs().sum())


def test_a_pull_of_the_version_held_restores_the_pulled_weights(cl):
    """A worker whose version is current fetches nothing, yet its module goes back to
    the weights pulled: a delta is measured from them (never twice the same steps)."""
    cluster, client, coord, threads = cl
    am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average())
    first, second, moved = coord.schedule(pull_after_local_steps,
                                          args=(am.replica,)).fetch(timeout=60)
    assert first == second == am.version
    assert moved == 0.0


def test_a_holder_with_a_deadline_hands_the_model_over_first(cl, rows_dir):
    """``notify_preemption`` to the holder's worker mid-epoch: its standby takes the
    model from the holder's last copy (no holder lost, no applied delta lost) and the
    worker with the deadline keeps no role. Last in the module: the deadline stays."""
    cluster, client, coord, threads = cl
    am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average(),
                           max_staleness=50)
    ds = coord.distribute_dataset(str(rows_dir), global_batch_size=60, policy="dynamic")
    moved: dict = {}

    def during(p):
        if not moved and p["acknowledged"] > ROWS // 4:
            holder, standby = am.holders()
            coord.notify_preemption(holder, time.time() + 120)
            wait_until(lambda: am.info()["holder"] == standby, 20, "the hand-over")
            moved.update(holder=holder, standby=standby)

    drain(coord, ds, am, steps=2, during=during, pause=0.005)
    assert moved
    assert_every_row_once(am)
    report = am.report()
    assert (report["handovers"], report["holder_losses"], report["rows_lost"]) == (1, 0, 0)
    assert am.holders()[0] == moved["standby"] and moved["holder"] not in am.holders()


def test_the_mixed_speed_example_trains_one_model_on_this_cluster(cl):
    """``examples/async_mixed_speed.py`` against a running scheduler, at a small size:
    one model, every epoch's rows acknowledged, no delta refused, the loss down."""
    import pathlib
    import re
    import subprocess
    import sys

    cluster, client, coord, threads = cl
    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / \
        "async_mixed_speed.py"
    out = subprocess.run(
        [sys.executable, str(example), "--scheduler", cluster.scheduler_address,
         "--rows", "6000", "--epochs", "2", "--step-ms", "1", "--steps", "10"],
        capture_output=True, text=True, timeout=90, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"2 epochs of 6,000 rows .* (\d+) refused.*loss ([\d.]+) -> ([\d.]+)",
                  out.stdout)
    assert m, out.stdout
    assert int(m[1]) == 0 and float(m[3]) < float(m[2]) / 2, out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("tcp://")]
    assert len(rows) == 3 and sum(int(r[2]) for r in rows) == 2 * 6000, out.stdout


def apply_threads(model_id: str) -> int:
    """Threads of this worker applying pushes to model ``model_id`` (its holder's)."""
    import threading

    return sum(t.name.startswith(f"daskdist-async-apply-{model_id}")
               for t in threading.enumerate())


def test_a_coordinator_closed_with_rounds_in_flight_lets_its_model_go_beside_another(
        cl, rows_dir):
    """Two more coordinators on the same client, each with a model: the first is closed
    while its rounds run. Its rounds end (``fetch`` raises, naming it), its holder lets
    the model go (no apply thread of it left on any worker), and the second's model,
    trained meanwhile, learns every row once; a new coordinator of the first's name then
    trains a model of its own, every row once again."""
    cluster, client, coord, threads = cl
    first = dd.Coordinator(client, name="async-closed")
    second = dd.Coordinator(client, name="async-beside")
    try:
        models = [c.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average(),
                                max_staleness=50) for c in (first, second)]
        sets = [c.distribute_dataset(str(rows_dir), global_batch_size=30, policy="dynamic")
                for c in (first, second)]
        it = iter(sets[0])
        in_flight = [first.schedule(local_round, args=(models[0].replica, it, 3, 0.2))
                     for _ in range(30)]  # seconds of rounds: most run or wait at close
        wait_until(lambda: models[0].version >= 1, 60, "the first model's first version")
        gone = models[0].model_id
        assert sum(client.run(apply_threads, gone).values()) == 1  # its holder applies
        beside = second.schedule(local_round, args=(models[1].replica, iter(sets[1]), 3))
        first.close()
        with pytest.raises(dd.CoordinatorClosedError, match="async-closed"):
            first.fetch(in_flight)
        wait_until(lambda: sum(client.run(apply_threads, gone).values()) == 0, 30,
                   "the closed coordinator's holder letting its model go")
        second.fetch(beside)
        drain(second, sets[1], models[1])
        assert_every_row_once(models[1])
        assert models[1].report()["holder_losses"] == 0

        again = dd.Coordinator(client, name="async-closed")
        am = again.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average(),
                               max_staleness=50)
        assert am.model_id != gone
        drain(again, again.distribute_dataset(str(rows_dir), global_batch_size=30,
                                              policy="dynamic"), am)
        assert_every_row_once(am)
        again.close()
    finally:
        first.close()
        second.close()


def test_a_model_whose_handle_is_dropped_goes_once_the_rounds_before_finish(cl, rows_dir):
    """A notebook's cell run again makes a new model: the old one, its handle dropped
    (``am`` and ``am.replica`` garbage collected), goes like a per-worker resource: the
    rounds scheduled before the drop finish and are applied, then its holder lets it go
    (no apply thread of it left) while the coordinator's other model trains on."""
    import gc

    cluster, client, coord, threads = cl
    kept = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average(),
                             max_staleness=50)
    am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average(),
                           max_staleness=50)
    gone = am.model_id
    ds = coord.distribute_dataset(str(rows_dir), global_batch_size=30, policy="dynamic")
    it = iter(ds)
    before = [coord.schedule(local_round, args=(am.replica, it, 2, 0.05)) for _ in range(6)]
    wait_until(lambda: sum(client.run(apply_threads, gone).values()) == 1, 60,
               "the model's holder applying a push")
    del am
    gc.collect()
    assert all(r["applied"] for r in coord.fetch(before))  # its rounds were not cut short
    wait_until(lambda: sum(client.run(apply_threads, gone).values()) == 0, 30,
               "the dropped model's holder letting it go")
    assert gone not in str(coord.status()["async_models"])
    ds2 = coord.distribute_dataset(str(rows_dir), global_batch_size=30, policy="dynamic")
    drain(coord, ds2, kept)
    assert_every_row_once(kept)


LEASE = 3.0  # seconds: short, so the SIGSTOP test stays fast


@pytest.mark.slow
def test_a_sigstopped_holder_is_fenced_its_standby_takes_over_and_woken_it_serves_nothing(
        rows_dir):
    """The holder SIGSTOPped mid-epoch past its lease (3 workers, 2 threads each): its
    session is fenced, its standby takes over from its copy (the deltas since go, their
    rows back to the pool) and the rounds go on. Woken, the old holder rejoins as a new
    session and its stale state changes nothing: every row of that epoch and of the next
    is learned exactly once, the version never goes back."""
    import dask

    with dask.config.set({"daskdist.liveness.lease-timeout": f"{LEASE}s",
                          "daskdist.liveness.renew-interval": "200ms"}), \
            make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="async-stop")
        wait_for_workers(client, coord, 3)
        pids = worker_pids(client)
        am = coord.async_model(model=make(), optimizer=sgd, outer=dd.asynchronous.Average(),
                               max_staleness=50)
        ds = coord.distribute_dataset(str(rows_dir), global_batch_size=30, policy="dynamic")
        stopped: list = []

        def during(p):
            if not stopped and p["acknowledged"] > ROWS // 4:
                holder = am.holders()[0]
                os.kill(pids[holder], signal.SIGSTOP)
                stopped.append((holder, time.monotonic()))
            elif len(stopped) == 1 and time.monotonic() > stopped[0][1] + 2 * LEASE:
                os.kill(pids[stopped[0][0]], signal.SIGCONT)
                stopped.append(None)

        try:
            drain(coord, ds, am, steps=2, during=during, pause=0.02, deadline=90)
        finally:
            if len(stopped) == 1:
                os.kill(pids[stopped[0][0]], signal.SIGCONT)
        assert stopped, "the epoch ended before the holder was stopped"
        assert_every_row_once(am)
        report = am.report()
        assert report["holder_losses"] == 1 and report["incarnation"] >= 1, report
        assert am.holders()[0] != stopped[0][0]
        assert coord.status()["lease_expiries"] >= 1
        wait_for_workers(client, coord, 3)  # the woken worker back, a new session
        version = am.version
        ds.set_epoch(1)
        drain(coord, ds, am, steps=2, deadline=90)
        counts = am.state_dict()["counts"].numpy()
        assert (counts == 2).all(), (f"rows learned other than twice: "
                                     f"{int((counts != 2).sum())}")
        assert am.version > version
        coord.close()


@pytest.mark.slow
def test_the_holder_retired_mid_epoch_loses_no_row(rows_dir):
    """``client.retire_workers`` on the holder's worker (a scale-down) mid-epoch, 3
    workers with 2 threads each: Dask removes it as soon as its data moved, the standby
    takes over from its copy, every row is learned once, and the next epoch trains on
    the two left, every row once again."""
    with make_cluster(3, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="async-retire")
        wait_for_workers(client, coord, 3)
        am = coord.async_model(model=make(), optimizer=sgd,
                               outer=dd.asynchronous.Average(), max_staleness=50)
        ds = coord.distribute_dataset(str(rows_dir), global_batch_size=30, policy="dynamic")
        retired: list[str] = []

        def during(p):
            if not retired and p["acknowledged"] > ROWS // 3:
                retired.append(am.holders()[0])
                client.retire_workers([retired[0]], close_workers=True)

        drain(coord, ds, am, steps=2, during=during, pause=0.01, deadline=90)
        assert retired and retired[0] not in am.holders()
        assert_every_row_once(am)
        wait_until(lambda: retired[0] not in client.scheduler_info()["workers"], 30,
                   "the retired worker gone")
        ds.set_epoch(1)
        rounds = drain(coord, ds, am, steps=2, deadline=90)
        assert retired[0] not in {r["thread"][0] for r in rounds}
        assert (am.state_dict()["counts"].numpy() == 2).all()
        assert len(am.holders()) == 2  # a holder and a standby on the two left
        coord.close()
