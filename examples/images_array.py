"""Train a small CNN on a dict of dask Arrays of images, synchronously, through a SIGKILL.

    pip install "daskdist[dataframe]"
    python examples/images_array.py --images 4096 --chunk 256 --epochs 1 --kill

The data is ``{"image": (N, 3, 32, 32) float32, "label": (N,) int64, "id": (N,)}``
dask Arrays chunked alike along axis 0 (here made by ``dask.array`` from a seed; a
``da.from_zarr`` or ``da.map_blocks`` of a decoder works the same way). Each row chunk
is a partition: computed by Dask when a member leases it, its batches stay N-D
(``(B, 3, 32, 32)``). Every rank of the collective group runs the same gang closure:
``synced`` steps, gradients averaged over the group, ``State.commit()`` after each
step, which also acknowledges the rows the step trained. With ``--kill`` one worker is
SIGKILLed mid-epoch: the group re-forms, the gang runs again from the last commit,
rows of the lost steps go back to the pool, and the committed ``seen`` counter shows
every image trained exactly once.

:func:`train` is what ``tests/test_collections_examples.py`` runs at a small size.
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time

import numpy as np

import daskdist as dd


def make_arrays(n: int, chunk: int, seed: int = 0) -> dict:
    """Images whose class is the brightest channel, their labels and ids (lazy)."""
    import dask.array as da

    rs = da.random.RandomState(seed)
    image = rs.random_sample((n, 3, 32, 32), chunks=(chunk, 3, 32, 32)).astype(np.float32)
    label = image.mean(axis=(2, 3)).argmax(axis=1).astype(np.int64)
    ids = da.arange(n, chunks=chunk, dtype=np.int64)
    return {"image": image, "label": label.rechunk(chunk), "id": ids}


def make_state(ctx, n: int):
    import torch

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(4),
        torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 3)).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return dd.collective.State(model=model, optimizer=opt,
                               seen=torch.zeros(n, dtype=torch.float64, device=ctx.device),
                               step=0)


def train_epoch(state, it, pause: float = 0.0):
    """A gang closure: synchronous steps until the epoch's rows are used up."""
    import torch

    g = dd.collective.get_group()
    state.sync()  # every rank starts from the newest commit (after a loss too)
    for batch in dd.collective.synced(it):
        x, y = batch["image"].to(g.device), batch["label"].to(g.device)
        n = len(y)
        loss = torch.nn.functional.cross_entropy(state.model(x), y, reduction="sum")
        loss = loss / max(1, n)
        state.optimizer.zero_grad()
        loss.backward()
        dd.collective.allreduce_gradients(state.model)
        state.optimizer.step()
        seen = torch.bincount(batch["id"].to(g.device),
                              minlength=state.seen.numel()).to(torch.float64)
        g.allreduce(seen)
        state.seen += seen
        state.step += 1
        time.sleep(pause)
        state.commit()  # acknowledges this step's rows, all ranks or none
    return state.step


def committed(state):
    state.sync()
    return state.step, state.seen.tolist()


def train(coord, client, images: int = 4096, chunk: int = 256, epochs: int = 1,
          global_batch_size: int = 128, kill: bool = False, pause: float = 0.0) -> dict:
    """Train; with ``kill``, SIGKILL one member once a quarter of the epoch is
    committed. Returns the committed step count, per-image counts and kills."""
    coord.collective_group(timeout=60)
    state = coord.create_per_worker_resource(functools.partial(make_state, n=images))
    ds = coord.distribute_dataset(make_arrays(images, chunk), global_batch_size=global_batch_size,
                                  shuffle=True, name="images", prefetch=0)
    kills: list[int] = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        it = iter(ds)
        stop = threading.Event()

        def killer(stop=stop):
            while not stop.is_set() and ds.progress()["acknowledged"] < images // 4:
                time.sleep(0.05)
            if stop.is_set():
                return
            pids = client.run(os.getpid, on_error="ignore")
            victim = sorted(pids.values())[-1]
            os.kill(victim, 9)
            kills.append(victim)

        thread = threading.Thread(target=killer, daemon=True)
        if kill and epoch == 0:
            thread.start()
        while not ds.progress()["complete"]:
            coord.fetch(coord.schedule_on_all(train_epoch, args=(state, it, pause)))
        stop.set()
        if thread.is_alive():
            thread.join(30)
    per_rank = coord.fetch(coord.schedule_on_all(committed, args=(state,)))
    steps, seen = per_rank[0]
    return {"steps": steps, "seen": seen, "kills": kills}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="a running Dask scheduler (default: a local "
                        "cluster of --workers workers)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--kill", action="store_true", help="SIGKILL a worker mid-epoch")
    args = parser.parse_args(argv)
    from distributed import Client, LocalCluster

    cluster = None
    if args.scheduler:
        client = Client(args.scheduler)
    else:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=2)
        client = Client(cluster)
    coord = dd.Coordinator(client)
    try:
        r = train(coord, client, args.images, args.chunk, args.epochs, args.batch_size,
                  args.kill)
        seen = np.asarray(r["seen"])
        print(f"{r['steps']} committed steps; workers killed: {len(r['kills'])}; every "
              f"image trained exactly {args.epochs} time(s): {bool((seen == args.epochs).all())}")
    finally:
        coord.close()
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    main()
