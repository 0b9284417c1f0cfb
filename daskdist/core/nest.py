"""``map_structure``: apply a function to the leaves of nested lists, tuples and dicts.

The client replaces ``RemoteValue`` leaves by their values (``Coordinator.fetch``) and a
worker replaces per-worker references by its components; both walk structures the same
way. Pure: imports nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def map_structure(fn: Callable[[Any], Any], structure: Any,
                  leaf: Callable[[Any], bool] | None = None) -> Any:
    """Apply ``fn`` to every leaf of nested lists, tuples and dicts (types kept, named
    tuples too); ``leaf(x)`` true makes ``x`` a leaf even when it is a container."""
    if leaf is not None and leaf(structure):
        return fn(structure)
    if isinstance(structure, list):
        return [map_structure(fn, s, leaf) for s in structure]
    if isinstance(structure, tuple):
        items = [map_structure(fn, s, leaf) for s in structure]
        return type(structure)(*items) if hasattr(structure, "_fields") else tuple(items)
    if isinstance(structure, dict):
        return type(structure)((k, map_structure(fn, v, leaf)) for k, v in structure.items())
    return fn(structure)


def map_instances(fn: Callable[[Any], Any], structure: Any, cls: type) -> Any:
    """``structure`` with ``fn`` applied to every leaf that is a ``cls`` (tensors, say);
    other leaves stay as they are."""
    return map_structure(lambda v: fn(v) if isinstance(v, cls) else v, structure)
