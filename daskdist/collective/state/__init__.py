"""Elastic state (Horovod's ``State``): its protocol, once (commits, restore, sync,
interrupts), the seam for what a kind of state keeps (a keeper), a replica's keeper and
its host copy, and durable checkpoints."""
