"""Which groups are on the device, and when: the prefetch scheduler (scheduler.py), the order in which
groups were used, recorded and replayed (recorded_order.py), and the phase of the step (phase.py)."""
