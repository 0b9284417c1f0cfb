"""What the framework integration tests train (pickled by reference): Parquet rows with
an ``id``, and a Lightning module and a Hugging Face model that count the ids they
trained on in a buffer allreduced over the group in every step, so the committed
module's counts say whether every row of the epoch was trained exactly once; and the
first job of the durable-checkpoint tests, killed whole past its second checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import daskdist as dd


def write_rows(root: Path, n: int, files: int = 4) -> str:
    """``n`` rows (``id``, ``x``, ``y = 2x + 1``) in ``files`` Parquet files; the glob."""
    per = n // files
    for f in range(files):
        ids = np.arange(f * per, n if f == files - 1 else (f + 1) * per, dtype=np.int64)
        x = (ids % 97).astype(np.float32) / 97.0
        pq.write_table(pa.table({"id": ids, "x": x, "y": 2 * x + 1}),
                       root / f"rows-{f}.parquet", row_group_size=50)
    return str(root / "*.parquet")


def count_ids(counts: torch.Tensor, ids: torch.Tensor) -> None:
    """Add every rank's ``ids`` of this step to ``counts`` (the same on every rank)."""
    c = torch.bincount(ids.to(counts.device), minlength=counts.numel()).to(torch.float64)
    dd.collective.get_group().allreduce(c)  # on the module's device (NCCL: its GPU)
    counts += c


def log_event(logdir: str | None, kind: str, step: int) -> None:
    """One line per event in ``logdir/<pid>.log``: time, kind, step, generation, rank."""
    if logdir is None:
        return
    g = dd.collective.get_group()
    with open(Path(logdir) / f"{os.getpid()}.log", "a") as f:
        f.write(f"{time.time()} {kind} {step} {g.generation} {g.rank} {g.world_size}\n")


def read_events(logdir: Path) -> list[tuple]:
    """Every logged event: (time, kind, step, generation, rank, world, pid), by time."""
    out = []
    for p in Path(logdir).glob("*.log"):
        for line in p.read_text().splitlines():
            t, kind, step, gen, rank, world = line.split()
            out.append((float(t), kind, int(step), int(gen), int(rank), int(world),
                        int(p.stem)))
    return sorted(out)


def rerun_after(events: list[tuple], t_kill: float) -> tuple[int, list[tuple]]:
    """The last step logged before ``t_kill`` and the run that followed: each rank's
    first ``start`` in the first generation that started after it. (A generation can
    hold more runs: the driver runs the gang again when its ranks ran out of rows
    while the lost worker's were still leased, and such a run starts where the last
    ended.)"""
    committed = max(e[2] for e in events if e[1] == "step" and e[0] < t_kill)
    starts = [e for e in events if e[1] == "start" and e[0] > t_kill]
    assert starts, "the gang did not run again after the kill"
    first_gen = min(e[3] for e in starts)
    first: dict[int, tuple] = {}
    for e in starts:  # by time
        if e[3] == first_gen:
            first.setdefault(e[4], e)
    return committed, list(first.values())


def committed_counts(module, label: str = "lightning") -> tuple[int, list[float]]:
    """A gang closure: the newest commit's ``global_step`` and per-row counts (every rank
    takes it with ``sync()``), of the adapter ``label``'s State."""
    from daskdist.integrations.common import committed_state

    state = committed_state(module, label)
    state.sync()
    return int(state.global_step), state.model.counts.tolist()


def hf_row_model(ctx, n: int, logdir: str | None = None, pause: float = 0.0):
    """A tiny Hugging Face model built from its config (no hub download): y = a x + b,
    counting the ids it trained on (a per-worker resource factory)."""
    from transformers import PretrainedConfig, PreTrainedModel

    class RowConfig(PretrainedConfig):
        model_type = "daskdist-rows"

        def __init__(self, n_rows: int = 1, **kwargs):
            self.n_rows = n_rows
            super().__init__(**kwargs)

    class RowModel(PreTrainedModel):
        config_class = RowConfig

        def __init__(self, config):
            super().__init__(config)
            self.net = torch.nn.Linear(1, 1)
            self.register_buffer("counts", torch.zeros(config.n_rows, dtype=torch.float64))
            self.post_init()

        def forward(self, x, y, id):  # noqa: A002 - the batch's column
            count_ids(self.counts, id)
            time.sleep(pause)
            pred = self.net(x.unsqueeze(-1)).squeeze(-1)
            return {"loss": (pred - y).pow(2).sum() / max(1, len(id))}

    torch.manual_seed(200 + ctx.worker_index)
    model = RowModel(RowConfig(n_rows=n))
    model.logdir = logdir
    return model


ROOT = Path(__file__).resolve().parent.parent


def complete_checkpoints(url: Path) -> list[int]:
    """The commits of the complete checkpoints under ``url`` (DCP's metadata written)."""
    return sorted(int(p.parent.name.split("-")[1]) for p in url.glob("commit-*/.metadata"))


def kill_a_job_past_its_checkpoints(argv: list[str], url: Path, logdir: Path,
                                    output: Path, timeout: float = 240.0) -> None:
    """Run ``python -m argv`` (a job on a LocalCluster of its own, logging its steps to
    ``logdir``) until it wrote two complete checkpoints to ``url`` and trained two steps
    past the newest, then SIGKILL it whole (scheduler, workers, client: one session)."""
    from tests.conftest import child_env, wait_until

    env = child_env()

    def past_a_second_checkpoint() -> bool:  # steps that only the killed job saw
        kept = complete_checkpoints(url)
        steps = [e[2] for e in read_events(logdir) if e[1] == "step"]
        return len(kept) >= 2 and max(steps) >= kept[-1] + 2

    with open(output, "w") as out:
        job = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: past_a_second_checkpoint() or job.poll() is not None,
                       timeout, "two complete checkpoints of the first job, two steps past")
            assert job.poll() is None, output.read_text()[-3000:]
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)


def rss_and_threads() -> tuple[int, list[str]]:
    """This worker's RSS and its threads' names (run with ``client.run``)."""
    import threading

    import psutil

    return psutil.Process().memory_info().rss, sorted(t.name for t in threading.enumerate())


def assert_flat(samples: list[dict]) -> None:
    """``samples``: :func:`rss_and_threads` per worker after each run of a cell. After the
    first run (imports, first allocations), flat: the last run's RSS within 30 MB of the
    second's, and the same threads every time."""
    for addr in samples[0]:
        rss = [s[addr][0] for s in samples]
        threads = [s[addr][1] for s in samples]
        print(f"{addr}: RSS after each cell {[r // 2**20 for r in rss]} MB, "
              f"threads {[len(t) for t in threads]}")
        assert rss[-1] - rss[1] < 30 * 2**20, [r // 2**20 for r in rss]
        assert threads[-1] == threads[1], (threads[1], threads[-1])
