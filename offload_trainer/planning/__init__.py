"""Where a model's state should live on this machine, and how fast a step will be.

machine.py and compute_probe.py measure (cached through json_cache.py); zero_memory.py and
cost_model.py compute on paper; planner.py searches placements; model_spec.py gathers a model's
inputs; auto_placement.py serves placement = "auto"; report.py prints a plan. May import the
runtime's pure layout (partition, memory plan), config, errors, io_engine and the built-in models.
"""
