"""Arrow columns → torch tensors without per-row Python work.

A numeric column becomes a 1-D tensor built on the Arrow buffer (``to_numpy`` is
zero-copy for a single chunk without nulls; ``torch.from_numpy`` shares it); a
``fixed_size_list`` column (possibly nested) becomes a 2-D (N-D) tensor over the child
values buffer; booleans and temporal types are converted with one vectorised copy.
Strings, binary and other nested types are passed through as Python lists. Nulls in a
numeric column raise ``ValueError`` naming the column unless ``fill_null`` is given.

A block's converted columns form a :class:`Chunk` (under shuffling, gathered into one
2-D tensor per dtype), sliced into batch *views* (:func:`slice_cols`); only the rare
batch that straddles two chunks is concatenated (:func:`concat_cols`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from daskdist.core.nest import map_instances

__all__ = [
    "Chunk",
    "Columns",
    "arrow_column",
    "concat_cols",
    "convert_chunk",
    "convert_table",
    "num_rows",
    "pin",
    "slice_cols",
    "to_device",
]

# Arrow buffers are immutable, so numpy marks views of them read-only and torch warns once
# per process. The tensors we hand out own a fresh buffer per read; silence it here only.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", module=r"daskdist\.data"
)

Columns = dict[str, Any]  # name -> torch.Tensor | list


def _is_numeric(t: pa.DataType) -> bool:
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_temporal(t)
    )


def _fill_value(name: str, fill_null: Any) -> Any:
    if isinstance(fill_null, Mapping):
        return fill_null.get(name)
    return fill_null


def _numeric_numpy(name: str, arr: pa.Array, fill: Any) -> np.ndarray:
    t = arr.type
    if pa.types.is_temporal(t):
        arr = arr.cast(pa.int64() if t.bit_width == 64 else pa.int32())
    if arr.null_count:
        if fill is None:
            raise ValueError(
                f"column {name!r} has {arr.null_count} null value(s); pass fill_null= to "
                "replace them"
            )
        arr = pc.fill_null(arr, pa.scalar(fill).cast(arr.type))
    return arr.to_numpy(zero_copy_only=False)


def _fixed_list_numpy(name: str, arr: pa.Array, fill: Any) -> np.ndarray:
    shape = [len(arr)]
    list_nulls = None
    while pa.types.is_fixed_size_list(arr.type):
        size = arr.type.list_size
        if arr.null_count:
            if fill is None:
                raise ValueError(
                    f"column {name!r} has {arr.null_count} null list(s); pass fill_null= "
                    "to replace them"
                )
            if list_nulls is None:
                list_nulls = arr.is_null().to_numpy(zero_copy_only=False)
        shape.append(size)
        arr = arr.values.slice(arr.offset * size, len(arr) * size)
    if not _is_numeric(arr.type):
        raise TypeError(f"column {name!r}: fixed_size_list of {arr.type} is not numeric")
    values = _numeric_numpy(name, arr, fill).reshape(shape)
    if list_nulls is not None and list_nulls.any():
        values = values.copy()
        values[list_nulls] = fill
    return values


def _as_array(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            return col.chunk(0)
        if col.num_chunks == 0:
            return pa.array([], type=col.type)
        return col.combine_chunks()
    return col


def convert_table(table: pa.Table, fill_null: Any = None) -> Columns:
    """Columns of ``table`` as tensors (numeric, fixed-size lists) or lists (the rest)."""
    out: Columns = {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        t = col.type
        fill = _fill_value(name, fill_null)
        if _is_numeric(t) or pa.types.is_fixed_size_list(t):
            if isinstance(col, pa.ChunkedArray) and col.num_chunks > 1 and not col.null_count:
                parts = [
                    _fixed_list_numpy(name, c, fill) if pa.types.is_fixed_size_list(t)
                    else _numeric_numpy(name, c, fill)
                    for c in col.chunks
                ]
                x = np.concatenate(parts) if parts else np.empty(0)
            else:
                arr = _as_array(col)
                x = (_fixed_list_numpy if pa.types.is_fixed_size_list(t) else _numeric_numpy)(
                    name, arr, fill
                )
            out[name] = torch.from_numpy(x)
        else:
            out[name] = _as_array(col).to_pylist()
    return out


class Chunk:
    """Converted rows of one block, cut into batch views by :meth:`slice`.

    ``stacks`` hold 1-D columns of one dtype as the rows of a 2-D tensor (a shuffle
    gathers into it), so a batch's views of all of them come from one slice and one
    ``unbind`` instead of a slice per column; ``rest`` holds the other columns
    (tensors, possibly zero-copy over Arrow buffers, and lists). Batches keep
    ``names``' order.
    """

    __slots__ = ("names", "rest", "rows", "stacks", "_ordered")

    def __init__(self, names: Sequence[str], rest: Columns,
                 stacks: Sequence[tuple[tuple[str, ...], torch.Tensor]] = (),
                 rows: int | None = None) -> None:
        self.names = list(names)
        self.rest = rest
        self.stacks = list(stacks)
        if rows is None:
            rows = self.stacks[0][1].shape[1] if self.stacks else num_rows(rest)
        self.rows = int(rows)
        produced = [k for keys, _ in self.stacks for k in keys] + list(rest)
        self._ordered = produced == self.names

    def slice(self, a: int, b: int) -> Columns:
        """Rows ``[a, b)`` as a dict of views (tensors) or slices (lists)."""
        if not self.stacks:
            return {k: v[a:b] for k, v in self.rest.items()}
        out: Columns = {}
        for keys, m in self.stacks:
            out.update(zip(keys, m[:, a:b].unbind(0), strict=True))
        for k, v in self.rest.items():
            out[k] = v[a:b]
        return out if self._ordered else {k: out[k] for k in self.names}

    def relabel(self, labels: Mapping[str, Any]) -> Chunk:
        """The same chunk with its keys renamed by ``labels`` (Arrow names are strings;
        a DataFrame's column labels need not be)."""
        def key(k: str) -> Any:
            return labels.get(k, k)

        return Chunk([key(k) for k in self.names], {key(k): v for k, v in self.rest.items()},
                     [(tuple(key(k) for k in keys), m) for keys, m in self.stacks], self.rows)

    def map_tensors(self, fn: Any) -> Chunk:
        """The same chunk with ``fn`` applied to every tensor (e.g. pinning)."""
        return Chunk(self.names, map_instances(fn, self.rest, torch.Tensor),
                     [(keys, fn(m)) for keys, m in self.stacks], self.rows)


def convert_chunk(table: pa.Table, fill_null: Any = None,
                  index: np.ndarray | None = None) -> Chunk:
    """``table`` (rows ``index`` of it, in that order, when given) as a :class:`Chunk`.

    Without ``index`` numeric columns stay zero-copy. With it, for a table of single
    chunks, 1-D numeric columns are gathered by ``torch.index_select`` (GIL released)
    straight into the rows of one 2-D tensor per dtype; fixed-size lists are gathered
    alone; the other columns (strings, ...) go through one Arrow ``take``. A table of
    several chunks is gathered by one Arrow ``take``.
    """
    names = table.column_names
    if index is None:
        return Chunk(names, convert_table(table, fill_null))
    if any(col.num_chunks > 1 for col in table.columns):
        # A block of several pieces: Arrow's take reads their chunks in place, where a
        # gather from one tensor would first concatenate every column.
        return Chunk(names, convert_table(table.take(pa.array(index)), fill_null))
    is_tensor = [_is_numeric(f.type) or pa.types.is_fixed_size_list(f.type)
                 for f in table.schema]
    tensor_names = [n for n, t in zip(names, is_tensor, strict=True) if t]
    other = [n for n, t in zip(names, is_tensor, strict=True) if not t]
    cols = convert_table(table.select(tensor_names), fill_null)
    idx = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n in tensor_names:
        if cols[n].dim() == 1:
            by_dtype.setdefault(cols[n].dtype, []).append(n)
    stacks = []
    rest: Columns = {}
    for dtype, keys in by_dtype.items():
        if len(keys) < 2:
            continue
        m = torch.empty((len(keys), len(idx)), dtype=dtype)
        for j, k in enumerate(keys):
            torch.index_select(cols.pop(k), 0, idx, out=m[j])
        stacks.append((tuple(keys), m))
    for n, v in cols.items():
        rest[n] = torch.index_select(v, 0, idx)
    if other:
        rest.update(convert_table(table.select(other).take(pa.array(index)), fill_null))
    return Chunk(names, rest, stacks, len(idx))


def arrow_column(x: np.ndarray) -> pa.Array:
    """An array's rows as an Arrow column (N-D rows as nested fixed-size lists): the
    way back from a batch's N-D tensors (a collection's array chunks, a model's
    outputs) to Arrow."""
    if x.ndim == 1:
        return pa.array(x)
    flat = pa.array(np.ascontiguousarray(x).reshape(-1))
    for size in reversed(x.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat


def num_rows(cols: Columns | Chunk | pa.Table) -> int:
    if isinstance(cols, Chunk):
        return cols.rows
    if isinstance(cols, pa.Table):
        return cols.num_rows
    for v in cols.values():
        return len(v)
    return 0


def slice_cols(cols: Chunk | pa.Table, a: int, b: int) -> Columns | pa.Table:
    """Rows ``[a, b)`` as views (tensors) or slices (lists, tables)."""
    if isinstance(cols, pa.Table):
        return cols.slice(a, b - a)
    return cols.slice(a, b)


def concat_cols(parts: Sequence[Columns | pa.Table]) -> Columns | pa.Table:
    """Concatenate row-wise (copies; used only for batches that straddle chunks)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], pa.Table):
        return pa.concat_tables(parts)
    out: Columns = {}
    for k, v in parts[0].items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.cat([p[k] for p in parts])
        else:
            out[k] = [x for p in parts for x in p[k]]
    return out


def pin(obj: Any) -> Any:
    """Page-locked copies of every tensor in ``obj`` (for asynchronous CUDA copies)."""
    if isinstance(obj, Chunk):
        return obj.map_tensors(lambda t: t.pin_memory())
    return map_instances(lambda t: t.pin_memory(), obj, torch.Tensor)


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in ``obj`` to ``device`` (``non_blocking`` for CUDA)."""
    non_blocking = device.type == "cuda"
    return map_instances(lambda t: t.to(device, non_blocking=non_blocking), obj,
                         torch.Tensor)
