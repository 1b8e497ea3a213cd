"""OffloadConfig: everything the engine is told, as one frozen dataclass of sections; saved with every checkpoint.

    cfg = OffloadConfig.from_file("run.toml")            # or run.json
    cfg = cfg.with_overrides({"optimizer.lr": "3e-4", "tiers.optimizer": "nvme"})
    cfg.to_dict()

A file holds the top-level keys and one table per section; every key may be left out:

    grad_accum_steps = 4

    [tiers]
    params = "host"
    optimizer = { host = 0.25, nvme = 0.75 }
    nvme_dir = "/mnt/nvme/swap"
    host_budget_bytes = "64GiB"

    [optimizer]
    lr = 3e-4
    schedule = "warmup_cosine"
    warmup_steps = 100
    total_steps = 10000

offload-train's own run config (app/run_config.py) is this plus the model, data and train sections.
"""

from __future__ import annotations

from dataclasses import dataclass

from io_engine.config import IOConfig

from offload_trainer.config.loader import ConfigFile, coerce_fields
from offload_trainer.config.placement import PlacementMode
from offload_trainer.config.sections import GroupingConfig, OptimizerConfig, PrecisionConfig, PrefetchConfig, TierConfig


@dataclass(frozen=True)
class OffloadConfig(ConfigFile):
    """The engine's whole configuration; saved with every checkpoint.

    Sections may be given as mappings, which are read as a file's tables are:
    OffloadConfig(tiers={"params": "nvme", "nvme_dir": "/mnt/nvme"}).
    """

    OTHER_CONFIGS_SECTIONS = {
        name: f"[{name}] is a section of offload-train's run config, not of the engine's OffloadConfig: "
        "read such a file with offload_trainer.app.run_config.RunConfig.from_file(path).engine_config(), "
        f"or leave [{name}] out"
        for name in ("model", "data", "train", "lora")
    }

    tiers: TierConfig = TierConfig()
    """Homes of parameters, gradients and optimizer states, and the byte budget of each tier."""

    prefetch: PrefetchConfig = PrefetchConfig()
    """How far ahead the scheduler fetches groups."""

    grouping: GroupingConfig = GroupingConfig()
    """How modules are partitioned into groups that move together."""

    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer, its hyperparameters and its learning-rate schedule."""

    precision: PrecisionConfig = PrecisionConfig()
    """Compute dtype and fp16 loss scaling."""

    io: IOConfig = IOConfig()
    """The IO engine that moves NVMe bytes: threads, requests in flight, block size, O_DIRECT."""

    placement: PlacementMode = PlacementMode.MANUAL
    """"auto": the planner chooses each state kind's tiers and the lookahead at initialize
    (see PlacementMode.AUTO); "manual": the tiers and prefetch sections as written."""

    grad_accum_steps: int = 1
    """Micro-batches whose gradients are accumulated (in fp32) before each optimizer step."""

    seed: int = 0
    """Seed of every random number generator the trainer uses: the same seed gives the same loss."""

    def __post_init__(self) -> None:
        coerce_fields(self, "")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={self.grad_accum_steps} must be at least 1 (1 = no accumulation)")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be between 0 and 2**63 - 1")
