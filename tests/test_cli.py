"""The ``daskdist`` command as a user runs it: real subprocesses, real clusters, real SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import child_env, wait_until

pytestmark = pytest.mark.timeout(240)


def cli(*args: str, tmp: Path, timeout: float = 200) -> subprocess.CompletedProcess:
    env = child_env(TMPDIR=str(tmp))
    return subprocess.run([sys.executable, "-m", "daskdist.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=tmp)


@pytest.fixture
def tmp(tmp_path) -> Path:
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


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


def session_processes(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(stat.parent.name))
    return pids


def _start_demo(tmp: Path, **env: str) -> subprocess.Popen:
    """The demo on its own LocalCluster, in a session of its own (as a terminal runs a
    job: Ctrl-C goes to the whole process group), once its workers are up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "daskdist.cli", "demo", "--workers", "2", "--epochs", "50",
         "--rows", "100000", "--batch-size", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=child_env(TMPDIR=str(tmp), **env), cwd=tmp,
        start_new_session=True)
    line = ""
    deadline = time.monotonic() + 150
    while not line.startswith("cluster"):  # workers are up: training starts now
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        line = proc.stdout.readline()
    assert len(session_processes(proc.pid)) >= 3  # the demo and its worker processes
    return proc


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.timeout(360)  # the demo's start, the stop and the workers' exit, loaded machine
def test_ctrl_c_stops_the_demo_and_its_cluster(tmp):
    # a loaded machine's graceful stop may take long: the watchdog (its own test below)
    # waits 60 s here, and proc.wait's 90 s is a deadline, not a timing (the seconds go
    # to benchmarks/bench_stop.py)
    proc = _start_demo(tmp, DASK_DASKDIST__DEMO__STOP_TIMEOUT="60s")
    try:
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the demo and its worker processes
        rc = proc.wait(90)
        print(f"Ctrl-C -> exit {rc} in {time.monotonic() - t0:.2f} s")
        err = proc.stderr.read()
        assert rc == 130, err[-3000:]
        wait_until(lambda: not session_processes(proc.pid), 30, "worker processes to exit")
        assert "Traceback" not in err, err[-3000:]  # the workers left the Ctrl-C to the demo
        assert "stopped at once" not in err  # a graceful stop, not the watchdog
        assert not list(tmp.glob("daskdist-*"))  # the synthetic shards were removed
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.timeout(360)
def test_a_stop_that_takes_too_long_is_cut_short_never_a_hang(tmp):
    """The watchdog: a stop-timeout shorter than any close, so it always fires; the
    process still exits with 130 and leaves no worker process behind."""
    proc = _start_demo(tmp, DASK_DASKDIST__DEMO__STOP_TIMEOUT="1ms")
    try:
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(90)
        err = proc.stderr.read()
        assert rc == 130, err[-3000:]
        assert "stopped at once" in err, err[-3000:]
        wait_until(lambda: not session_processes(proc.pid), 30, "worker processes to exit")
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


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
