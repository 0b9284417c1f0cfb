"""A worker session as its closures see it: the scope each closure runs in and the
lease tokens it consumed, the session's per-worker resources, and the membership
counters the scheduler told it. Light: no Dask, tornado or torch."""
