"""The engine: one model's training state across the tiers, and the step that updates it.

Imports only offload_trainer.config, offload_trainer.errors and io_engine (a test holds it).
Subpackages: groups/ (a group's state on every tier: homes, tiers, buffer pools), residency/ (which
groups are on the device: the prefetch scheduler and the recorded group order), layout/ (the
partition into groups and the memory plan, both pure), persist/ (checkpoints, export, loading and
materialising weights).
"""
