"""Arrow columns → torch tensors without per-row Python work.

A numeric column becomes a 1-D tensor built on the Arrow buffer (``to_numpy`` is
zero-copy for a single chunk without nulls; ``torch.from_numpy`` shares it); a
``fixed_size_list`` column (possibly nested) becomes a 2-D (N-D) tensor over the child
values buffer; booleans and temporal types are converted with one vectorised copy.
Strings, binary and other nested types are passed through as Python lists. Nulls in a
numeric column raise ``ValueError`` naming the column unless ``fill_null`` is given.

Converted columns are then sliced into batch *views* (:func:`slice_cols`) and only the
rare batch that straddles two chunks is concatenated (:func:`concat_cols`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = ["Columns", "concat_cols", "convert_table", "num_rows", "slice_cols", "to_device"]

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


def num_rows(cols: Columns | pa.Table) -> int:
    if isinstance(cols, pa.Table):
        return cols.num_rows
    for v in cols.values():
        return len(v)
    return 0


def slice_cols(cols: Columns | pa.Table, a: int, b: int) -> Columns | pa.Table:
    """Rows ``[a, b)`` as views (tensors) or slices (lists, tables)."""
    if isinstance(cols, pa.Table):
        return cols.slice(a, b - a)
    return {k: v[a:b] for k, v in cols.items()}


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


def _map_tensors(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in obj):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def pin(obj: Any) -> Any:
    """Page-locked copies of every tensor in ``obj`` (for asynchronous CUDA copies)."""
    return _map_tensors(obj, lambda t: t.pin_memory())


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in ``obj`` to ``device`` (``non_blocking`` for CUDA)."""
    non_blocking = device.type == "cuda"
    return _map_tensors(obj, lambda t: t.to(device, non_blocking=non_blocking))
