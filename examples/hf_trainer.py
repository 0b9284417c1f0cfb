"""Hugging Face ``transformers.Trainer`` on a daskdist cluster: elastic, exactly once
(SPEC §4.4).

    pip install daskdist[hf]
    python examples/hf_trainer.py --workers 2 --rows 8192

The model and ``train`` are the plain script's (``examples/plain/hf_trainer.py``, run
with torchrun) but for the three lines marked ``# daskdist``: the Trainer gets no
dataset, ``prepare_trainer`` gives it this worker's batches (and the group, the commits,
the resume), and this import. ``per_device_train_batch_size`` is the plain script's and
not used: the dataset's ``global_batch_size`` sets the batches. ``main`` is the driver:
a cluster, the model as a per-worker resource, a ``"dynamic"`` dataset of token
sequences, and the loop that runs ``train`` on every member until every row is committed.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist.integrations.transformers import prepare_trainer  # noqa: E402  # daskdist

SEQ, VOCAB = 32, 256


def make_model(layers: int = 2, width: int = 64):
    """A tiny GPT-2 built from its config (nothing downloaded)."""
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=width,
                                      n_layer=layers, n_head=2))


def train(model, batches, output_dir, max_steps, commit_every=1, callbacks=()):
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, learning_rate=1e-3,
                             per_device_train_batch_size=16, save_strategy="no",
                             logging_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, callbacks=list(callbacks))  # daskdist
    trainer = prepare_trainer(trainer, dd.collective.synced(batches), commit_every)  # daskdist
    out = trainer.train()
    return out.global_step, out.training_loss


def write_tokens(root: str, rows: int, files: int = 4, seed: int = 0) -> str:
    """Token sequences (a short random pattern repeated) in Parquet; the glob."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    per = rows // files
    for f in range(files):
        ids = np.tile(rng.integers(0, VOCAB, (per, 4)), (1, SEQ // 4)).astype(np.int64)
        col = pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), SEQ)
        pq.write_table(pa.table({"input_ids": col, "labels": col}),
                       f"{root}/tokens-{f}.parquet", row_group_size=max(1, per // 4))
    return f"{root}/*.parquet"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--commit-every", type=int, default=1)
    p.add_argument("--scheduler", help="a running scheduler's address (else a LocalCluster)")
    args = p.parse_args(argv)

    from distributed import Client, LocalCluster

    glob = write_tokens(tempfile.mkdtemp(prefix="daskdist-hf-"), args.rows)
    out_dir = tempfile.mkdtemp(prefix="daskdist-hf-out-")
    max_steps = 2 * args.rows // args.batch_size + 10  # an upper bound: the data ends first
    cluster = None if args.scheduler else LocalCluster(
        n_workers=args.workers, threads_per_worker=1, dashboard_address=None)
    with Client(args.scheduler or cluster) as client:
        coord = dd.Coordinator(client, name="hf-trainer")
        coord.collective_group(backend="auto", timeout=60)
        model = coord.create_per_worker_resource(lambda ctx: make_model())
        ds = coord.distribute_dataset(glob, global_batch_size=args.batch_size, shuffle=True,
                                      policy="dynamic", name="hf-trainer")
        it = iter(ds)
        t0 = time.perf_counter()
        runs = 0
        while not ds.progress()["complete"]:  # a re-run after a loss: train() resumes
            results = coord.fetch(coord.schedule_on_all(
                train, args=(model, it, out_dir, max_steps, args.commit_every)))
            runs += 1
        progress = ds.progress()
        summary = {"acknowledged": progress["acknowledged"], "total": progress["total"],
                   "global_step": results[0][0], "loss": round(results[0][1], 4),
                   "runs": runs, "seconds": round(time.perf_counter() - t0, 2)}
        print(summary)
        coord.close()
    if cluster is not None:
        cluster.close()
    return summary


if __name__ == "__main__":
    main()
