"""Stopping the ``daskdist`` demo as a user does: Ctrl-C to its process group, and the
watchdog that ends a stop taking too long; real subprocesses, real SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import daskdist
from tests.conftest import child_env, wait_until

PACKAGE = str(Path(daskdist.__file__).parent) + os.sep  # a frame of daskdist's own code


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


@pytest.mark.slow
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
        # the workers left the Ctrl-C to the demo: none died of it, and no daskdist code
        # raised on the way out (a worker whose heartbeat meets the scheduler already
        # closed logs Dask's own traceback: a race inside Dask's shutdown, not a failure)
        assert "KeyboardInterrupt" not in err, err[-3000:]
        assert f'File "{PACKAGE}' not in err, err[-3000:]
        assert "stopped at once" not in err  # a graceful stop, not the watchdog
        assert not list(tmp.glob("daskdist-*"))  # the synthetic shards were removed
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
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
