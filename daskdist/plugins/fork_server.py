"""Nanny preload that starts worker processes from a fork server with torch imported.

``dask worker --nanny --preload-nanny daskdist.plugins.fork_server`` (a jobqueue's
``job_extra_directives``/``worker_extra_args``), or, for a ``LocalCluster``,
``dask.config.set({"distributed.nanny.preload": ["daskdist.plugins.fork_server"]})``
before making it. A Nanny spawns a fresh interpreter for its worker by default, and a
replacement after a crash or a SIGKILL then imports torch, ``torch.distributed`` and
daskdist again before its per-worker resources can even be built (seconds, on a busy
host, while the group trains without it). With this preload the Nanny forks the worker
from Dask's fork server instead, which imported them once: the replacement is up in a
fraction of that time. Importing creates no CUDA context and starts no thread, so a
forked worker still binds the GPU it is given (``gpu_pin`` as a worker preload).

The fork server is one per process that starts Nannies (a ``LocalCluster``'s client
process holds all of its Nannies); its modules are fixed when it starts, so the preload
must run before the first worker process of that process starts: that is where a Nanny
runs it. ``daskdist.fork-server.modules`` adds modules of the user's own (a module the
factories import).
"""

from __future__ import annotations

import importlib.util

import dask

from daskdist import config

# what a worker of a coordinator imports before it trains: Dask, torch and its
# collectives and optimizers (the first optimizer made in a process imports
# torch._dynamo: seconds), Arrow, and daskdist's worker side
MODULES = ["distributed", "dask", "numpy", "pandas", "pyarrow", "pyarrow.parquet", "torch",
           "torch.distributed", "torch.optim", "torch._dynamo", "daskdist",
           "daskdist.plugins.worker.plugin", "daskdist.collective", "daskdist.data"]


def modules() -> list[str]:
    """The modules the fork server imports: :data:`MODULES` and the configured ones,
    those installed."""
    wanted = [*MODULES, *config.get("fork-server.modules")]
    return [name for name in dict.fromkeys(wanted)
            if importlib.util.find_spec(name.partition(".")[0]) is not None]


def use_fork_server() -> None:
    """Start this process's worker processes from Dask's fork server, with
    :func:`modules` imported there."""
    from distributed.utils import get_mp_context

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    get_mp_context().set_forkserver_preload(modules())


def dask_setup(nanny) -> None:
    """Dask's preload hook: runs in the Nanny before it starts its worker process."""
    use_fork_server()
