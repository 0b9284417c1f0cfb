"""A notebook's kernel for tests/test_keepalive.py: run as ``python -m
tests.keepalive_job ADDRESS NAME OUT DATA``, it connects to the test's scheduler, makes
``Coordinator(name=NAME, keep_alive=True)``, defines a dataset ``train`` over DATA,
schedules a gang and closures (the last ones long), fetches the first FETCHED values,
writes which it fetched to ``OUT/fetched.json`` and waits to be killed. Its functions
are the test's too (pickled by reference)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import daskdist as dd

N = 24  # closures
FETCHED = 5  # the first ones, fetched before the kill
LONG = 6  # the last ones run long: unfinished when the kernel dies


def square(i: int, seconds: float) -> int:
    time.sleep(seconds)
    return i * i


def gang_rank(seconds: float) -> tuple[str, int]:
    time.sleep(seconds)
    return "rank", dd.collective.get_group().rank


def main(address: str, name: str, out: str, data: str) -> None:
    from distributed import Client

    client = Client(address)
    coord = dd.Coordinator(client, name=name, keep_alive=True)
    coord.wait_for_workers(3, timeout=120)
    coord.collective_group(timeout=60)
    train = coord.distribute_dataset(data, global_batch_size=60, policy="dynamic",
                                     name="train")
    coord.schedule_on_all(gang_rank, args=(2.0,))
    rvs = [coord.schedule(square, args=(i, 2.0 if i >= N - LONG else 0.1)) for i in range(N)]
    fetched = {i: rvs[i].fetch() for i in range(FETCHED)}
    assert train.progress()["total"] > 0  # the notebook holds its handle
    Path(out, "fetched.json").write_text(json.dumps(fetched))
    print("fetched", flush=True)
    time.sleep(600)  # killed by the test, like a kernel restarted


if __name__ == "__main__":
    main(*sys.argv[1:5])
