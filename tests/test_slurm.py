"""HPC: dask-jobqueue on a real one-node Slurm, started by the test without systemd.

The fixture starts Debian's munged (as user ``munge``), ``slurmctld -D`` and ``slurmd -D``
(as root) on a minimal ``slurm.conf`` in a tmp dir (``SLURM_CONF``). The tests run
``examples/jobqueue_slurm.py``:

- ``train`` on two jobs, cancelling one mid-epoch: the epoch completes, every row once;
- the resumable epoch (``State.checkpoint_to`` on a shared directory, a named dynamic
  dataset): every job of a first allocation is ``scancel``ed mid-epoch and its
  scheduler closed, then a second SLURMCluster (new scheduler, client, coordinator and
  jobs of another shape) resumes from the newest complete checkpoint: the committed
  per-row counts hold every row of the epoch exactly once across the two;
- the README's preemption-notice settings: Slurm's batch-step SIGTERM (what
  ``--signal=B:TERM@N`` sends) reaches the worker process itself.

They skip, saying why, where the packages (``.ci/run`` installs them) or root are missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)

DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "sbatch", "scancel")


def missing() -> str | None:
    absent = [d for d in DAEMONS if not (shutil.which(d) or Path("/usr/sbin", d).exists())]
    if absent:
        return (f"Slurm/munge not installed ({', '.join(absent)} missing; .ci/run installs "
                "Debian's slurmctld slurmd slurm-client munge)")
    if importlib.util.find_spec("dask_jobqueue") is None:
        return "dask-jobqueue is not installed (pip install -e .[test])"
    if os.geteuid() != 0:
        return "starting slurmd and munged needs root (CI runs as root)"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (the munge package creates it)"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


SLURM_CONF = """\
ClusterName=daskdist
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 \
RealMemory=6000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm: yields its environment (``SLURM_CONF``) and the start seconds."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, dir=d, ctld_port=free_port(),
                                      d_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    t0 = time.monotonic()
    run = Path("/run/munge")
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    shutil.chown(run, "munge", "munge")
    procs: list[subprocess.Popen] = []
    log = open(d / "daemons.log", "w")  # noqa: SIM115 - closed at teardown
    try:
        procs.append(subprocess.Popen([_exe("munged"), "-F"], user="munge", group="munge",
                                      stdout=log, stderr=log))
        wait_until(lambda: (run / "munge.socket.2").exists(), 20, "munged's socket")
        procs.append(subprocess.Popen([_exe("slurmctld"), "-D", "-i"], env=env,
                                      stdout=log, stderr=log))
        procs.append(subprocess.Popen([_exe("slurmd"), "-D"], env=env, stdout=log,
                                      stderr=log))

        def idle():
            for p in procs:
                assert p.poll() is None, (d / "daemons.log").read_text()[-3000:]
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                               text=True)
            return r.stdout.strip() == "idle"

        wait_until(idle, 60, "the Slurm node to be idle", interval=0.2)
        started = time.monotonic() - t0
        print(f"slurm daemons up in {started:.1f} s")
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(conf)  # dask-jobqueue calls sbatch / scancel
        yield {"env": env, "dir": d, "started_seconds": started}
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
        wait_until(lambda: not subprocess.run(["squeue", "-h"], env=env, capture_output=True,
                                              text=True).stdout.strip(), 60, "an empty squeue")
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
    finally:
        for p in reversed(procs):  # slurmd, slurmctld, munged
            _stop(p)
        log.close()


def load_example():
    spec = importlib.util.spec_from_file_location("jobqueue_slurm",
                                                  ROOT / "examples" / "jobqueue_slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NOTICE = {  # the README's preemption-notice settings: the worker *is* the batch shell
    "nanny": False, "python": f"exec {sys.executable}",
    "job_extra_directives": ["--signal=B:TERM@60"],
}


def slurm_cluster(example, tmp_path: Path, cores: int = 1, processes: int = 1,
                  notice: bool = False):
    """A SLURMCluster of CPU jobs on the test's Slurm (the node has 2 CPUs); with
    ``notice``, one worker per job started with the README's notice settings."""
    from dask_jobqueue import SLURMCluster

    options = {"python": sys.executable, **(NOTICE if notice else {})}
    return SLURMCluster(
        cores=cores, memory=f"{2 * processes}GB", processes=processes, interface="lo",
        walltime="00:20:00", local_directory=str(tmp_path), log_directory=str(tmp_path),
        job_script_prologue=[f"export PYTHONPATH={ROOT}"],
        scheduler_options={**example.SCHEDULER_PRELOAD, "dashboard_address": None},
        **options,
    )


def queued(env: dict) -> set[str]:
    """The ids of the jobs Slurm still lists (running, pending or completing)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True,
                         text=True, check=True)
    return set(out.stdout.split())


def test_jobqueue_workers_train_and_survive_a_cancelled_job(slurm, tmp_path):
    from distributed import Client

    from daskdist.cli import write_shards

    example = load_example()
    data = tmp_path / "shards"
    data.mkdir()
    write_shards(data, 6000, 3)
    cluster = slurm_cluster(example, tmp_path)
    try:
        assert "#SBATCH" in cluster.job_script() and sys.executable in cluster.job_script()
        t = time.monotonic()
        cluster.scale(jobs=2)
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=120)
            print(f"two jobqueue workers registered in {time.monotonic() - t:.1f} s")
            jobs = sorted(j.job_id for j in cluster.workers.values())
            assert len(jobs) == 2

            def cancel_one():
                subprocess.run(["scancel", jobs[-1]], env=slurm["env"], check=True)

            out = example.train(client, str(data / "*.parquet"), workers=2,
                                during_epoch=cancel_one)
        assert out["group"].world_size == 2
        assert sorted(r[0] for r in out["ranks"]) == [0, 1]
        assert out["rows"] == 6000  # every row of the epoch exactly once
        p = out["progress"]
        assert p["complete"] and p["acknowledged"] == p["total"] == 6000
        # the cancelled job ends (it may still be completing: its processes exiting)
        wait_until(lambda: jobs[-1] not in queued(slurm["env"]), 60,
                   "the cancelled job to leave the queue")
    finally:
        cluster.close()


ROWS = 3000  # the resumable epoch: 50 steps
STEP = 60  # rows of a step, over both workers
EVERY = 4  # a checkpoint every 4 commits


def write_id_shards(root: Path) -> str:
    """Regression shards with a row ``id`` (0 .. ROWS-1): the state counts each row."""
    root.mkdir()
    rng = np.random.default_rng(0)
    for f in range(3):
        ids = np.arange(f * ROWS // 3, (f + 1) * ROWS // 3, dtype=np.int64)
        x = rng.standard_normal((len(ids), 16)).astype(np.float32)
        table = pa.table({"id": ids, "x": pa.FixedSizeListArray.from_arrays(x.ravel(), 16),
                          "y": x.sum(axis=1)})
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=100)
    return str(root / "*.parquet")


@pytest.mark.slow
def test_a_new_allocation_resumes_an_epoch_whose_jobs_were_all_cancelled(slurm, tmp_path):
    from distributed import Client

    from daskdist.collective.state.checkpoint import CheckpointStore

    example = load_example()
    data = write_id_shards(tmp_path / "ids")
    url = str(tmp_path / "checkpoints")  # shared: every job's node writes and reads it
    store = CheckpointStore(url)

    # the first allocation: two jobs train part of the epoch, then all are cancelled
    # (started as the README says, so scancel's SIGTERM is a notice to each worker
    # process: the test passes whether the worker leaves gracefully or just dies)
    first = slurm_cluster(example, tmp_path, notice=True)
    try:
        first.scale(jobs=2)
        with Client(first) as client:
            client.wait_for_workers(2, timeout=120)
            jobs = sorted(j.job_id for j in first.workers.values())
            run = example.start_resumable(client, data, 2, url, ROWS, every=EVERY,
                                          batch_size=STEP // 2)
            try:
                run.coord.schedule_on_all(example.epoch_steps,
                                          args=(run.state, run.iterator, 0.2))
                wait_until(lambda: len(store.complete()) >= 2
                           or run.dataset.progress()["complete"], 120,
                           "two complete checkpoints of the first allocation")
                t = time.monotonic()
                subprocess.run(["scancel", *jobs], env=slurm["env"], check=True)
                cancelled = run.dataset.progress()
                wait_until(lambda: not queued(slurm["env"]) & set(jobs), 120,
                           "every cancelled job to leave the queue")
                print(f"{len(jobs)} cancelled jobs gone in {time.monotonic() - t:.1f} s")
                after = run.dataset.progress()
            finally:
                run.coord.close()
    finally:
        first.close()  # the first allocation's scheduler: its state goes with it
    assert 0 < cancelled["acknowledged"] < cancelled["total"] == ROWS  # cut mid-epoch
    assert not after["complete"] and after["acknowledged"] < ROWS
    newest = store.latest()
    assert newest is not None and newest.commits >= 2 * EVERY

    # a new allocation: new scheduler, client, coordinator; one job of two workers
    second = slurm_cluster(example, tmp_path, cores=2, processes=2)
    try:
        t = time.monotonic()
        second.scale(jobs=1)
        with Client(second) as client:
            client.wait_for_workers(2, timeout=120)
            assert len({w.job_id for w in second.workers.values()}) == 1
            run = example.start_resumable(client, data, 2, url, ROWS, every=EVERY,
                                          batch_size=STEP // 2)
            try:
                runs = example.run_epoch(run)
                print(f"resumed and completed the epoch in {time.monotonic() - t:.1f} s")
                commits, seen = run.coord.fetch(run.coord.schedule_on_all(
                    example.committed, args=(run.state,)))[0]
                progress = run.dataset.progress()
            finally:
                run.coord.close()
    finally:
        second.close()
    resumed_at = runs[0][0][0]
    print(f"rows acknowledged at the scancel: {cancelled['acknowledged']}, once the jobs "
          f"were gone: {after['acknowledged']}; resumed at commit {resumed_at} "
          f"({resumed_at * STEP} rows)")
    assert resumed_at == newest.commits  # from the newest complete checkpoint, not 0
    # scancel's SIGTERM was a preemption notice: the leaving workers, the last holders,
    # checkpointed their last commit just in time, so no acknowledged step is lost
    assert resumed_at * STEP == after["acknowledged"], (resumed_at, after)
    c = np.asarray(seen)
    assert (c == 1).all(), (f"rows trained 0 times: {int((c == 0).sum())}, more than "
                            f"once: {int((c > 1).sum())}")
    assert progress["complete"] and progress["acknowledged"] == progress["total"] == ROWS
    assert commits == resumed_at + sum(r[0][1] for r in runs)
    assert store.latest().commits > resumed_at  # it went on checkpointing


def test_the_readme_notice_settings_signal_the_worker_process_itself(slurm, tmp_path):
    """``--signal=B:TERM@N`` signals the batch shell only; with the README's settings
    (``nanny=False``, ``exec``) that process is the worker. ``scancel --batch
    --signal=TERM`` sends what ``B:TERM@N`` sends, now instead of N s before the end."""
    from distributed import Client

    def record_sigterm(path: str) -> tuple[int, str]:
        """In the worker process (a closure: pickled by value): append this pid to
        ``path`` on each SIGTERM, then do what the handler before did. Returns the pid
        and the parent process's name."""
        import signal

        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.close(fd)
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_term)
        return os.getpid(), Path(f"/proc/{os.getppid()}/comm").read_text().strip()

    example = load_example()
    cluster = slurm_cluster(example, tmp_path, notice=True)
    try:
        script = cluster.job_script()
        assert "#SBATCH --signal=B:TERM@60" in script and "--no-nanny" in script
        assert f"exec {sys.executable} -m distributed.cli.dask_worker" in script
        cluster.scale(jobs=1)
        with Client(cluster) as client:
            client.wait_for_workers(1, timeout=120)
            job = next(iter(cluster.workers.values())).job_id
            record = tmp_path / "sigterm.log"
            (pid, parent), = client.run(record_sigterm, str(record)).values()
            assert parent == "slurmstepd"  # no batch shell between Slurm and the worker
            subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm["env"],
                           check=True)
            wait_until(lambda: record.exists() and record.read_text().split() == [str(pid)],
                       60, "the worker process to receive SIGTERM")
            wait_until(lambda: job not in queued(slurm["env"]), 60,
                       "the job to end with its worker")
    finally:
        cluster.close()
