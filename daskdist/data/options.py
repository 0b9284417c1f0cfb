"""A loader's options checked in one place, before anything runs (pure: no torch, no
pyarrow, so the client checks ``distribute_dataset``'s options before sending them).

:func:`check_options` takes :class:`~.loader.ArrowLoader`'s keyword options by name and
returns them normalised (NumPy ints as ``int``, ``columns`` as a tuple), or raises
``TypeError`` for a value of the wrong type and ``ValueError`` for one out of range,
each naming the option and the value (``batch_size must be an int, got float 2.7``;
``shuffle must be a bool, got str 'false'``). A bool is not an int here, nor an int a
bool. One table, :data:`CHECKS`, holds the check of every option.
"""

from __future__ import annotations

import numbers
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from daskdist.core import checks
from daskdist.data.sharding import POLICIES

__all__ = ["CHECKS", "check_options", "unknown_fill_columns"]

_MAX = checks.MAX_ROWS
_SEED = 1 << 63  # a seed travels in the dataset's definition as an int64
_DEVICE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(:[0-9]+)?")  # "cpu", "cuda:1", "mps"


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def _is_bool(value: Any) -> bool:
    """A Python or NumPy bool (NumPy's, without importing NumPy)."""
    t = type(value)
    return t is bool or (t.__module__ == "numpy" and t.__name__ in ("bool", "bool_"))


def _int(lo: int, hi: int = _MAX) -> Callable[[Any, str], int]:
    """An int in ``[lo, hi]``; NumPy ints are ints, bools and floats are not."""
    def check(value: Any, what: str) -> int:
        if not _is_bool(value):
            try:
                value = operator.index(value)
            except TypeError:
                pass  # not an integer: named below
        return checks.integer(value, what, lo, hi)
    return check


def _flag(value: Any, what: str) -> bool:
    if _is_bool(value):
        return bool(value)
    return checks.flag(value, what)


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    def optional(value: Any, what: str) -> Any:
        return None if value is None else check(value, what)
    return optional


def _policy(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, one of {POLICIES}; got {_show(value)}")
    if value not in POLICIES:
        raise ValueError(f"unknown sharding policy {value!r}: {what} must be one of "
                         f"{POLICIES}")
    return value


def _columns(value: Any, what: str) -> tuple:
    """A list of column names (labels of a DataFrame's columns, or a dict's keys)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a list of column names, got {_show(value)}")
    names = tuple(value)
    if not names:
        raise ValueError(f"{what} must name at least one column, got {value!r}")
    for name in names:
        try:
            hash(name)
        except TypeError:
            raise TypeError(f"{what} must be a list of column names, got {name!r} in "
                            f"it") from None
    dup = sorted({repr(n) for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what} names column(s) {', '.join(dup)} more than once")
    return names


def _fill(value: Any, what: str) -> Any:
    """A number (or bool) for every column's nulls, or a dict of them by column."""
    def one(v: Any, where: str) -> Any:
        if v is None or isinstance(v, numbers.Number) or _is_bool(v):
            return v
        raise TypeError(f"{where} must be a number, got {_show(v)}")
    if isinstance(value, Mapping):
        return {k: one(v, f"{what}[{k!r}]") for k, v in value.items()}
    return one(value, what)


def _callable(value: Any, what: str) -> Any:
    if not callable(value):
        raise TypeError(f"{what} must be callable, got {_show(value)}")
    return value


def _device(value: Any, what: str) -> Any:
    """A ``torch.device``, a device string (``"cuda:1"``) or a CUDA index; torch itself
    checks the device type where the loader runs."""
    t = type(value)
    if t.__module__ == "torch" and t.__name__ == "device":
        return value
    if isinstance(value, str):
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"{what} must name a device like 'cpu' or 'cuda:0', got "
                             f"{value!r}")
        return value
    if not _is_bool(value) and isinstance(value, numbers.Integral):
        return _int(0, 1 << 16)(value, what)
    raise TypeError(f"{what} must be a torch.device, a str like 'cuda:0' or a CUDA "
                    f"device index, got {_show(value)}")


def _name(value: Any, what: str) -> str:
    return checks.text(value, what, empty=True)


# option -> its check (value, name) -> the value normalised; ArrowLoader's keyword options
CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "batch_size": _int(1),
    "shuffle": _flag,
    "seed": _int(-_SEED, _SEED - 1),
    "drop_last": _flag,
    "columns": _optional(_columns),
    "policy": _optional(_policy),
    "prefetch": _int(0),
    "fill_null": _fill,
    "collate": _optional(_callable),
    "device": _optional(_device),
    "shuffle_buffer": _int(1),
    "name": _optional(_name),
    "lease_rows": _optional(_int(1)),
    "partitions_ahead": _optional(_int(1)),
}


def check_options(options: Mapping[str, Any], what: str = "ArrowLoader") -> dict[str, Any]:
    """``options`` (ArrowLoader's keyword options by name) checked and normalised (the
    module doc); a name that is no option: ``TypeError`` naming it and ``what``."""
    unknown = sorted(k for k in options if k not in CHECKS)
    if unknown:
        raise TypeError(f"{what} got unknown option(s) {', '.join(map(repr, unknown))}; "
                        f"its options are {', '.join(CHECKS)}")
    return {k: CHECKS[k](v, k) for k, v in options.items()}


def unknown_fill_columns(fill_null: Any, columns: Iterable[Any]) -> list[Any]:
    """The keys of a ``fill_null`` dict that name no column of ``columns`` (a key may
    also be a column label's ``str``, as a collection's Arrow table names it)."""
    if not isinstance(fill_null, Mapping):
        return []
    names = list(columns)
    known = set(names) | {str(c) for c in names}
    return [k for k in fill_null if k not in known]
