"""The scheduler side: ``CoordinatorPlugin`` (RPC handlers, Dask's worker events) around
one ``CoordinatorState`` per coordinator name, the group driver, and the dashboard.

Never imports torch, pyarrow-heavy loaders, ``collective/`` or the worker and client
sides (SPEC §1). Preload it with ``dask scheduler --preload daskdist.plugins.scheduler``.
"""

from __future__ import annotations

from daskdist.plugins.scheduler.plugin import CoordinatorPlugin, dask_setup

__all__ = ["CoordinatorPlugin", "dask_setup"]
