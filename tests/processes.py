"""How the tests run Dask's processes, in the test processes and in the jobs the tests
start as processes of their own.

- Worker processes fork from a server that imported Dask, torch and daskdist once (the
  modules of the ``daskdist.plugins.fork_server`` nanny preload; Dask's own test suite
  does the same): a worker, or a Nanny's replacement after a SIGKILL, is up in a
  fraction of the time a spawned interpreter takes to import torch and the
  ``torch._dynamo`` its first optimizer imports. Importing
  creates no CUDA context, so a worker still binds the GPU it is given.
- None of the periodic work no test reads: Dask's statistical profiler (every worker
  thread's stack every 10 ms), the event-loop tick watch (every 20 ms in each scheduler,
  nanny and worker) and the memory monitor (every 100 ms) are slowed or off. An idle
  worker then takes a quarter of the CPU it took, on a machine with two cores.
"""

from __future__ import annotations

import dask

# the periodic work above, as Dask configuration (also passed to child processes)
QUIET = {"distributed.worker.profile.enabled": False,
         "distributed.admin.tick.interval": "1s",
         "distributed.worker.memory.monitor-interval": "1s"}


def use_fork_server(*modules: str) -> None:
    """Start this process's Dask workers (and :func:`process_context`'s processes) from
    the fork server, with ``modules`` imported there too (a job's own module), and with
    Dask's periodic work quiet (:data:`QUIET`)."""
    from distributed.utils import get_mp_context

    from daskdist.plugins import fork_server

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver", **QUIET})
    # what the fork_server nanny preload imports there (those installed), and ``modules``
    get_mp_context().set_forkserver_preload([*fork_server.modules(), *modules])


def quiet_environ() -> dict[str, str]:
    """:data:`QUIET` as the environment variables a child process's Dask reads."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value)
            for key, value in QUIET.items()}


def process_context():
    """The multiprocessing context for a test's own processes (group members, a pool):
    the fork server, with torch and daskdist imported once, instead of an interpreter
    spawned, and importing them, per process."""
    from distributed.utils import get_mp_context

    return get_mp_context()
