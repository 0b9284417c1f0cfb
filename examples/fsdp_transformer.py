"""Train a small GPT with FSDP2 over a Dask cluster, elastically, through a SIGKILL.

    python examples/fsdp_transformer.py --sequences 4096 --chunk 256 --kill

The data is ``{"tokens": (N, T + 1) int64, "id": (N,)}`` dask Arrays chunked alike along
axis 0 (here token sequences of a random bigram language, from a seed; a
``da.from_zarr`` of a tokenized corpus works the same way). Every worker holds a shard
of the model: ``dd.collective.ShardedState`` builds it on every rank, shards each block
and then the whole model with ``fully_shard`` over the group's mesh, and keeps each
commit in memory (a rank's own shard and a copy of its neighbour's). With ``--kill`` a
worker is SIGKILLed mid-epoch: the survivors reshard the last commit among themselves,
without reading storage, and go on; its replacement joins at a commit. The committed
``seen`` counter shows every sequence trained exactly once.

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

VOCAB = 64


def make_arrays(n: int, length: int, chunk: int, seed: int = 0) -> dict:
    """``n`` sequences of ``length + 1`` tokens of a random bigram language (lazy)."""
    import dask.array as da

    rs = np.random.default_rng(seed)
    nexts = rs.integers(0, VOCAB, size=(VOCAB, 4))  # each token has 4 likely successors

    def block(block_id, start, rows):
        r = np.random.default_rng([seed, block_id])
        out = np.empty((rows, length + 1), dtype=np.int64)
        out[:, 0] = r.integers(0, VOCAB, size=rows)
        for t in range(length):
            out[:, t + 1] = nexts[out[:, t], r.integers(0, 4, size=rows)]
        return out

    starts = list(range(0, n, chunk))
    blocks = [da.from_delayed(_delayed(block)(i, s, min(chunk, n - s)),
                              shape=(min(chunk, n - s), length + 1), dtype=np.int64)
              for i, s in enumerate(starts)]
    tokens = da.concatenate(blocks, axis=0)
    return {"tokens": tokens, "id": da.arange(n, chunks=chunk, dtype=np.int64)}


def _delayed(fn):
    import dask

    return dask.delayed(fn, pure=True)


def gpt(layers: int = 2, width: int = 64, heads: int = 4, length: int = 32):
    """A GPT-style decoder: token and position embeddings, causal blocks, a head."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width))

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(VOCAB, width)
            self.pos = torch.nn.Embedding(length, width)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.ln = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, VOCAB)

        def forward(self, tokens):
            """Next-token logits, one row per position: ``(B * T, VOCAB)``."""
            t = tokens.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
            x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln(x).reshape(-1, width))

    torch.manual_seed(0)
    return GPT()


def shard(model, mesh) -> None:
    """FSDP2: each block, then the rest of the model."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_state(ctx, n: int, length: int):
    import torch

    return dd.collective.ShardedState(
        model=functools.partial(gpt, length=length),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        shard=shard, step=0, loss=float("nan"),
        seen=torch.zeros(n, dtype=torch.float64))


def train_epoch(state, it, pause: float = 0.0):
    """A gang closure: synchronous steps until the epoch's sequences are used up."""
    import torch

    g = dd.collective.get_group()
    state.sync()  # the model sharded over this group, at the newest commit
    for batch in dd.collective.synced(it):
        tokens = batch["tokens"].to(g.device)
        logits = state.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1),
                                                 reduction="sum")
        (loss / max(1, tokens[:, 1:].numel())).backward()  # a rank may get no rows
        state.optimizer.step()
        state.optimizer.zero_grad()
        seen = torch.bincount(batch["id"], minlength=state.seen.numel()).to(torch.float64)
        total = torch.stack([loss.detach().double().cpu(), torch.tensor(
            float(tokens[:, 1:].numel()), dtype=torch.float64)])
        g.allreduce(seen)
        g.allreduce(total)
        state.seen += seen
        state.loss = float(total[0] / max(1.0, float(total[1])))
        state.step += 1
        time.sleep(pause)
        state.commit()  # keeps the shards (and a neighbour's), acknowledges the rows
    return state.step


def committed(state):
    state.sync()
    return state.step, state.loss, state.seen.tolist()


def train(coord, client, sequences: int = 4096, length: int = 32, chunk: int = 256,
          epochs: int = 1, global_batch_size: int = 128, kill: bool = False,
          pause: float = 0.0) -> dict:
    """Train; with ``kill``, SIGKILL one member once a quarter of the epoch is
    committed. Returns the committed steps, loss, per-sequence counts and kills."""
    coord.collective_group(timeout=60)
    state = coord.create_per_worker_resource(
        functools.partial(make_state, n=sequences, length=length))
    ds = coord.distribute_dataset(make_arrays(sequences, length, chunk),
                                  global_batch_size=global_batch_size, shuffle=True,
                                  name="sequences", prefetch=0)
    kills: list[int] = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        it = iter(ds)
        stop = threading.Event()

        def killer(stop=stop):
            while not stop.is_set() and ds.progress()["acknowledged"] < sequences // 4:
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
    steps, loss, seen = coord.fetch(coord.schedule_on_all(committed, args=(state,)))[0]
    return {"steps": steps, "loss": loss, "seen": seen, "kills": kills}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="a running Dask scheduler (default: a local "
                        "cluster of --workers workers)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=4096)
    parser.add_argument("--length", type=int, default=32)
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
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1)
        client = Client(cluster)
    coord = dd.Coordinator(client)
    try:
        r = train(coord, client, args.sequences, args.length, args.chunk, args.epochs,
                  args.batch_size, args.kill)
        seen = np.asarray(r["seen"])
        print(f"{r['steps']} committed steps, loss {r['loss']:.3f}; workers killed: "
              f"{len(r['kills'])}; every sequence trained exactly {args.epochs} time(s): "
              f"{bool((seen == args.epochs).all())}")
    finally:
        coord.close()
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    main()
