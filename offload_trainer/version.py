"""The installed version of offload-trainer (pyproject.toml's), for --version and checkpoints' manifests."""

from importlib import metadata

try:
    __version__ = metadata.version("offload-trainer")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed (PYTHONPATH)
    __version__ = "0+unknown"
