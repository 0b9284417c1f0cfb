"""Dynamic data's leases as pure bookkeeping: the lease table, its datasets, epochs
and units, acknowledgement at commits, resumed epochs and ledgers, a collection's
partitions and where they lie."""
