"""What a gang member measures about its own steps (SPEC §5.1), on the worker: the
phases of each step (:mod:`.phases`, hooked into the loader, ``synced``, the group's
calls and elastic commits) and the stack of its gang thread (:mod:`.stacks`).

Imports nothing from Dask or torch: the data and collective layers call these hooks, and
the worker plugin sends what they measured to the scheduler.
"""
