"""daskdist's settings in ``dask.config`` (defaults in ``daskdist.yaml`` beside this file).

Loaded once when the package is imported, the way Dask's own packages do it, so every
process (client, scheduler, worker) sees the same defaults and the user's overrides.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml
from dask.utils import parse_timedelta

_fn = os.path.join(os.path.dirname(__file__), "daskdist.yaml")
with open(_fn) as _f:
    defaults = yaml.safe_load(_f)

dask.config.update_defaults(defaults)


def get(key: str, default: Any = None) -> Any:
    """``dask.config.get("daskdist." + key)``."""
    return dask.config.get(f"daskdist.{key}", default=default)


def seconds(key: str) -> float:
    """A duration setting (``"30s"``, ``"200ms"`` or a number) in seconds."""
    return float(parse_timedelta(get(key), default="seconds"))


def nbytes(key: str) -> int:
    """A size setting (``"256MiB"``, ``"1 GB"`` or a number of bytes) in bytes."""
    from dask.utils import parse_bytes

    value = get(key)
    return int(parse_bytes(value)) if isinstance(value, str) else int(value)


def integer(key: str) -> Any:
    """An integer setting: ``int`` for an int or a string of digits (``"3"`` from a
    YAML file or an environment variable); anything else as is, for the caller's
    check to refuse with the setting's name."""
    value = get(key)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return value
