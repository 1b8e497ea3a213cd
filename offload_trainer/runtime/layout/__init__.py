"""Pure planning, no memory touched: the partition of a model into groups and their flat layout
(partition.py), and where every byte of one rank's state lives, checked against the budgets (memory_plan.py)."""
