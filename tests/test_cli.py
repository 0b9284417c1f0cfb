"""The ``daskdist`` command as a user runs it: real subprocesses and clusters (stopping it:
tests/test_cli_stop.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env

pytestmark = pytest.mark.timeout(240)


def cli(*args: str, tmp: Path, timeout: float = 200) -> subprocess.CompletedProcess:
    env = child_env(TMPDIR=str(tmp))
    return subprocess.run([sys.executable, "-m", "daskdist.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=tmp)


@pytest.mark.parametrize("args, names", [
    (["demo", "--bogus"], "--bogus"),
    (["demo", "--workers", "0"], "--workers"),
    (["demo", "--rows", "-5"], "--rows"),
    (["demo", "--batch-size", "x"], "--batch-size"),
    (["demo", "--epochs", "0"], "--epochs"),
    (["demo", "--data", "no-such-dir"], "no-such-dir"),
    (["demo", "--data", "empty"], "empty"),
    (["demo", "--scheduler", "tcp://127.0.0.1:1"], "tcp://127.0.0.1:1"),
    (["demo", "--scheduler", "nonsense"], "nonsense"),
    (["make-shards", "out", "--rows", "0"], "--rows"),
    (["make-shards", "out", "--files", "-1"], "--files"),
    (["frobnicate"], "frobnicate"),
])
def test_bad_input_is_one_line_and_status_2(tmp, args, names):
    (tmp / "empty").mkdir()
    before = sorted(p.name for p in tmp.iterdir())
    r = cli(*args, tmp=tmp, timeout=60)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("daskdist: error:"), r.stderr
    assert names in lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert sorted(p.name for p in tmp.iterdir()) == before  # nothing created


@pytest.mark.slow
def test_make_shards_then_demo_epochs_exactly_once_with_a_kill(tmp):
    r = cli("make-shards", "shards", "--rows", "6000", "--files", "3", tmp=tmp, timeout=60)
    assert r.returncode == 0, r.stderr
    assert len(list((tmp / "shards").glob("*.parquet"))) == 3
    again = cli("make-shards", "shards", tmp=tmp, timeout=60)  # never overwrites shards
    assert again.returncode == 2 and "shards" in again.stderr
    r = cli("demo", "--data", "shards", "--epochs", "2", "--workers", "2",
            "--batch-size", "100", "--steps", "5", "--kill", tmp=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    epochs = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch ")]
    assert len(epochs) == 2, r.stdout
    assert all("6,000 rows (each exactly once: 6,000 acknowledged of 6,000)" in ln
               for ln in epochs), r.stdout
    assert "killed    worker" in r.stdout + r.stderr
    assert "killed    rank 0" in r.stdout + r.stderr  # the synchronous phase's kill
    # the synchronous phase trains one dynamic epoch: every row in the committed model once
    assert "6,000 rows in the committed model (each exactly once: 6,000 acknowledged" \
        in r.stdout, r.stdout
    assert re.search(r"^sync      \d+ steps", r.stdout, re.M) and "summary" in r.stdout


@pytest.mark.slow
def test_demo_on_an_existing_scheduler(tmp):
    from distributed import Client

    from tests.conftest import make_cluster

    with make_cluster(2) as cluster, Client(cluster) as client:
        r = cli("demo", "--scheduler", cluster.scheduler_address, "--workers", "2",
                "--epochs", "1", "--rows", "2000", "--files", "2", "--steps", "3", tmp=tmp)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "2,000 rows (each exactly once: 2,000 acknowledged of 2,000)" in r.stdout
        assert "2,000 rows in the committed model (each exactly once" in r.stdout
        assert len(client.scheduler_info()["workers"]) == 2  # the cluster is left running
        r = cli("demo", "--scheduler", cluster.scheduler_address, "--workers", "3",
                "--wait", "2", "--steps", "0", "--rows", "1000", tmp=tmp, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--workers 3" in r.stderr
