"""The applications over the engine: offload-train (run_config.py, data.py, causal_lm.py, trainer.py,
cli.py) and offload-plan (plan_cli.py). May import anything of offload_trainer."""
