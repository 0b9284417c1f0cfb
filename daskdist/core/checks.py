"""The checks every scheduler route runs on what arrives, and the client on its settings
(pure): a bad value is refused with an error naming the handler (or setting), the
argument and what it got (SPEC §2.5b).

Limits on sizes are wire limits, shared by both sides: no message carries more than
:data:`MAX_ITEMS` items in one list, nor an id longer than :data:`MAX_TEXT` characters.
The checks of whole messages (a worker's results, a member's window) are beside their
named types in :mod:`daskdist.core.protocol`. Imports nothing from Dask, torch or the
rest of the package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MAX_ITEMS = 100_000  # items in one list of one message (a batch of closures, of results)
MAX_TEXT = 512  # characters of an id, a name or an address
MAX_WORKER_FAILURES = 1_000  # max_worker_failures is 1 ... this
MAX_LEASE_TIMEOUT = 7 * 24 * 3600.0  # lease_timeout is (0, a week] seconds
MAX_RANGES = 1 << 18  # row intervals in one message (a release, an epoch's ledger):
# about 0.3 s of the scheduler's event loop at most
MAX_RUNS = 1 << 22  # runs of one dataset's unit definition
MAX_ROWS = 1 << 50  # rows of a dataset (and rows asked for in one lease)
MAX_EPOCH = (1 << 31) - 1
MAX_RETRIES = 1_000_000  # a closure's retries


def shown(value: Any) -> str:
    """``value`` as an error message shows it (its repr, cut to 60 characters)."""
    r = repr(value)
    return r if len(r) <= 60 else f"{r[:57]}..."


def text(value: Any, what: str, limit: int = MAX_TEXT, empty: bool = False) -> str:
    """``value`` as an id, name or address: a ``str`` of at most ``limit`` characters
    (and not empty unless ``empty``)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {shown(value)}")
    if len(value) > limit or (not value and not empty):
        raise ValueError(f"{what} must be a non-empty str of at most {limit} characters, "
                         f"got {len(value)} characters")
    return value


def integer(value: Any, what: str, lo: int, hi: int) -> int:
    """``value`` as an ``int`` in ``[lo, hi]`` (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {shown(value)}")
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be between {lo} and {hi}, got {value}")
    return value


def number(value: Any, what: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """``value`` as a finite ``float`` in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} "
                        f"{shown(value)}")
    value = float(value)
    low_ok = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        bracket = "(" if lo_open else "["
        raise ValueError(f"{what} must be in {bracket}{lo:g}, {hi:g}], got {value!r}")
    return value


def optional(check: Callable[..., Any], value: Any, *args: Any, **kwargs: Any) -> Any:
    """``None``, or ``value`` passed through ``check``."""
    return None if value is None else check(value, *args, **kwargs)


def flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {type(value).__name__} {shown(value)}")
    return value


def items(value: Any, what: str, limit: int = MAX_ITEMS) -> list | tuple:
    """``value`` as a list (or tuple) of at most ``limit`` items."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be a list, got {type(value).__name__} {shown(value)}")
    if len(value) > limit:
        raise ValueError(f"{what} must hold at most {limit} items, got {len(value)}")
    return value


def is_text(v: Any) -> bool:
    """Whether ``v`` passes :func:`text` with its defaults (no message is built)."""
    return type(v) is str and 0 < len(v) <= MAX_TEXT


def texts(value: Any, what: str, limit: int = MAX_ITEMS) -> list[str]:
    """A list of ids (each checked by :func:`text`; the error message is only built
    for a bad one: lists of ids come with every worker exchange)."""
    value = items(value, what, limit)
    for i, v in enumerate(value):
        if not is_text(v):
            text(v, f"{what}[{i}]")  # raises, naming the item
    return list(value)


def pairs(value: Any, what: str, limit: int = MAX_ITEMS, lo: int = 0, hi: int = MAX_ROWS
          ) -> list[tuple[int, int]]:
    """A list of at most ``limit`` int pairs ``[a, b]`` with both in ``[lo, hi]`` (row
    intervals, a dataset's ``(rows, count)`` runs), as tuples."""
    out = []
    for i, item in enumerate(items(value, what, limit)):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise TypeError(f"{what}[{i}] must be a pair [a, b], got {shown(item)}")
        a, b = item
        if type(a) is not int or type(b) is not int or not (lo <= a <= hi and lo <= b <= hi):
            # the slow path only for what the fast one refuses: the error names the field
            a = integer(a, f"{what}[{i}][0]", lo, hi)
            b = integer(b, f"{what}[{i}][1]", lo, hi)
        out.append((a, b))
    return out


def record(value: Any, what: str, size: int, kind: str = "") -> list | tuple:
    """One message record of ``size`` fields (a NamedTuple on the wire: a list)."""
    if not isinstance(value, (list, tuple)) or len(value) != size:
        raise TypeError(f"{what} must be {kind or f'a record of {size} fields'}, got "
                        f"{type(value).__name__} {shown(value)}")
    return value


def named(value: Any, what: str, cls: Any) -> Any:
    """A message record as its named type ``cls`` (a NamedTuple; a list on the wire),
    its fields not yet checked; ``TypeError`` naming ``cls`` and its fields."""
    n = len(cls._fields)
    return cls._make(record(value, what, n, f"a {cls.__name__} {cls._fields}"))


# -- settings (the client checks them too) -----------------------------------------------

def max_worker_failures(value: Any, what: str = "max_worker_failures") -> int:
    return integer(value, what, 1, MAX_WORKER_FAILURES)


def lease_timeout(value: Any, what: str = "lease_timeout") -> float:
    return number(value, what, 0.0, MAX_LEASE_TIMEOUT, lo_open=True)


# -- members by Dask resources (Coordinator(resources=...)) ------------------------------

def satisfies(worker_resources: dict | None, required: dict | None) -> bool:
    """Whether a worker declaring ``worker_resources`` may be a member of a coordinator
    that requires ``required`` (``None``: every worker)."""
    if not required:
        return True
    have = worker_resources or {}
    return all(float(have.get(k, 0)) >= float(v) for k, v in required.items())


def resources(value: Any, what: str = "resources") -> dict[str, float]:
    """``resources=`` as ``{name: positive amount}``."""
    if not isinstance(value, dict) or not value or len(value) > 64:
        raise TypeError(f"{what} must be a non-empty dict of Dask resources such as "
                        f"{{'GPU': 1}}, got {value!r:.80}")
    out = {}
    for k, v in value.items():
        text(k, f"{what} name")
        out[k] = number(v, f"{what}[{k!r}]", 0.0, 1e12, lo_open=True)
    return out


# -- members by the Dask GPU convention (Coordinator(members="gpu")) -----------------------
MEMBER_KINDS = ("gpu",)


def members(value: Any, what: str = "members") -> str:
    """``members=``: ``"gpu"``, the workers with a GPU by the Dask convention (their
    ``CUDA_VISIBLE_DEVICES`` names a device, or they declare a ``GPU`` resource; see
    :func:`daskdist.core.gpus.has_gpu`)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be None (every worker) or 'gpu', got "
                        f"{type(value).__name__} {value!r:.80}")
    if value not in MEMBER_KINDS:
        raise ValueError(f"{what} must be None (every worker) or 'gpu' (the workers with "
                         f"a GPU by the Dask convention: CUDA_VISIBLE_DEVICES names a "
                         f"device, or a declared GPU resource), got {value!r:.80}")
    return value
