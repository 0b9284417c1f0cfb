"""Everything that runs inside Dask's processes: ``scheduler/`` (the scheduler plugin),
``worker/`` (the worker plugin), the ``gpu_pin`` worker preload, and ``devices`` (what a
worker process was given of its host's GPUs, which both of the last read).

:class:`PluginRef` lets one side hand another a plugin without importing the plugin's
code: it pickles as a call of :func:`instantiate` with the plugin's dotted path, so the
class is imported only where the plugin is unpickled (the client registers the
scheduler plugin, the scheduler the worker plugin, and neither imports the other's
side). This module imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
from typing import Any

SCHEDULER_PLUGIN = "daskdist.plugins.scheduler.plugin.CoordinatorPlugin"
WORKER_PLUGIN = "daskdist.plugins.worker.plugin.CoordinatorWorkerPlugin"


def instantiate(path: str, kwargs: dict[str, Any]) -> Any:
    """``path(**kwargs)``: import the class at dotted ``path`` and build one."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)(**kwargs)


class PluginRef:
    """A plugin by dotted path and keyword arguments; unpickled, it is the plugin."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        self.path = path
        self.kwargs = kwargs

    def __reduce__(self) -> tuple:
        return (instantiate, (self.path, self.kwargs))
