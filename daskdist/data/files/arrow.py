"""Arrow shards: Parquet and Arrow IPC (Feather v2) files as an ordered list of units.

:class:`ArrowShards` resolves a source (a directory, a glob, a list of paths, fsspec URLs
such as ``memory://``, or a ``pyarrow.dataset.FileSystemDataset``) into files, and each
file into *units* of work: Parquet row groups or IPC record batches, in a stable order
(sorted paths, then piece index). A unit's rows get global ids by that order, which is
what the sharding policies and the dynamic lease table speak in.

File metadata (footers only) is read lazily, once, on first use of :attr:`ArrowShards.units`
and cached (and pickled with the object, so workers agree with the client). That is
also where a corrupt file or one whose schema does not match the first file raises a
``ValueError`` naming it, before any batch is read. Discovery goes through fsspec
(``fsspec.core.url_to_fs``; pyarrow filesystems are wrapped with ``ArrowFSWrapper``);
local files are read by pyarrow directly.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

__all__ = ["ArrowShards", "Unit"]

_PARQUET_EXT = (".parquet", ".pq", ".parq")
_IPC_EXT = (".arrow", ".feather", ".ipc", ".arrows")
_GLOB_CHARS = ("*", "?", "[")


@dataclass(frozen=True)
class Unit:
    """One unit of work: a Parquet row group or an IPC record batch of one file."""

    index: int  # position in the stable order of all units
    file_index: int  # position of the file in the stable order of files
    path: str
    piece: int  # row-group / record-batch index inside the file
    num_rows: int
    start: int  # global id of the unit's first row


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _format_of(path: str) -> str | None:
    low = path.lower()
    if low.endswith(_PARQUET_EXT):
        return "parquet"
    if low.endswith(_IPC_EXT):
        return "ipc"
    return None


class ArrowShards:
    """Parquet / Arrow IPC files as an ordered list of :class:`Unit`.

    ``source``: a directory (searched recursively for ``.parquet``/``.arrow``/``.feather``
    files), a glob, a single file, a list of paths or URLs, or a
    ``pyarrow.dataset.FileSystemDataset``. ``columns`` restricts what is read and checked.
    ``filesystem``: an fsspec or pyarrow filesystem (default: inferred from the paths).
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str | os.PathLike] | pads.Dataset,
        columns: Sequence[str] | None = None,
        filesystem: Any = None,
    ) -> None:
        self.columns = list(columns) if columns is not None else None
        self._units: list[Unit] | None = None
        self._schema: pa.Schema | None = None
        self._formats: dict[str, str] = {}
        if isinstance(source, pads.Dataset):
            if not isinstance(source, pads.FileSystemDataset):
                raise TypeError("ArrowShards needs a file-backed pyarrow.dataset.Dataset")
            self.pattern = f"<pyarrow dataset of {len(source.files)} files>"
            self.fs = self._wrap_fs(source.filesystem)
            fmt = "parquet" if isinstance(source.format, pads.ParquetFileFormat) else "ipc"
            self.files = sorted(source.files)
            self._formats = {f: fmt for f in self.files}
        else:
            self.fs, self.files, self.pattern = self._resolve(source, filesystem)
        if not self.files:
            raise FileNotFoundError(f"no Parquet or Arrow files found for {self.pattern!r}")

    # -- discovery ---------------------------------------------------------------------
    @staticmethod
    def _wrap_fs(filesystem: Any) -> Any:
        if filesystem is None or isinstance(filesystem, fsspec.AbstractFileSystem):
            return filesystem
        if isinstance(filesystem, pafs.LocalFileSystem):
            return fsspec.filesystem("file")
        if isinstance(filesystem, pafs.FileSystem):
            from fsspec.implementations.arrow import ArrowFSWrapper

            return ArrowFSWrapper(filesystem)
        raise TypeError(f"filesystem must be fsspec or pyarrow, got {type(filesystem)!r}")

    @classmethod
    def _resolve(cls, source: Any, filesystem: Any) -> tuple[Any, list[str], str]:
        fs = cls._wrap_fs(filesystem)
        items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
        if not items:
            raise FileNotFoundError("no Parquet or Arrow files found for '[]' (empty list)")
        pattern = str(items[0]) if len(items) == 1 else repr([str(s) for s in items])
        found: list[str] = []
        for item in items:
            item = os.fspath(item)
            if fs is None:
                fs, path = fsspec.core.url_to_fs(item)
            else:
                path = fs._strip_protocol(item)
            if any(c in path for c in _GLOB_CHARS):
                found.extend(p for p in fs.glob(path) if fs.isfile(p))
            elif fs.isdir(path):
                found.extend(p for p in fs.find(path) if _format_of(p))
            elif fs.exists(path):
                found.append(path)
        files = sorted(dict.fromkeys(found))
        if fs is not None and not _is_local(fs):
            files = [fs.unstrip_protocol(f) if "://" not in f else f for f in files]
        return fs, files, pattern

    # -- metadata ----------------------------------------------------------------------
    def _open(self, path: str) -> Any:
        if _is_local(self.fs):
            return pa.memory_map(path)  # local: pyarrow reads the mapped pages directly
        return self.fs.open(path, "rb")

    def _sniff(self, path: str) -> str:
        fmt = self._formats.get(path) or _format_of(path)
        if fmt is None:
            with self.fs.open(path, "rb") as f:
                magic = f.read(6)
            fmt = "parquet" if magic[:4] == b"PAR1" else "ipc" if magic == b"ARROW1" else None
            if fmt is None:
                raise ValueError(f"{path}: not a Parquet or Arrow IPC file")
        self._formats[path] = fmt
        return fmt

    def _file_meta(self, path: str) -> tuple[pa.Schema, list[int]]:
        try:
            fmt = self._sniff(path)
            if fmt == "parquet":
                md = pq.ParquetFile(self._open(path)).metadata
                counts = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
                return md.schema.to_arrow_schema(), counts
            reader = ipc.open_file(self._open(path))
            counts = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
            return reader.schema, counts
        except ValueError as e:
            if str(e).startswith(path):
                raise
            raise ValueError(f"{path}: corrupt or unreadable Arrow/Parquet file: {e}") from e
        except OSError as e:
            raise ValueError(f"{path}: corrupt or unreadable Arrow/Parquet file: {e}") from e

    def _project(self, schema: pa.Schema, path: str) -> pa.Schema:
        if self.columns is None:
            return pa.schema([f.remove_metadata() for f in schema]).remove_metadata()
        missing = [c for c in self.columns if c not in schema.names]
        if missing:
            raise ValueError(f"{path}: schema mismatch: missing column(s) {missing}")
        return pa.schema([schema.field(c).remove_metadata() for c in self.columns])

    def _load(self) -> None:
        units: list[Unit] = []
        schema: pa.Schema | None = None
        pos = 0
        for fi, path in enumerate(self.files):
            file_schema, counts = self._file_meta(path)
            projected = self._project(file_schema, path)
            if schema is None:
                schema = projected
            elif not projected.equals(schema):
                raise ValueError(
                    f"{path}: schema mismatch with {self.files[0]}: "
                    f"{projected.to_string(show_schema_metadata=False)!r} vs "
                    f"{schema.to_string(show_schema_metadata=False)!r}"
                )
            for piece, n in enumerate(counts):
                units.append(Unit(len(units), fi, path, piece, n, pos))
                pos += n
        self._schema, self._units = schema, units

    def validate(self) -> ArrowShards:
        """Read every footer now: ``ValueError`` naming a corrupt or mismatched file."""
        if self._units is None:
            self._load()
        return self

    @property
    def units(self) -> list[Unit]:
        """Every unit in stable order (reads the footers on first use)."""
        if self._units is None:
            self._load()
        return self._units  # type: ignore[return-value]

    @property
    def schema(self) -> pa.Schema:
        """The (projected) schema every file shares."""
        if self._schema is None:
            self._load()
        return self._schema  # type: ignore[return-value]

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.units)

    @property
    def num_files(self) -> int:
        return len(self.files)

    def fingerprint(self) -> str:
        """A stable hash of the units (paths, pieces, row counts): what a loader's state
        must match to be resumed (never a dataset's identity: that is the call that
        made it)."""
        desc = [[u.path, u.piece, u.num_rows] for u in self.units]
        return hashlib.sha1(json.dumps(desc).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.units)

    def __repr__(self) -> str:
        n = f", {len(self._units)} units" if self._units is not None else ""
        return f"ArrowShards({self.pattern!r}, {len(self.files)} files{n})"

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    # -- reading -----------------------------------------------------------------------
    def reader(self) -> UnitReader:
        """A reader for units; keep one per thread (it keeps files open)."""
        return UnitReader(self)


class UnitReader:
    """Reads units of one :class:`ArrowShards`, keeping up to ``max_open`` files open.

    A shuffled epoch visits files in a random order, so a reader that kept only the last
    file would open it again (footer parse, mapping) for almost every unit; a few open
    files are kept in least-recently-used order instead (a small bound: what an open
    file holds must not grow with the dataset). Use one reader per thread.
    """

    def __init__(self, shards: ArrowShards, max_open: int = 8) -> None:
        self.shards = shards
        self.max_open = max(1, int(max_open))
        self._files: OrderedDict[str, Any] = OrderedDict()

    def _file(self, path: str) -> Any:
        f = self._files.get(path)
        if f is not None:
            self._files.move_to_end(path)
            return f
        fmt = self.shards._sniff(path)
        src = self.shards._open(path)
        if fmt == "parquet":
            # Remote files: one coalesced read per row group instead of one per column.
            # Mapped local files gain nothing from it (their pages are read in place)
            # and read faster without it here (0.13 s against 0.14 s for 4 M rows).
            f = pq.ParquetFile(src, pre_buffer=not isinstance(src, pa.MemoryMappedFile))
        else:
            f = ipc.open_file(src)
        self._files[path] = f
        while len(self._files) > self.max_open:
            self._files.popitem(last=False)
        return f

    def read(self, unit: Unit, columns: Sequence[str] | None) -> pa.Table:
        """The unit's rows as a table of ``columns``; ``ValueError`` naming a bad file."""
        path = unit.path
        try:
            f = self._file(path)
            if isinstance(f, pq.ParquetFile):
                table = f.read_row_group(unit.piece, columns=columns)
            else:
                batch = f.get_batch(unit.piece)
                if columns is not None:
                    batch = batch.select(list(columns))
                table = pa.Table.from_batches([batch])
        except (OSError, pa.ArrowException) as e:
            self._files.pop(path, None)
            raise ValueError(f"{path}: corrupt or unreadable Arrow/Parquet file: {e}") from e
        if table.num_rows != unit.num_rows:
            raise ValueError(
                f"{path}: piece {unit.piece} has {table.num_rows} rows, "
                f"footer said {unit.num_rows} (file changed or corrupt)"
            )
        return table

    def close(self) -> None:
        self._files.clear()
