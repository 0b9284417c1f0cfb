"""``dd.collective.synced`` (SPEC §4.2): a batch taken but never trained is given back
by identity, in the closure that took it, whatever runs meanwhile (a framework's
fetch-ahead, a garbage collector finalizing an old fit's generator in the thread of a
later closure). A one-member gloo group in a process of its own, a real dynamic loader
over Parquet on an in-process lease table (``LocalLeaseService``)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.processes import process_context

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")]

ROWS = 200


def _rows(tokens) -> list[int]:
    return sorted(i for t in tokens for a, b in t.ranges for i in range(a, b))


def _late_finalizers(path: str, out_q) -> None:
    """Two closures on one worker, as a gang's first run and its re-run after a failure:
    the first run's generators are closed while the second trains (what a garbage
    collection of the first fit's objects does there)."""
    import torch

    from daskdist.collective import create_store, destroy_member, init_member, synced
    from daskdist.data import ArrowLoader, InputContext, LocalLeaseService
    from daskdist.integrations.common import TokenHold
    from daskdist.session.scope import ClosureScope, closure_scope
    from daskdist.session.tokens import take_consumed

    torch.set_num_threads(1)
    host, port = create_store(1, "127.0.0.1")
    init_member(0, 1, host, port, "gloo", 1, 30.0)
    out = {}
    try:
        svc = LocalLeaseService()
        ld = ArrowLoader(path, InputContext(services=svc), batch_size=10, policy="dynamic",
                         prefetch=0)
        it = iter(ld)

        def leased() -> int:
            return svc.progress(ld.dataset_id, ld.epoch)["leased"]

        # run 1: Lightning's order (a batch fetched ahead of the one that trains); the
        # step of batch 2 fails, and the fit's teardown gives back batch 3
        first = ClosureScope(services=svc)
        with closure_scope(first):
            hold = TokenHold()
            lightning = hold.wrap(synced(it))
            next(lightning), next(lightning)  # batch 1; batch 2 fetched ahead
            hold.started()  # batch 1 trains ...
            svc.ack_tokens(take_consumed())  # ... and is committed
            next(lightning)  # batch 3 fetched ahead
            hold.started()  # batch 2 trains: the step fails here
            hold.release()  # teardown: batch 3 back to the pool
            # Hugging Face's order (no fetch-ahead): a batch taken, its step failed
            hf = synced(it)
            next(hf)  # batch 4
        svc.release_tokens(first.end())  # the failed closure: batches 2 and 4 back
        out["acknowledged"] = svc.progress(ld.dataset_id, ld.epoch)["acknowledged"]

        # run 2 (the re-run): a batch starts training, then the old generators are
        # finalized in this thread (this closure's context)
        second = ClosureScope(services=svc)
        with closure_scope(second):
            hold2 = TokenHold()
            batches = hold2.wrap(synced(it))
            next(batches), next(batches)
            hold2.started()  # this batch trains: its rows are this commit's
            training = list(second.tokens)
            leased_before = leased()
            lightning.close()
            hf.close()
            out["kept"] = [t is u for t, u in zip(second.tokens, training, strict=True)] \
                if len(second.tokens) == len(training) else False
            out["leased_delta"] = leased() - leased_before
            out["training_rows"] = _rows(training)
            # in its own closure, a synced generator closed before its batch trained
            # gives that batch back
            own = synced(it)
            taken = next(own)["id"].tolist()
            before = leased()
            own.close()
            out["own_given_back"] = (before - leased(), len(taken))
            out["own_left"] = [t for t in second.tokens if t not in training]
            hold2.release()
            batches.close()
    finally:
        destroy_member()
    out_q.put(out)


def test_a_late_finalized_generator_gives_back_only_its_own_batch(tmp_path):
    ids = np.arange(ROWS, dtype=np.int64)
    pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float32)}),
                   tmp_path / "rows.parquet", row_group_size=10)
    ctx = process_context()
    q = ctx.Queue()
    p = ctx.Process(target=_late_finalizers, args=(str(tmp_path / "rows.parquet"), q))
    p.start()
    try:
        out = q.get(timeout=150)
    finally:
        p.join(30)
    assert out["acknowledged"] == 10  # run 1: batch 1 committed
    # the re-run's training batch kept its tokens: the old generators took none of them,
    # and none of its rows went back to the pool
    assert out["kept"] == [True], out
    assert out["leased_delta"] == 0, out
    assert len(out["training_rows"]) == 10
    assert out["own_given_back"] == (10, 10)  # its own closure: its batch, back
    assert out["own_left"] == []


# -- string columns at the epoch's tail ---------------------------------------------------


def test_the_tail_pools_and_splits_a_string_column_with_its_rows():
    """A list holding no tensor is a column of rows (strings, objects): concatenated and
    sliced with the tensors; lists and tuples of tensors stay nested fields."""
    import torch

    from daskdist.collective.step.synced import _share

    def batch(ids):
        t = torch.tensor(ids, dtype=torch.int64)
        return {"id": t, "text": [f"row-{i}" for i in ids], "tags": [[i, "t"] for i in ids],
                "pair": (t * 2, [float(i) for i in ids]), "nested": {"x": t.float()},
                "fields": [t, t + 1]}

    pooled = [batch([0, 1, 2]), batch([3, 4]), batch([])]
    shares = [_share(pooled, r, 3, torch.device("cpu")) for r in range(3)]
    assert [s["id"].tolist() for s in shares] == [[0], [1, 2], [3, 4]]
    for s in shares:
        ids = s["id"].tolist()
        assert s["text"] == [f"row-{i}" for i in ids]
        assert s["tags"] == [[i, "t"] for i in ids]
        assert s["pair"][0].tolist() == [2 * i for i in ids]
        assert s["pair"][1] == [float(i) for i in ids]
        assert s["nested"]["x"].tolist() == [float(i) for i in ids]
        assert [f.tolist() for f in s["fields"]] == [ids, [i + 1 for i in ids]]
    # a batch that is a column of rows itself
    assert _share([["a", "b"], ["c"]], 1, 2, torch.device("cpu")) == ["b", "c"]


def _train_text(state, it, k: int):
    """Rank 0 stops after ``k`` batches, the others go on: the steps after pool the
    batches taken and split them (the epoch's tail, every run). Every step checks that
    the string column came with its rows; a commit per step counts the ids."""
    import itertools

    import torch

    import daskdist as dd

    g = dd.collective.get_group()
    state.sync()
    steps = 0
    mine = itertools.islice(it, k) if g.rank == 0 else it
    for batch in dd.collective.synced(mine):
        ids, text = batch["id"], batch["text"]
        assert isinstance(text, list) and len(text) == len(ids), (len(text), len(ids))
        assert text == [f"row-{i}" for i in ids.tolist()], (text, ids)
        c = torch.bincount(ids, minlength=state.counts.numel()).to(torch.float64)
        g.allreduce(c)
        state.counts += c.to(state.counts.device)
        state.commit()
        steps += 1
    return steps


@pytest.mark.parametrize("threads", [1, 2])
def test_synced_training_on_a_string_column_every_row_once(tmp_path, threads):
    """3 workers, a Parquet file with a string column, a dynamic epoch trained under
    synced with a pooled tail step in every run: the text stays with its row, every row
    is trained exactly once."""
    import functools

    from distributed import Client

    import daskdist as dd
    from tests.conftest import make_cluster, wait_for_workers
    from tests.row_ledger import assert_every_row_once, final_counts, make_counts

    n, k = 600, 3
    ids = np.arange(n, dtype=np.int64)
    pq.write_table(pa.table({"id": ids, "text": [f"row-{i}" for i in ids],
                             "x": ids.astype(np.float32)}),
                   tmp_path / "text.parquet", row_group_size=25)
    with make_cluster(3, threads=threads) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="synced-text")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=30)
        state = coord.create_per_worker_resource(functools.partial(make_counts, n=n))
        ds = coord.distribute_dataset(str(tmp_path / "text.parquet"), global_batch_size=30,
                                      policy="dynamic", shuffle=True, seed=5, prefetch=0)
        it = iter(ds)
        runs = []
        while not ds.progress()["complete"]:
            assert len(runs) < 100, ds.progress()
            runs.append(coord.fetch(coord.schedule_on_all(_train_text, args=(state, it, k))))
        assert any(r[0] > k for r in runs), runs  # steps after rank 0's k: pooled
        assert_every_row_once(coord.fetch(coord.schedule_on_all(final_counts,
                                                                args=(state,))), n)
        coord.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["threads1", "threads2"])
def three(request, tmp_path_factory):
    """3 workers (1 or 2 threads each) and a Parquet dataset of 3,600 rows in 48 row
    groups of 75."""
    from distributed import Client

    from tests.conftest import make_cluster

    root = tmp_path_factory.mktemp("tail")
    ids = np.arange(3600, dtype=np.int64)
    for f in range(4):
        part = ids[f * 900:(f + 1) * 900]
        pq.write_table(pa.table({"id": part, "x": part.astype(np.float32)}),
                       root / f"p{f}.parquet", row_group_size=75)
    with make_cluster(3, threads=request.param) as cluster, Client(cluster) as client:
        yield client, str(root), 3600


def _tail_epoch(client, root, n, name, on_run=None, riding=0):
    """A dynamic epoch trained under synced, the driver looping schedule_on_all until
    the epoch is complete: the gang runs it took and the steps of the last. ``riding``:
    the counts are gradients summed by ``allreduce_gradients`` (synced's agreement and
    the commit heads ride it) and committed every ``riding`` steps; else a commit a
    step, each call its own."""
    import functools

    import daskdist as dd
    from tests.conftest import wait_for_workers
    from tests.row_ledger import (
        assert_every_row_once,
        final_counts,
        final_grad_counts,
        make_counts,
        make_grad_counts,
        train_rows,
        train_rows_riding,
    )

    coord = dd.Coordinator(client, name=name)
    wait_for_workers(client, coord, 3)
    coord.collective_group(timeout=30)
    make, final = (make_grad_counts, final_grad_counts) if riding else (make_counts,
                                                                         final_counts)
    state = coord.create_per_worker_resource(functools.partial(make, n=n))
    ds = coord.distribute_dataset(root, global_batch_size=3 * 16, policy="dynamic",
                                  shuffle=True, lease_rows=600)
    it = iter(ds)
    runs = 0
    while not ds.progress()["complete"]:
        assert runs < 10, ds.progress()
        if riding:
            rvs = coord.schedule_on_all(train_rows_riding, args=(state, it, 0.01, riding))
        else:
            rvs = coord.schedule_on_all(train_rows, args=(state, it, 0.01))
        if on_run is not None:
            on_run(runs, coord)
        outs = coord.fetch(rvs)
        if riding and on_run is None:  # every rank stepped alike, in one call a step
            for _, steps, commit_calls, quiet in outs:
                assert steps == outs[0][1] and commit_calls == 0, outs
                assert quiet >= steps // 2, outs  # the tail's pooled steps call
        runs += 1
    assert_every_row_once(coord.fetch(coord.schedule_on_all(final, args=(state,))), n)
    coord.close()
    return runs, outs[0][1]


@pytest.mark.parametrize("riding", [0, 1], ids=["own-calls", "riding"])
def test_a_fault_free_dynamic_epoch_is_one_gang_run(three, riding):
    """Ranks' leases run dry at different steps: the tail's steps pool the rows the
    others still hold and go on, so the gang ends once, when the epoch's rows are all
    trained (not at the first dry rank: a run per lease, tens an epoch). The ranks that
    still hold rows take the dry ranks' batches too, so the steps stay whole: the epoch
    takes as many steps as its rows make global batches (with leases of 600 rows, a
    tail split only over what each rank took would take tens of steps more)."""
    client, root, n = three
    runs, steps = _tail_epoch(client, root, n, "tail-one-run", riding=riding)
    assert runs == 1
    assert math.ceil(n / 48) <= steps <= math.ceil(n / 48) + 2


@pytest.mark.parametrize("riding", [0, 3, 1], ids=["own-calls", "riding-every-3",
                                                    "riding-rank0-killed"])
def test_a_sigkill_mid_epoch_serves_its_rows_to_the_survivors_in_the_same_gang_run(
        three, riding):
    """A rank SIGKILLed mid-epoch: its leased rows go back to the pool; the survivors'
    re-run of the same gang (one schedule_on_all) trains them, every row once. Riding a
    commit every step, the rank killed is rank 0: the one that sends every commit."""
    import os

    from tests.conftest import sigkill, wait_until

    client, root, n = three
    killed = []

    def kill(run, coord):
        if run == 0:
            wait_until(lambda: client.run_on_scheduler(_epoch_acked) > 0, 60,
                       "the epoch under way")
            pids = client.run(os.getpid)
            if riding == 1:
                pid = pids[coord._call("daskdist_group_info")["members"][0]]
            else:
                pid = max(pids.values())
            sigkill(pid)
            killed.append(pid)

    client.wait_for_workers(3)
    runs, _ = _tail_epoch(client, root, n, "tail-kill", on_run=kill, riding=riding)
    assert killed and runs <= 2


def _epoch_acked(dask_scheduler) -> int:
    co = dask_scheduler.extensions["daskdist"].coordinators.get("tail-kill")
    if co is None:
        return 0
    return sum(ep.acked.size for ds in co.leases.datasets.values()
               for ep in ds.epochs.values())
