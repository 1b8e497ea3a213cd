"""Moving a model's state in and out of the engine: checkpoints (checkpoint.py), consolidated weights
(consolidate.py, export.py), safetensors loading (safetensors_load.py) and meta-device
materialisation (materialize.py)."""
