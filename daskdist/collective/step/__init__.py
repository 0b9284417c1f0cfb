"""A synchronous step: the closure's Step (what rides its gradient allreduce, the batch
fetched ahead, the deferred commit message), the riders' encoding, and ``synced`` to
the end of an epoch."""
