"""A batch-inference job's output on any fsspec filesystem: where units stage, how one is
committed, the ledger of committed units, the manifest and ``_SUCCESS``, and how a new
run of the job resumes from them.

Layout (``<output>`` a directory or URL)::

    <output>/part-<first row id, 16 hex digits>.parquet   a committed unit's rows
    <output>/_manifest.json, <output>/_SUCCESS            once the job completed
    <output>/_daskdist/job.json                           the job: name, source fingerprint
    <output>/_daskdist/ledger/<first row id>.json         a committed unit: rows, file
    <output>/_daskdist/staging/<attempt>.staged           an attempt's output, until committed

Readers never see staging: it is under a ``_`` folder (``pyarrow.dataset`` skips those)
and its files do not end in ``.parquet`` (``dask.dataframe.read_parquet`` reads the
``.parquet`` files of such folders too). A unit is committed (Hadoop's v1 task commit)
by writing its ledger record, then moving its staged file to its name; both steps are
idempotent, so a unit whose worker was lost between them is published by the job's
finalization, or by the next run (rolled forward). Where a rename is atomic (a local or
POSIX filesystem) a directory reader sees each committed unit once, whole. On object
stores a move is a copy and a delete: there the manifest decides what is committed, and
readers read the files it lists (``job.files()``; the module :func:`manifest_files`).

The ledger is what a new run resumes from: one small record a unit (its row ranges, and
a partition's length), listed and read in one pass; the input is never scanned.
"""

from __future__ import annotations

import datetime
import json
import posixpath
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from daskdist.core.intervals import Interval, normalize, size_of

__all__ = ["Output", "Resume", "manifest_files"]

META, LEDGER, STAGING = "_daskdist", "_daskdist/ledger", "_daskdist/staging"
JOB, MANIFEST, SUCCESS = "_daskdist/job.json", "_manifest.json", "_SUCCESS"
STAGED = ".staged"
PART = re.compile(r"^part-[0-9a-f]{16}\.parquet$")


@dataclass
class Resume:
    """What the output holds of a job's earlier runs: the rows committed (intervals),
    the partitions' lengths learned (``{partition: rows}``), units and their output
    rows; ``complete`` once ``_SUCCESS`` was written."""

    committed: list[Interval] = field(default_factory=list)
    lengths: dict[int, int] = field(default_factory=dict)
    units: int = 0
    out_rows: int = 0
    complete: bool = False

    @property
    def rows(self) -> int:
        return size_of(self.committed)


class Output:
    """A job's output directory (module doc). Picklable: workers stage, commit and
    finalize through it; the client prepares it and reads its manifest."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        from fsspec.core import url_to_fs

        self.storage_options = dict(storage_options or {})
        self.fs, root = url_to_fs(str(url), **self.storage_options)
        self.root = root.rstrip("/") or "/"
        self.local = _is_local(self.fs)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.url = self.root if self.local else f"{protocol}://{self.root.lstrip('/')}"

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, name: str) -> str:
        """A file of the output as a URL a reader opens (a path, for a local one)."""
        if self.local:
            return self.path(name)
        return f"{self.url.rstrip('/')}/{name}"

    def staged(self, attempt: str) -> str:
        """Where ``attempt`` stages its unit's output."""
        safe = re.sub(r"[^A-Za-z0-9_.#-]", "_", attempt).replace("#", "-a")
        return self.path(STAGING, f"{safe}-{uuid.uuid4().hex[:8]}{STAGED}")

    def open(self, path: str, mode: str = "rb") -> Any:
        """A file of the output (its folder made first, to write)."""
        if "w" in mode:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        return self.fs.open(path, mode)

    def discard(self, path: str) -> None:
        """Remove a staged file that will never be committed (refused, or failed)."""
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    # -- committing a unit ----------------------------------------------------------------
    def publish(self, record: dict) -> None:
        """Commit a decided unit: its ledger record, then its staged file moved to its
        name (idempotent: a unit published already stays as it is)."""
        self._write_json(self.path(LEDGER, f"{int(record['first']):016x}.json"), record)
        final = self.path(record["file"])
        if self.fs.exists(record["staged"]):
            self.fs.mv(record["staged"], final)
        elif not self.fs.exists(final):
            raise FileNotFoundError(f"unit {record['file']} of {self.url}: neither its staged "
                                    f"output {record['staged']} nor its file exists")

    def _write_json(self, path: str, obj: Any) -> None:
        """``obj`` at ``path``, whole or not at all: a temporary file renamed where a
        rename is atomic; one put (atomic on object stores) elsewhere."""
        data = json.dumps(obj, sort_keys=True).encode()
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if self.local:
            tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def _read_json(self, path: str) -> Any:
        return json.loads(self.fs.cat_file(path))

    # -- the client: check, resume, start over ------------------------------------------------
    def check_writable(self) -> None:
        """``ValueError`` naming the output when it cannot be written (a probe file)."""
        probe = self.path(META, f".probe-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.makedirs(self.path(META), exist_ok=True)
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 - any refusal of the filesystem
            raise ValueError(f"output {self.url!r} is not writable: {type(e).__name__}: "
                             f"{e}") from e

    def job(self) -> dict | None:
        """The job whose output this is (``None``: none yet)."""
        try:
            return self._read_json(self.path(JOB))
        except FileNotFoundError:
            return None

    def foreign(self) -> list[str]:
        """Entries of the output that are not a job's (a directory readers would mix in)."""
        try:
            names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root,
                                                                            detail=False)]
        except FileNotFoundError:
            return []
        return sorted(n for n in names
                      if n not in (META, MANIFEST, SUCCESS) and not PART.match(n))

    def start(self, info: dict) -> None:
        """A new job's record (its name and source), before anything is written."""
        self._write_json(self.path(JOB), info)

    def clear(self) -> None:
        """Start over: remove every file of a job's (never others')."""
        for name in [*self._parts(), MANIFEST, SUCCESS, META]:
            path = self.path(name)
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

    def resume(self) -> Resume:
        """What earlier runs committed, once the output is made consistent: a recorded
        unit whose file is missing is rolled forward from its staged output (or, with
        neither, forgotten), files without a record (a lost attempt's) and staging go."""
        out = Resume(complete=self.fs.exists(self.path(SUCCESS)))
        parts = set(self._parts())
        records = self.records()
        rows: list[Interval] = []
        for rec in records:
            if rec["file"] not in parts:
                try:
                    self.publish(rec)
                except FileNotFoundError:
                    self.fs.rm_file(self.path(LEDGER, f"{int(rec['first']):016x}.json"))
                    continue
            rows += [tuple(r) for r in rec["rows"]]
            out.units += 1
            out.out_rows += int(rec["out_rows"])
            out.lengths.update((int(p), int(n)) for p, n in rec.get("lengths", ()))
        kept = {rec["file"] for rec in records}
        for name in parts - kept:
            self.fs.rm_file(self.path(name))
        if not out.complete and self.fs.exists(self.path(STAGING)):
            self.fs.rm(self.path(STAGING), recursive=True)
        out.committed = normalize(rows)
        return out

    def records(self) -> list[dict]:
        """Every committed unit's ledger record, in row order (one listing, one read)."""
        try:
            paths = [p for p in self.fs.ls(self.path(LEDGER), detail=False)
                     if p.endswith(".json")]
        except FileNotFoundError:
            return []
        found = self.fs.cat(paths) if paths else {}
        records = [json.loads(data) for data in found.values()]
        return sorted(records, key=lambda r: int(r["first"]))

    def _parts(self) -> list[str]:
        try:
            names = [posixpath.basename(p) for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        return [n for n in names if PART.match(n)]

    # -- the job's end ----------------------------------------------------------------------------
    def finalize(self, orphans: Iterable[dict]) -> dict:
        """Hadoop's job commit: publish ``orphans`` (decided units their attempts did not
        publish), remove files without a record and the staging, write the manifest
        (every committed unit's file, rows and output rows), then ``_SUCCESS``. The
        manifest."""
        for rec in orphans:
            self.publish(rec)
        records = self.records()
        kept = {rec["file"] for rec in records}
        for name in set(self._parts()) - kept:
            self.fs.rm_file(self.path(name))
        if self.fs.exists(self.path(STAGING)):
            self.fs.rm(self.path(STAGING), recursive=True)
        job = self.job() or {}
        manifest = {
            "job": job.get("name"), "fingerprint": job.get("fingerprint"),
            "source": job.get("source"),
            "completed": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "units": len(records),
            "rows": sum(size_of(tuple(r) for r in rec["rows"]) for rec in records),
            "out_rows": sum(int(rec["out_rows"]) for rec in records),
            "files": [{"file": rec["file"], "rows": rec["rows"], "out_rows": rec["out_rows"]}
                      for rec in records],
        }
        self._write_json(self.path(MANIFEST), manifest)
        self.fs.pipe_file(self.path(SUCCESS), b"")
        return manifest

    def manifest(self) -> dict | None:
        try:
            return self._read_json(self.path(MANIFEST))
        except FileNotFoundError:
            return None

    def __repr__(self) -> str:
        return f"Output({self.url!r})"


def _is_local(fs: Any) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return bool({"file", "local"} & set(protocols))


def manifest_files(output: str, storage_options: dict | None = None) -> list[str]:
    """The files a completed job's manifest lists, as URLs (what a reader of an object
    store reads: ``dd.read_parquet(manifest_files(url))``)."""
    out = Output(output, storage_options)
    manifest = out.manifest()
    if manifest is None:
        raise FileNotFoundError(f"{out.url} has no {MANIFEST}: the job has not completed")
    return [out.url_of(f["file"]) for f in manifest["files"]]
