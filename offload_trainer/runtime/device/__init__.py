"""The accelerator and the copy path: the only place memory moves between the host tier and the device tier.

accelerator.py (the interface and how one is chosen), pending.py (what a caller waits on: a copy, an
IO request, or both in a chain), copy_worker.py (copies on a thread of their own, for the CPU and the
simulated accelerator), host.py (the CPU, where the device tier is host memory, and the simulated
accelerator, whose device memory is kept apart and whose copies finish late), cuda.py (streams and
events). [Note: Ordering of copies] in accelerator.py says who waits for what.
"""
