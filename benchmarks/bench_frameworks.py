"""Step time of the framework integrations against the same script under torchrun.

The same Lightning script (``examples/plain/lightning_fit.py``'s ``Regression`` and
``train``, and the example's ``train`` on daskdist, which differs in its ``# daskdist``
lines), 2 ranks, gloo on CPU, the same per-rank batches held in memory:

- ``torchrun``: ``python -m torch.distributed.run --nproc_per_node 2`` running the plain
  ``train`` (``strategy="ddp"``; Lightning's ``DistributedSampler`` splits the data): the
  anchor;
- ``DaskdistStrategy`` with ``commit_every=1`` and ``commit_every=10``: the example's
  ``train`` in a gang closure on a 2-worker ``LocalCluster``, over
  ``dd.collective.synced`` of per-worker loaders.

And the Hugging Face path: the plain ``Trainer`` under torchrun against
``prepare_trainer`` (``commit_every=10``), a tiny config-built GPT-2.

A step is the time between two consecutive ends of a training step (data, forward,
backward with the gradient allreduce, optimizer, and on daskdist the step's agreement in
``synced`` and the commits), the median over a run after warm-up steps. Sides run in
interleaved rounds (torchrun, daskdist, torchrun, ...) so load on a shared machine hits
them alike; a side's figure is its best round. Ratios are ours / torchrun's (targets:
<= 1.05 at ``commit_every=10``; ``commit_every=1`` is reported). Run:

    python benchmarks/bench_frameworks.py [--rounds 3] [--steps 300] [--hidden 512]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import record

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
WARMUP = 10


def _load(path: Path, name: str):
    """A script as a module (pickled by value: workers need not import it)."""
    import cloudpickle

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def _median_step(ends: list[float]) -> float:
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)][WARMUP:]
    return statistics.median(gaps)


# -- the timers (a Lightning callback, an HF callback): step ends --------------------


def _lightning_timer():
    import lightning as L

    class StepEnds(L.Callback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    return StepEnds()


def _hf_timer():
    from transformers import TrainerCallback

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    return StepEnds()


# -- the data: the same per-rank batches on every side ---------------------------------


def _lightning_rows(plain, n: int, features: int, seed: int) -> list[dict]:
    return plain.synthetic(n, features=features, seed=seed)


def _loader(rows: list, batch: int):
    from torch.utils.data import DataLoader

    return DataLoader(rows, batch_size=batch, shuffle=False)


# -- torchrun side (this file, run by torch.distributed.run) ---------------------------


def child(kind: str, steps: int, batch: int, features: int, hidden: int) -> None:
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if kind == "lightning":
        plain = _load(EXAMPLES / "plain" / "lightning_fit.py", "plain_lightning_fit")
        timer = _lightning_timer()
        rows = _lightning_rows(plain, steps * batch * world, features, seed=0)
        torch.manual_seed(0)
        plain.train(plain.Regression(features, hidden), _loader(rows, batch),
                    callbacks=[timer])
    else:
        plain = _load(EXAMPLES / "plain" / "hf_trainer.py", "plain_hf_trainer")
        timer = _hf_timer()
        rows = plain.synthetic(steps * batch * world)
        torch.manual_seed(0)
        plain.train(plain.make_model(), rows, tempfile.mkdtemp(), max_steps=steps,
                    callbacks=[timer])
    if rank == 0:
        print("STEP " + json.dumps(_median_step(timer.ends)), flush=True)


def torchrun(kind: str, args) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node", "2", __file__, "--child", kind, "--steps", str(args.steps),
         "--batch", str(args.batch), "--features", str(args.features),
         "--hidden", str(args.hidden)],
        capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("STEP ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"torchrun {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][5:])


# -- daskdist side -----------------------------------------------------------------------


def _lightning_gang(example, module, it, commit_every):
    timer = _lightning_timer()
    example.train(module, it, commit_every, callbacks=[timer])
    return _median_step(timer.ends)


def _hf_gang(example, model, it, steps, commit_every):
    timer = _hf_timer()
    example.train(model, it, tempfile.mkdtemp(), steps, commit_every, callbacks=[timer])
    return _median_step(timer.ends)


def daskdist_side(coord, kind: str, commit_every: int, args, modules) -> float:
    """One gang over fresh per-worker loaders (the same batches as torchrun's ranks)."""
    import torch

    steps, batch, features, hidden = args.steps, args.batch, args.features, args.hidden
    if kind == "lightning":
        example, plain = modules["lightning"]

        def make_module(ctx):
            torch.manual_seed(0)
            return example.Regression(features, hidden)

        def make_data(ctx):
            # rank r gets what torchrun's DistributedSampler gives rank r
            rows = _lightning_rows(plain, steps * batch * 2, features, seed=0)
            return _loader(rows[ctx.input_pipeline_id::2], batch)

        module = coord.create_per_worker_resource(make_module)
        it = iter(coord.create_per_worker_dataset(make_data))
        times = coord.fetch(coord.schedule_on_all(
            _lightning_gang, args=(example, module, it, commit_every)))
    else:
        example, plain = modules["hf"]

        def make_model(ctx):
            torch.manual_seed(0)
            return example.make_model()

        def make_data(ctx):
            rows = plain.synthetic(steps * batch * 2)
            return _loader(rows[ctx.input_pipeline_id::2], batch)

        model = coord.create_per_worker_resource(make_model)
        it = iter(coord.create_per_worker_dataset(make_data))
        times = coord.fetch(coord.schedule_on_all(
            _hf_gang, args=(example, model, it, steps, commit_every)))
    return max(times)  # the slower rank sets the step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="per rank")
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--hf-steps", type=int, default=120)
    p.add_argument("--only", choices=["lightning", "hf"], help="one framework's sides")
    p.add_argument("--child", choices=["lightning", "hf"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.steps, args.batch, args.features, args.hidden)
        return

    import logging

    from distributed import Client, LocalCluster

    import daskdist as dd

    os.environ["HF_HUB_OFFLINE"] = "1"
    modules = {
        "lightning": (_load(EXAMPLES / "lightning_fit.py", "bench_lightning_fit"),
                      _load(EXAMPLES / "plain" / "lightning_fit.py", "bench_plain_fit")),
        "hf": (_load(EXAMPLES / "hf_trainer.py", "bench_hf_trainer"),
               _load(EXAMPLES / "plain" / "hf_trainer.py", "bench_plain_hf")),
    }
    sides = {"lightning torchrun": [], "lightning commit_every=1": [],
             "lightning commit_every=10": [], "hf torchrun": [], "hf commit_every=10": []}
    hf_args = argparse.Namespace(**{**vars(args), "steps": args.hf_steps, "batch": 16})
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        coord = dd.Coordinator(client, name="bench-frameworks")
        coord.collective_group(backend="gloo", timeout=120)
        for r in range(args.rounds):
            t0 = time.perf_counter()
            if args.only != "hf":
                sides["lightning torchrun"].append(torchrun("lightning", args))
                sides["lightning commit_every=1"].append(
                    daskdist_side(coord, "lightning", 1, args, modules))
                sides["lightning commit_every=10"].append(
                    daskdist_side(coord, "lightning", 10, args, modules))
            if args.only != "lightning":
                sides["hf torchrun"].append(torchrun("hf", hf_args))
                sides["hf commit_every=10"].append(
                    daskdist_side(coord, "hf", 10, hf_args, modules))
            print(f"round {r + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s): "
                  + ", ".join(f"{k} {v[-1] * 1e3:.2f} ms" for k, v in sides.items() if v))
        coord.close()
    best = {k: min(v) for k, v in sides.items() if v}
    print(f"\n2 ranks, gloo, CPU; Lightning: {args.steps} steps of {args.batch} rows a rank, "
          f"MLP {args.features}-{args.hidden}-1; HF: {args.hf_steps} steps of 16 "
          f"sequences a rank, GPT-2 2x64. Best of {args.rounds} rounds, median step:")
    what = {"lightning": f"Lightning step, `DaskdistStrategy`, MLP {args.features}-"
                         f"{args.hidden}-1, {args.batch} rows a rank",
            "hf": "HF `Trainer` step, `prepare_trainer`, tiny GPT-2 (2x64), 16 sequences "
                  "a rank"}
    plain = {"lightning": "the same script under `torchrun`",
             "hf": "plain `Trainer` under `torchrun`"}
    for framework in [f for f in ("lightning", "hf") if f"{f} torchrun" in best]:
        anchor = best[f"{framework} torchrun"]
        print(f"  {framework} torchrun (anchor): {anchor * 1e3:.2f} ms")
        for k, v in best.items():
            if k.startswith(framework) and "torchrun" not in k:
                every = k.split("commit_every=")[1]
                judged = every == "10"  # the target's; a commit every step is reported
                record(f"  {k}: {v * 1e3:.2f} ms  ratio {v / anchor:.3f}x",
                       what=f"{what[framework]}, `commit_every={every}`, 2 workers, gloo",
                       ours=v * 1e3, unit="ms", anchor=plain[framework],
                       anchor_value=anchor * 1e3, target="≤ 1.05x" if judged else None,
                       met=v / anchor <= 1.05 if judged else None)


if __name__ == "__main__":
    main()
