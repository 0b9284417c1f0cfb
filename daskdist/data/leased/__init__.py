"""The ``"dynamic"`` policy on a worker: its lease service, a pass over leased rows,
and the rows it holds."""
