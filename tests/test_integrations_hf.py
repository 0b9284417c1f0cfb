"""DaskdistCallback / prepare_trainer (SPEC §4.4) on real LocalClusters with worker
processes and gloo: transformers.Trainer.train with a tiny config-built model over a
"dynamic" dataset, given ``callbacks=[DaskdistCallback(it)]`` as HF users add callbacks
(and through prepare_trainer), trains every row exactly once in the committed model; a
member SIGKILLed mid-train (3 workers) re-runs train() from the committed global_step
on every rank; a whole job killed mid-train is resumed by a new cluster from its newest
durable checkpoint (§4.3); Accelerate's process-wide state is set afresh for every run,
and running the train cell 5 times leaves worker memory and threads flat."""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs: no hub

import torch  # noqa: E402
from distributed import Client  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist.integrations.transformers import (  # noqa: E402
    DaskdistCallback,
    prepare_trainer,
)
from tests.conftest import make_cluster, sigkill, wait_for_workers, wait_until  # noqa: E402
from tests.framework_rows import (  # noqa: E402
    assert_flat,
    committed_counts,
    complete_checkpoints,
    hf_row_model,
    kill_a_job_past_its_checkpoints,
    read_events,
    rerun_after,
    rss_and_threads,
    write_rows,
)
from tests.hf_job import BATCH, NAME, SEED, drive  # noqa: E402
from tests.row_ledger import assert_every_row_once  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def test_train_over_a_dynamic_dataset_trains_every_row_once(tmp_path):
    n = 1000
    glob = write_rows(tmp_path, n)
    with make_cluster(2, threads=2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="hf-once")
        wait_for_workers(client, coord, 2)
        coord.collective_group(timeout=30)
        model = coord.create_per_worker_resource(functools.partial(hf_row_model, n=n))
        ds = coord.distribute_dataset(glob, global_batch_size=40, policy="dynamic",
                                      shuffle=True, seed=5, prefetch=0)
        it = iter(ds)
        runs = drive(coord, ds, model, it, str(tmp_path / "out"), commit_every=3)
        # Accelerate saw daskdist's group: 2 processes, this rank, a CPU DDP run
        assert [r[2:] for r in runs[-1]] == [(2, 0, "MULTI_CPU"), (2, 1, "MULTI_CPU")]
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(model, "transformers")))
        assert out[0][0] == out[1][0] == runs[-1][0][1] > 0
        assert_every_row_once(out, n)
        # a second run on the same workers (a notebook cell run again) starts clean,
        # through prepare_trainer this time
        model2 = coord.create_per_worker_resource(functools.partial(hf_row_model, n=n))
        ds2 = coord.distribute_dataset(glob, global_batch_size=40, policy="dynamic",
                                       shuffle=True, seed=6, prefetch=0)
        drive(coord, ds2, model2, iter(ds2), str(tmp_path / "out2"), how="prepare")
        assert_every_row_once(coord.fetch(coord.schedule_on_all(
            committed_counts, args=(model2, "transformers"))), n)
        coord.close()


@pytest.mark.slow
def test_member_sigkilled_mid_train_resumes_from_the_committed_step(tmp_path):
    n = 1500
    glob = write_rows(tmp_path, n)
    logdir = tmp_path / "log"
    logdir.mkdir()
    with make_cluster(3) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="hf-kill")
        wait_for_workers(client, coord, 3)
        coord.collective_group(timeout=30)
        model = coord.create_per_worker_resource(
            functools.partial(hf_row_model, n=n, logdir=str(logdir), pause=0.02))
        ds = coord.distribute_dataset(glob, global_batch_size=30, policy="dynamic",
                                      shuffle=True, seed=7, prefetch=0)
        it = iter(ds)
        killed: list[tuple[float, int]] = []

        def kill_rank1_mid_train():
            wait_until(lambda: sum(e[1] == "step" for e in read_events(logdir)) > 30,
                       120, "steps")
            addr = coord._call("daskdist_group_info")["members"][1]
            pid = client.run(os.getpid, workers=[addr])[addr]
            killed.append((time.time(), pid))
            sigkill(pid)

        killer = threading.Thread(target=kill_rank1_mid_train, daemon=True)
        killer.start()
        drive(coord, ds, model, it, str(tmp_path / "out"))
        killer.join(60)
        assert killed, "the member was not killed"
        t_kill, victim = killed[0]
        committed, rerun = rerun_after(read_events(logdir), t_kill)
        assert len({e[4] for e in rerun}) == rerun[0][5]  # every rank of it started ...
        assert {e[2] for e in rerun} == {rerun[0][2]}  # ... at the same step ...
        assert committed - 1 <= rerun[0][2] <= committed and rerun[0][2] > 0  # committed
        assert victim not in {e[6] for e in rerun}
        print(f"killed rank 1 after step {committed}; train() ran again on "
              f"{rerun[0][5]} ranks from global_step {rerun[0][2]}")
        out = coord.fetch(coord.schedule_on_all(committed_counts, args=(model, "transformers")))
        assert_every_row_once(out, n)
        coord.close()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_new_cluster_resumes_a_killed_train_from_its_checkpoint_every_row_once(tmp_path):
    """DaskdistCallback(it, checkpoint_to=url, every=N) (SPEC §4.3 through §4.4): a job
    SIGKILLed whole mid-train; a new cluster of 2 workers with the same URL and a
    dataset of the same name resumes train() from the newest complete checkpoint (its
    global_step, > 0), and every row of the epoch is trained exactly once across both."""
    n = 1200
    glob = write_rows(tmp_path, n)
    url = tmp_path / "ckpt"
    first_log, second_log = tmp_path / "log1", tmp_path / "log2"
    first_log.mkdir()
    second_log.mkdir()
    kill_a_job_past_its_checkpoints(
        ["tests.hf_job", str(url), glob, str(n), "3", str(first_log),
         str(tmp_path / "out1")], url, first_log, tmp_path / "job.log")
    newest = complete_checkpoints(url)[-1]
    trained = max(e[2] for e in read_events(first_log) if e[1] == "step")
    assert 0 < newest < trained

    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="hf-resumed")
        wait_for_workers(client, coord, 2)
        coord.collective_group(timeout=30)
        model = coord.create_per_worker_resource(
            functools.partial(hf_row_model, n=n, logdir=str(second_log)))
        ds = coord.distribute_dataset(glob, global_batch_size=BATCH, policy="dynamic",
                                      shuffle=True, seed=SEED, prefetch=0, name=NAME)
        drive(coord, ds, model, iter(ds), str(tmp_path / "out2"), checkpoint_to=str(url))
        committed = coord.fetch(coord.schedule_on_all(committed_counts,
                                                      args=(model, "transformers")))
        assert ds.progress()["acknowledged"] == n
        coord.close()
    first_train: dict[int, tuple] = {}  # each worker's first train() (events by time)
    for e in read_events(second_log):
        if e[1] == "start":
            first_train.setdefault(e[6], e)
    assert sorted(e[4] for e in first_train.values()) == [0, 1]
    assert {e[2] for e in first_train.values()} == {newest}, (newest, first_train)
    print(f"the first job trained to step {trained} and was killed; the newest complete "
          f"checkpoint held step {newest}; the new cluster's train() began there")
    assert_every_row_once(committed, n)
    assert complete_checkpoints(url)[-1] > newest


def test_prepare_trainer_refuses_a_stream_without_max_steps(tmp_path):
    model = torch.nn.Linear(1, 1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="max_steps"):
        prepare_trainer(Trainer(model=model, args=args), iter([]))
    # the callback's Trainer refuses it when it is made
    with pytest.raises(ValueError, match="max_steps"):
        Trainer(model=model, args=args, callbacks=[DaskdistCallback(iter([]))])


def test_use_cpu_on_an_nccl_group_is_refused_naming_both():
    """TrainingArguments(use_cpu=True) on a worker whose group is NCCL (its own GPU):
    a clear error before Accelerate is set up, not a loss on the wrong device later.
    (The group here is its description: the check reads nothing else of it.)"""
    from types import SimpleNamespace

    from daskdist.integrations.transformers import _configure_accelerate

    nccl = SimpleNamespace(backend="nccl", device="cuda:0", rank=0, world_size=1,
                           generation=1)
    with pytest.raises(ValueError, match=r"use_cpu=True.*NCCL on cuda:0.*backend='gloo'"):
        _configure_accelerate(nccl, cpu=True)


class _EnvironWatch(dict):
    """``os.environ`` for a test: reads pass, any write fails at once, naming it."""

    def _wrote(self, *args, **kwargs):
        raise AssertionError(f"the process environment was written: {args} {kwargs}")

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = _wrote


def test_accelerate_takes_the_group_without_writing_the_environment(monkeypatch):
    """Accelerate's process-wide state is set from the group (rank, size, backend, a
    CPU DDP run), and the process's environment, read by every closure thread of the
    worker, is never written, not even for a moment."""
    from types import SimpleNamespace

    from accelerate.state import AcceleratorState, PartialState

    from daskdist.integrations.transformers import _configure_accelerate

    gloo = SimpleNamespace(backend="gloo", device="cpu", rank=1, world_size=3, generation=4)
    try:
        with monkeypatch.context() as m:  # the call only (pytest writes it between tests)
            m.setattr(os, "environ", _EnvironWatch(os.environ))
            _configure_accelerate(gloo, cpu=False)
            state = PartialState()
        assert (state.num_processes, state.process_index, state.local_process_index) == (3, 1, 0)
        assert state.distributed_type.value == "MULTI_CPU" and state.backend == "gloo"
        assert state.device.type == "cpu" and state.use_distributed
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_the_callback_prepares_the_trainer_it_is_given_to_once(tmp_path):
    """At on_init_end the callback takes the Trainer being made (a subclass too) and
    prepares it as prepare_trainer does; one callback, one preparation, per Trainer."""

    class MyTrainer(Trainer):
        pass

    model = torch.nn.Linear(1, 1)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, report_to="none",
                             use_cpu=True)
    cb = DaskdistCallback(iter([]), commit_every=3)
    trainer = MyTrainer(model=model, args=args, callbacks=[cb])
    assert cb.trainer is trainer and trainer._daskdist is cb
    assert isinstance(trainer, MyTrainer) and type(trainer).__name__ == "MyTrainer"
    assert type(trainer).train is not Trainer.train  # daskdist's train(): the group
    assert cb in trainer.callback_handler.callbacks
    with pytest.raises(ValueError, match="prepared for daskdist already"):
        prepare_trainer(trainer, iter([]))
    with pytest.raises(ValueError, match="another Trainer"):
        Trainer(model=model, args=args, callbacks=[cb])
    with pytest.raises(TypeError, match="this worker's batches"):
        DaskdistCallback(trainer)
    # a prepared Trainer's data: the per-worker batches, wrapped in synced once
    from daskdist.collective.step.synced import synced

    assert cb.batches.gi_code is synced.__code__
    already = synced(iter([]))
    assert DaskdistCallback(already).batches is already


@pytest.mark.slow
def test_running_the_train_cell_five_times_leaves_memory_and_threads_flat(tmp_path):
    """The notebook cell (a model, a dataset, Trainer.train through the callback) run 5
    times on the same workers: every run trains every row once on Accelerate's state
    set afresh, and worker RSS and threads stay flat after the first."""
    n = 600
    glob = write_rows(tmp_path, n)
    with make_cluster(2) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="hf-cells")
        wait_for_workers(client, coord, 2)
        coord.collective_group(timeout=30)
        samples = []
        for i in range(5):
            model = coord.create_per_worker_resource(functools.partial(hf_row_model, n=n))
            ds = coord.distribute_dataset(glob, global_batch_size=40, policy="dynamic",
                                          shuffle=True, seed=i, prefetch=0)
            it = iter(ds)
            runs = drive(coord, ds, model, it, str(tmp_path / f"out{i}"), commit_every=5)
            assert [r[2:] for r in runs[-1]] == [(2, 0, "MULTI_CPU"), (2, 1, "MULTI_CPU")]
            assert_every_row_once(coord.fetch(coord.schedule_on_all(
                committed_counts, args=(model, "transformers"))), n)
            del model, ds, it
            samples.append(client.run(rss_and_threads))
        assert_flat(samples)
        coord.close()
