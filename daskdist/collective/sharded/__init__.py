"""ShardedState: elastic state of a model sharded over the group with FSDP2: its keeper,
its layout, its copies in memory and their ring copy, the wire and the mappings that
move them, its durable checkpoints, and who holds which shard."""
