"""What the Hugging Face tests train (pickled by reference), and a job for the durable
checkpoint test: ``python -m tests.hf_job URL DATA N WORKERS LOGDIR OUTDIR`` trains
``hf_row_model`` with ``DaskdistCallback(it, checkpoint_to=URL, every=EVERY)`` over a
dynamic epoch named ``NAME`` on a LocalCluster of its own, until it is killed or the
epoch completes.
"""

from __future__ import annotations

import functools
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs: no hub

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist.integrations.transformers import DaskdistCallback, prepare_trainer  # noqa: E402
from tests.framework_rows import hf_row_model, log_event  # noqa: E402
from tests.processes import use_fork_server  # noqa: E402

NAME = "hf-rows"  # the dataset's name: its ledger travels in the checkpoints
EVERY = 4  # commits between checkpoints
BATCH = 24  # rows of a step, over all ranks
SEED = 12


class StepLog(TrainerCallback):
    """Logs where training began and every optimizer step (before daskdist's commit)."""

    def __init__(self, logdir):
        self.logdir = logdir

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.started:  # after every callback's on_train_begin: the resumed step
            self.started = True
            log_event(self.logdir, "start", state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        log_event(self.logdir, "step", state.global_step)


def train(model, it, outdir, commit_every=1, how="callback", checkpoint_to=None,
          every=EVERY):
    """The gang closure: a plain Trainer made here, given daskdist's callback (the
    per-worker iterator as it is), or prepared after (``synced`` batches); trained."""
    args = TrainingArguments(output_dir=outdir, max_steps=10_000, learning_rate=0.01,
                             per_device_train_batch_size=8, save_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True)
    callbacks = [StepLog(model.logdir)]
    if how == "callback":
        callbacks.append(DaskdistCallback(it, commit_every=commit_every,
                                          checkpoint_to=checkpoint_to, every=every))
    trainer = Trainer(model=model, args=args, callbacks=callbacks)
    if how == "prepare":
        trainer = prepare_trainer(trainer, dd.collective.synced(it), commit_every=commit_every,
                                  checkpoint_to=checkpoint_to, every=every)
    out = trainer.train()
    state = trainer.accelerator.state
    return (dd.collective.get_group().rank, out.global_step, state.num_processes,
            state.process_index, state.distributed_type.value)


def drive(coord, ds, model, it, outdir, commit_every=1, how="callback", checkpoint_to=None,
          deadline=240.0):
    """The driver's loop: train until every row of the epoch is acknowledged."""
    end = time.monotonic() + deadline
    runs = []
    while not ds.progress()["complete"]:
        assert time.monotonic() < end, ds.progress()
        runs.append(coord.fetch(coord.schedule_on_all(
            train, args=(model, it, outdir, commit_every, how, checkpoint_to))))
    return runs


def main(url: str, data: str, n: int, workers: int, logdir: str, outdir: str) -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        coord = dd.Coordinator(client, name="hf-job")
        coord.wait_for_workers(workers, timeout=120)
        coord.collective_group(timeout=60)
        model = coord.create_per_worker_resource(
            functools.partial(hf_row_model, n=n, logdir=logdir, pause=0.05))
        ds = coord.distribute_dataset(data, global_batch_size=BATCH, policy="dynamic",
                                      shuffle=True, seed=SEED, prefetch=0, name=NAME)
        print("training", flush=True)
        drive(coord, ds, model, iter(ds), outdir, checkpoint_to=url, deadline=600.0)
        print("complete", flush=True)


if __name__ == "__main__":
    use_fork_server("tests.hf_job")  # its workers fork with this module imported
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
         sys.argv[6])
