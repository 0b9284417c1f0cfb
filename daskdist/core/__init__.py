"""The pure state machines and the wire's named messages (SPEC §1).

Closure queue, leases, commits, gangs, membership, liveness, backend choice, intervals
and the protocol. Nothing here imports Dask, tornado or torch (``tests/test_imports.py``
checks it in a fresh interpreter): every transition is unit-tested without a cluster,
and the scheduler plugin drives these from its event loop.
"""
