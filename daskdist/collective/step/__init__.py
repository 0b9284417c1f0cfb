"""A synchronous step: what rides its gradient allreduce, the commit message sent
when the next batch is asked for, and ``synced`` to the end of an epoch."""
