"""What ``predict`` returns, as Arrow, and a unit's output written off the predict thread.

``predict(model, batch)`` returns a dict of 1-D (or N-D: fixed-size lists) arrays or
tensors, a pandas DataFrame or a pyarrow Table, with any number of rows (a filter);
the ``keep`` columns of the batch are added beside, row for row, which needs one output
row per input row. A :class:`UnitWriter` takes each batch's output as it comes and, in a
thread of the engine's pool, moves it to the host, converts it and writes row groups of
the unit's staged Parquet file, so the predict thread only predicts.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from daskdist.data.convert import arrow_column

__all__ = ["UnitWriter", "from_ipc", "to_table"]


def _column(name: str, value: Any) -> pa.Array:
    """One output column as Arrow: tensors and arrays of any rank (N-D rows become
    nested fixed-size lists), lists of Python values."""
    if hasattr(value, "detach"):  # a torch tensor, on any device
        value = value.detach().cpu().numpy()
    if isinstance(value, pa.ChunkedArray | pa.Array):
        return value
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"predict's column {name!r} is a scalar; give one value per row")
        return arrow_column(value)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return pa.array(list(value))
    raise TypeError(f"predict's column {name!r} is a {type(value).__name__}; give an "
                    "array, a tensor or a list per column")


def to_table(out: Any, batch: Mapping, keep: Sequence[Any], rows_in: int) -> pa.Table:
    """``predict``'s output for a batch of ``rows_in`` rows as an Arrow table, with the
    ``keep`` columns of ``batch`` beside it (``ValueError`` naming the problem: keep=
    with a different number of rows, columns of different lengths, a name clash)."""
    if isinstance(out, pa.Table):
        table = out
    elif type(out).__module__.startswith("pandas") and hasattr(out, "columns"):
        table = pa.Table.from_pandas(out, preserve_index=False)
    elif isinstance(out, Mapping):
        if not out:
            raise ValueError("predict returned an empty dict; return at least one column")
        cols = {str(k): _column(str(k), v) for k, v in out.items()}
        lengths = {k: len(v) for k, v in cols.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"predict's columns differ in length: {lengths}")
        table = pa.table(cols)
    else:
        raise TypeError(f"predict must return a dict of arrays or tensors, a pandas "
                        f"DataFrame or a pyarrow Table, got {type(out).__name__}")
    if keep:
        if table.num_rows != rows_in:
            raise ValueError(f"predict returned {table.num_rows} rows for a batch of "
                             f"{rows_in}; keep= copies input columns row for row, so it "
                             "needs one output row per input row")
        for k in keep:
            if str(k) in table.column_names:
                raise ValueError(f"keep column {k!r} clashes with predict's column of the "
                                 "same name")
            table = table.append_column(str(k), _column(str(k), batch[k]))
    return table


class UnitWriter:
    """One unit's output, converted and written to ``path`` (a staged file of
    ``output``; ``None``: kept, for :attr:`data`) in ``pool``'s threads, in order, while
    the caller predicts the next batches. :meth:`close` waits for the last write and
    returns the rows written; :meth:`abort` drops what is left (the caller discards the
    file)."""

    def __init__(self, output: Any, path: str | None, pool: ThreadPoolExecutor,
                 row_group_rows: int) -> None:
        self.output = output
        self.path = path
        self.pool = pool
        self.row_group_rows = max(1, int(row_group_rows))
        self.rows = 0
        self._last: Future | None = None
        self._lock = threading.Lock()
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._file: Any = None
        self._aborted = False
        self._kept: list[pa.Table] = []  # in memory (no path)
        self.data = b""  # once closed, in memory: the unit's output as Arrow IPC

    def put(self, out: Any, batch: Mapping, keep: Sequence[Any], rows_in: int) -> None:
        """Queue one batch's output (converted and written in the pool, after the ones
        before it); a failure there is raised by a later :meth:`put` or :meth:`close`."""
        last = self._last
        if last is not None and last.done():
            last.result()  # raises what the writing thread met
        self._last = self.pool.submit(self._write, last, out, batch, keep, rows_in)

    def _write(self, before: Future | None, out: Any, batch: Mapping, keep: Sequence[Any],
               rows_in: int) -> None:
        if before is not None:
            before.result()  # in order; a failure before fails this one too
        if self._aborted:
            return
        table = to_table(out, batch, keep, rows_in)
        with self._lock:
            self._pending.append(table)
            self._pending_rows += table.num_rows
            if self._pending_rows >= self.row_group_rows:
                self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        table = pa.concat_tables(self._pending, promote_options="permissive")
        self._pending, self._pending_rows = [], 0
        if self.path is None:
            self._kept.append(table)
            self.rows += table.num_rows
            return
        if self._writer is None:
            self._file = self.output.open(self.path, "wb")
            self._writer = pq.ParquetWriter(self._file, table.schema)
        self._writer.write_table(table, row_group_size=self.row_group_rows)
        self.rows += table.num_rows

    def close(self) -> int:
        """Wait for every write and close the file: the unit's output rows."""
        if self._last is not None:
            self._last.result()
        with self._lock:
            self._flush()
            if self.path is None:
                self.data = _ipc(pa.concat_tables(self._kept, promote_options="permissive"))
                return self.rows
            self._writer.close()
            self._file.close()
        return self.rows

    def abort(self) -> None:
        """Stop writing (a predict failed): queued writes do nothing, the file closes."""
        self._aborted = True
        try:
            if self._last is not None:
                self._last.exception()
        finally:
            with self._lock:
                if self._writer is not None:
                    self._writer.close()
                if self._file is not None:
                    self._file.close()


def _ipc(table: pa.Table) -> bytes:
    """``table`` as an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    """An Arrow IPC stream's table (a unit's output returned in memory)."""
    return pa.ipc.open_stream(data).read_all()
