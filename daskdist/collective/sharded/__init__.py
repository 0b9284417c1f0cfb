"""ShardedState: elastic state of a model sharded over the group with FSDP2: its
layout, its copies in memory, the wire and the mappings that move them, its durable
checkpoints, and who holds which shard."""
