"""Durable commits: a State's checkpoints under one fsspec URL (SPEC §4.3).

Each checkpoint is a directory ``commit-<n>`` holding one ``torch.distributed.checkpoint``
(DCP) checkpoint of the committed state of commit ``n``: the model's tensors as DCP
entries, and one DCP bytes entry with the optimizer's state, the named objects and
daskdist's own record (the commit count, the step's wall time, and the ledger of every
``"dynamic"`` dataset trained under the State, taken from the same commit). DCP writes
its ``.metadata`` last, by rename, so a directory without it was cut off mid-write and
is never loaded. The newest ``daskdist.collective.checkpoint-keep`` complete ones stay.

One member writes (the state is replicated on every rank: rank 0 of the generation),
in a background thread of its own, single-process DCP (``no_dist``: no collective call
competes with training); every member reads when a State resumes from one.
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from daskdist import config

logger = logging.getLogger(__name__)


def without_group(call: Any) -> Any:
    """A ``no_dist`` DCP save or load, ``call()``. DCP's logging still asks
    torch.distributed for the default group's backend when one is up, and a re-formation
    on another thread (a member leaving while a checkpoint is written) may destroy the
    group in between: the call then fails though it needs no group. It runs once more
    then, the group gone or a new one up."""
    try:
        return call()
    except (CheckpointException, ValueError) as e:  # in a write's step, or before it
        if "process group has not been initialized" not in str(e):
            raise
        logger.info("daskdist: a checkpoint call met a process group torn down meanwhile; "
                    "once more")
        return call()


_PREFIX = "commit-"
_DIGITS = 12
_NAME = re.compile(rf"{_PREFIX}(\d{{{_DIGITS}}})$")
METADATA = ".metadata"  # DCP's, written last (by rename)


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its directory URL and the commit it holds."""

    url: str
    commits: int


@dataclass
class Written:
    """What a finished write reports: the commit, its directory, seconds and bytes."""

    info: CheckpointInfo
    seconds: float
    nbytes: int


def _blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class CheckpointStore:
    """The checkpoints of one State under ``url`` (any fsspec URL; a local directory).

    ``write`` hands a committed snapshot to a background thread and returns a future of
    :class:`Written`; at most one write runs at a time (a write asked for while one is
    running is skipped: the next one comes ``every`` commits later). ``latest`` and
    ``load`` may be called from any thread.
    """

    def __init__(self, url: str, keep: int | None = None) -> None:
        self.url = str(url).rstrip("/")
        self.keep = int(config.get("collective.checkpoint-keep") if keep is None else keep)
        if self.keep < 1:
            raise ValueError(f"checkpoint-keep must be >= 1, got {self.keep}")
        self.fs, self._root = fsspec.core.url_to_fs(self.url)
        self._executor: ThreadPoolExecutor | None = None
        self._running: Future | None = None
        self._lock = threading.Lock()
        self.seconds: float | None = None  # the last write's (a just-in-time one's estimate)

    def __getstate__(self) -> dict:
        return {"url": self.url, "keep": self.keep}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["keep"])

    def _local(self) -> bool:
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))

    def reader(self, url: str) -> Any:
        """DCP's storage reader of checkpoint directory ``url``."""
        if self._local():
            return FileSystemReader(url)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url)

    def writer(self, url: str) -> Any:
        """DCP's storage writer into checkpoint directory ``url``."""
        if self._local():
            return FileSystemWriter(url)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(url)

    # -- reading -------------------------------------------------------------------------
    def dir_of(self, commits: int) -> str:
        """The path of commit ``commits``'s checkpoint directory."""
        return f"{self._root}/{_PREFIX}{int(commits):0{_DIGITS}d}"

    def url_of(self, path: str) -> str:
        """The URL of ``path`` in the store's filesystem."""
        return self.fs.unstrip_protocol(path) if "://" in self.url else path

    def complete(self) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest first."""
        try:
            entries = self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for path in entries:
            m = _NAME.search(path.rstrip("/"))
            if m and self.fs.exists(f"{path.rstrip('/')}/{METADATA}"):
                out.append(CheckpointInfo(self.url_of(path.rstrip("/")), int(m.group(1))))
        return sorted(out, key=lambda c: c.commits)

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or ``None``."""
        done = self.complete()
        return done[-1] if done else None

    def load(self, info: CheckpointInfo, model_state: dict | None) -> tuple[dict | None, dict]:
        """Read ``info``: the model's tensors into ``model_state`` (a model's own
        ``state_dict()``, loaded in place) and the rest: ``(model_state, extra)`` where
        ``extra`` holds ``optimizer``, ``objects`` and ``record``."""
        state: dict[str, Any] = {"daskdist": b""}
        if model_state is not None:
            state["model"] = model_state
        without_group(lambda: dcp.load(state, storage_reader=self.reader(info.url),
                                         no_dist=True))
        extra = torch.load(io.BytesIO(state["daskdist"]), map_location="cpu",
                           weights_only=False)
        return state.get("model"), extra

    # -- writing -------------------------------------------------------------------------
    @property
    def writing(self) -> bool:
        with self._lock:
            return self._running is not None and not self._running.done()

    def write(self, commits: int, model_state: dict | None, optimizer_state: Any,
              objects: dict, record: dict) -> Future | None:
        """Write commit ``commits`` in the background (the snapshot must not change
        meanwhile: a State's committed copy never does). ``None`` if a write is still
        running."""
        return self.submit(self._write, int(commits), model_state, optimizer_state,
                           objects, record)

    def submit(self, job: Any, *args: Any) -> Future | None:
        """Run ``job(*args)`` (a write) in the store's background thread; ``None`` if a
        write is still running there."""
        with self._lock:
            if self._running is not None and not self._running.done():
                return None
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="daskdist-ckpt")
            fut = self._executor.submit(self._timed, job, *args)
            self._running = fut
            return fut

    def _timed(self, job: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = job(*args)
        self.seconds = time.perf_counter() - t0
        return out

    def _write(self, commits: int, model_state: dict | None, optimizer_state: Any,
               objects: dict, record: dict) -> Written:
        t0 = time.perf_counter()
        path = self.dir_of(commits)
        blob = _blob({"optimizer": optimizer_state, "objects": objects,
                      "record": {**record, "commits": commits, "time": time.time()}})
        state: dict[str, Any] = {"daskdist": blob}
        if model_state is not None:
            state["model"] = model_state
        url = self.url_of(path)

        def save() -> None:
            if self.fs.exists(path):  # a write of this commit cut off before: afresh
                self.fs.rm(path, recursive=True)
            dcp.save(state, storage_writer=self.writer(url), no_dist=True)

        without_group(save)
        nbytes = sum(self.fs.size(p) for p in self.fs.find(path))
        self.prune()
        return Written(CheckpointInfo(url, commits), time.perf_counter() - t0, nbytes)

    def wait(self, timeout: float | None = None) -> Written | None:
        """Wait for the running write (``None`` if none ran); its error, if it failed."""
        with self._lock:
            fut = self._running
        return None if fut is None else fut.result(timeout)

    def prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; remove older directories,
        complete or cut off (a cut-off one newer than the kept ones may still be being
        written by another member: left alone)."""
        done = self.complete()
        if len(done) <= self.keep:
            return
        oldest_kept = done[-self.keep].commits
        try:
            entries = self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return
        for path in entries:
            m = _NAME.search(path.rstrip("/"))
            if m and int(m.group(1)) < oldest_kept:
                try:
                    self.fs.rm(path.rstrip("/"), recursive=True)
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)


class Durable:
    """What ``State.checkpoint_to(url, every)`` adds to a State: when a commit is
    written, by whom and with what, and what a resuming ``sync()`` loads.

    Rank 0 of the group writes every ``every``-th commit, in the background, with the
    ledger of the State's ``"dynamic"`` datasets as the scheduler holds it at that
    commit (asked for before any later commit can apply), and reports the write to the
    scheduler (dashboard, metrics). A member that leaves with no other member holding
    the state writes the commit it leaves at and waits for it (``write(..., wait=True)``).
    """

    def __init__(self, url: str, every: int) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"checkpoint_to: every must be a positive int, got {every!r}")
        self.store = CheckpointStore(url)
        self.every = every

    def due(self, commits: int) -> bool:
        return commits > 0 and commits % self.every == 0

    def newest(self) -> int:
        """The commit the newest complete checkpoint holds (0: none)."""
        info = self.store.latest()
        return 0 if info is None else info.commits

    def write(self, state_id: str, commits: int, snapshot: tuple, services: Any,
              wait: bool = False) -> Future | None:
        """Write ``snapshot`` (a State's committed copy: model and optimizer state dicts,
        objects) as commit ``commits``, with its datasets' ledger; reported to the
        scheduler once written. ``wait``: block until written (a leaving last holder)."""
        if wait:
            self.store.wait()  # a background write (of this commit, maybe) first
            if self.newest() >= commits:
                return None
        ledger = services.dataset_ledger(state_id) if services is not None else {}
        model_sd, opt_sd, objects = snapshot
        fut = self.store.write(commits, model_sd, opt_sd, objects,
                               {"state": state_id, "ledger": ledger})
        if fut is None:
            logger.info("daskdist: checkpoint of commit %d skipped: the previous write "
                        "still runs", commits)
            return None
        if services is not None:
            fut.add_done_callback(lambda f: report_written(services, state_id, f))
        if wait:
            fut.result()
        return fut

    def load(self, commits: int, model_state: dict | None) -> tuple[Any, dict, dict]:
        """Read checkpoint ``commits`` (the model's tensors into ``model_state``):
        ``(optimizer state, objects, record)``; the record holds the ledger."""
        info = CheckpointInfo(self.store.url_of(self.store.dir_of(commits)), commits)
        _, extra = self.store.load(info, model_state)
        return extra["optimizer"], extra["objects"], extra["record"]


def report_written(services: Any, state_id: str, fut: Future) -> None:
    """Tell the scheduler a checkpoint was written (writer thread; best effort)."""
    try:
        w = fut.result()
    except Exception as e:  # noqa: BLE001 - a failed write is logged; training goes on
        logger.warning("daskdist: checkpoint write failed: %r", e)
        return
    try:
        services.checkpoint_written(state_id, w.info.url, w.info.commits, w.seconds,
                                    w.nbytes)
    except Exception as e:  # noqa: BLE001 - the checkpoint is complete; only the report
        # (dashboard, metrics) is lost: its coordinator closed, or its session ended
        logger.debug("daskdist: checkpoint %s written; its report failed: %r",
                     w.info.url, e)
