"""A group's state on every tier: its homes (homes.py), the tiers' memory and budgets (tiers.py),
the pools that lend device slots and staging buffers (buffer_pool.py), and ShardGroup, which owns
the device copy of a group's parameters (shard_group.py)."""
