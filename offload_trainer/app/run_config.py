"""RunConfig: what offload-train is told: the engine's OffloadConfig plus the model, data and train sections.

    cfg = RunConfig.from_file("run.toml", defaults=DEFAULT_RUN).with_overrides({"train.steps": "500"})
    engine_cfg = cfg.engine_config()          # the engine's sections alone: what initialize() takes

A run's file is the engine's file with four more tables: [model], [data], [train] and [lora].
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from offload_trainer.config import ComputeDtype, OffloadConfig
from offload_trainer.config.sections import LRSchedule
from offload_trainer.config.loader import choice_field, coerce_fields, path_field
from offload_trainer.models.decoder import PRESETS

DEFAULT_RUN = {
    "tiers": {"params": "nvme", "grads": "host", "optimizer": "nvme", "nvme_dir": ".offload-scratch/swap"},
    "optimizer": {"lr": 2e-3, "weight_decay": 0.1, "grad_clip_norm": 1.0, "betas": [0.9, 0.95]},
}
"""The run offload-train makes with no config file: offloaded to NVMe, a learning rate that trains
the built-in small model visibly within its 200 steps."""


@dataclass(frozen=True)
class ModelConfig:
    """The model offload-train builds (the engine itself takes any nn.Module)."""

    preset: str = choice_field("small", PRESETS)
    """A built-in decoder preset: tiny, small, 125m, 350m, 1b, 7b, 13b or 70b."""

    hf_path: str | None = path_field(None)
    """A local Hugging Face causal LM directory (config.json, *.safetensors, tokenizer files) to
    fine-tune instead of the built-in decoder; needs the `hf` extra (transformers)."""

    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them."""

    def __post_init__(self) -> None:
        coerce_fields(self, "model")
        if self.hf_path is not None and not self.hf_path.strip():
            raise ValueError("model.hf_path='' is empty: name a local Hugging Face model directory, or leave it out")


@dataclass(frozen=True)
class DataConfig:
    """What offload-train reads, and how it batches it."""

    path: str | None = path_field(None)
    """A directory (read recursively) or file of .txt, .md, .py, .jsonl or .parquet documents, or a
    Hugging Face dataset saved with save_to_disk (.parquet and datasets need the `data` extra);
    None = the Python standard library's own sources, present on every machine."""

    text_field: str = "text"
    """The field of a JSONL record (column of a parquet file or dataset) that holds a document's text."""

    messages_field: str = "messages"
    """The field holding a chat conversation instead ([{"role", "content"}, ...]): rendered with the
    tokenizer's chat template, the loss on the assistant's tokens only."""

    cache_dir: str | None = path_field(None)
    """Where the tokenized corpus is cached (memory-mapped, reused while the files and tokenizer are
    unchanged); None = .offload-cache beside the data (the user's cache for the default corpus, or
    where that cannot be written)."""

    seq_len: int = 256
    """Tokens per training sequence."""

    batch_size: int = 8
    """Sequences per micro-batch."""

    eval_fraction: float = 0.05
    """Fraction of the sequences held out for the eval loss (the corpus's tail)."""

    max_tokens: int | None = 4_000_000
    """Read at most this many tokens of the corpus; None = all of it."""

    def __post_init__(self) -> None:
        coerce_fields(self, "data")
        for name in ("text_field", "messages_field"):
            if not getattr(self, name).strip():
                raise ValueError(f"data.{name}='' is empty: name the field that holds the documents")
        if self.cache_dir is not None and not self.cache_dir.strip():
            raise ValueError("data.cache_dir='' is empty: name a directory, or leave it out to cache beside the data")
        if self.path is not None and not self.path.strip():
            raise ValueError(
                "data.path='' is empty (it would read the current directory): name a corpus directory or file, "
                "or leave it out for the default corpus"
            )
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name}={getattr(self, name)} must be at least 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError(f"data.max_tokens={self.max_tokens} must be at least 2, or None for the whole corpus")


class LoraExport(enum.Enum):
    """What the export of a LoRA run writes."""

    MERGED = "merged"
    """The base model with the adapters merged into its weights: a plain model, as without LoRA."""
    ADAPTER = "adapter"
    """The adapters alone, as PEFT saves them (out_dir/adapter: adapter_config.json,
    adapter_model.safetensors), to load with PeftModel.from_pretrained over the base model."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) through PEFT (the `lora` extra): only the adapters train, the base
    model is frozen (and may be paged to NVMe like any parameter)."""

    rank: int = 0
    """The adapters' rank r; 0 = no LoRA (every parameter trains)."""

    alpha: float = 16.0
    """The scale numerator: an adapter's update is scaled by alpha / rank."""

    target_modules: tuple[str, ...] = ()
    """Names (or name suffixes) of the modules that get adapters, e.g. ["q_proj", "v_proj"]; empty =
    PEFT's default for the architecture (needed for the built-in decoder: e.g. ["q_proj", "v_proj"], its
    attention's names as Llama's)."""

    dropout: float = 0.0
    """Dropout on the adapters' input while training."""

    export: LoraExport = LoraExport.MERGED
    """"merged" exports the model with the adapters merged in; "adapter" exports the adapters alone."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self) -> None:
        coerce_fields(self, "lora")
        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank} must be 0 (no LoRA) or more, e.g. 8")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha} must be above 0, e.g. 16")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if any(not name.strip() for name in self.target_modules):
            raise ValueError(f"lora.target_modules={list(self.target_modules)} holds an empty name: remove it")
EXPORT_DTYPES = tuple(dtype.value for dtype in ComputeDtype)
"""The dtypes train.export_dtype names: the compute dtypes (causal_lm.py exports in any of them)."""

LOGGERS = ("jsonl", "tensorboard", "wandb")
"""The names train.loggers accepts (app/loggers.py writes each)."""


class OnNonFinite(enum.Enum):
    """What offload-train does at a step whose loss or gradients hold inf or nan (the engine updates nothing then)."""

    STOP = "stop"
    """End the run (exit status 2) with a line naming the step and what to do; nothing is saved after it."""
    SKIP = "skip"
    """Log the step as skipped and go on to the next batch."""


class MicroBatchOrder(enum.Enum):
    """How a step's grad_accum_steps micro-batches go through the model (results are the same)."""

    MICRO_BATCH_MAJOR = "micro_batch_major"
    """One micro-batch's forward and backward through the whole model, then the next: every group is
    fetched again for each micro-batch."""
    LAYER_MAJOR = "layer_major"
    """Every micro-batch through block k before block k+1, forward and backward: each group is fetched
    once per step each way; each block's input of every micro-batch is kept (within the budgets) and
    blocks are recomputed in backward (runtime/layer_major.py). Not for a model drawing random numbers in its forward (dropout)."""


MIN_DIST_TIMEOUT_S = 1e-3
"""The process group counts its timeout in whole milliseconds: less is no timeout at all."""
MAX_DIST_TIMEOUT_S = 1e9
"""About 31 years; datetime.timedelta, which torch.distributed takes, overflows on 1e20 (a traceback on
every rank at the rendezvous)."""


@dataclass(frozen=True)
class TrainConfig:
    """The training run of offload-train: its length, outputs and checkpoints."""

    steps: int = 200
    """Optimizer steps to train for (a resumed run continues up to this many in all)."""

    out_dir: str = path_field("runs/offload-train")
    """Where the run writes its config, metrics (metrics.jsonl) and checkpoints (ckpt-NNNNNN)."""

    checkpoint_every: int = 100
    """Save a checkpoint every this many optimizer steps, and always at the end; 0 = only at the end."""

    eval_batches: int = 16
    """Batches of held-out data the eval loss is averaged over."""

    eval_every: int = 0
    """Also measure the eval loss every this many optimizer steps (logged with that step's row);
    0 = only at the end. The end of the run always measures it."""

    keep_last: int = 3
    """Keep the newest this many checkpoints and delete older ones after each save; the checkpoint
    `latest` names is never deleted. 0 = keep every checkpoint."""

    loggers: tuple[str, ...] = ("jsonl",)
    """Where each step's metrics go: any of "jsonl" (out_dir/metrics.jsonl; always written),
    "tensorboard" (out_dir/tensorboard, through torch.utils.tensorboard; needs the `tensorboard`
    extra) and "wandb" (Weights & Biases; needs the wandb package and its login)."""

    num_threads: int | None = None
    """CPU threads for torch (torch.set_num_threads); None = torch's default."""

    trace_step: int | None = None
    """Write a Chrome/Perfetto trace of this optimizer step (1 = the first) to out_dir/trace.json
    (trace-rank{r}.json, one per rank, with several ranks); None = no trace. Open it at
    ui.perfetto.dev to see IO, compute and optimizer overlap."""

    export_dtype: str | None = choice_field("fp32", EXPORT_DTYPES)
    """At the end, write the consolidated weights in "fp32", "bf16" or "fp16": out_dir/model.safetensors for
    the built-in decoder, out_dir/hf/ for a Hugging Face model (with its config and tokenizer), out_dir/adapter/
    for lora.export = "adapter"; None = no export."""

    on_nonfinite: OnNonFinite = OnNonFinite.STOP
    """At a step whose loss or gradients hold inf or nan (the engine never updates from those):
    "stop" ends the run with a message naming the step, exit status 2, and no checkpoint or export
    after it; "skip" logs the step (metrics.jsonl: "nonfinite": true) and goes on. fp16's loss
    scaler skips overflowing steps on its own either way."""

    overwrite: bool = False
    """A fresh run (no --resume) into an out_dir that holds another run is refused unless this is
    true; then that run's checkpoints, latest, metrics, config, trace and export are removed first."""

    micro_batch_order: MicroBatchOrder = MicroBatchOrder.MICRO_BATCH_MAJOR
    """"micro_batch_major" (each micro-batch through the whole model in turn) or "layer_major" (all
    micro-batches through each block in turn: parameters fetched once per step instead of once per
    micro-batch, for the built-in decoder and Hugging Face decoder-only models; see MicroBatchOrder)."""

    dist_timeout_s: float = 300.0
    """Seconds a collective between ranks may wait (torch.distributed's process-group timeout):
    a rank that stopped answering ends the run with a message naming it after at most this long."""

    def __post_init__(self) -> None:
        coerce_fields(self, "train")
        if self.trace_step is not None and self.trace_step < 1:
            raise ValueError(f"train.trace_step={self.trace_step} must be 1 or more (1 = the first step), or none")
        if not self.out_dir.strip():
            raise ValueError("train.out_dir='' is empty (it would write into the current directory): name a directory")
        if not (MIN_DIST_TIMEOUT_S <= self.dist_timeout_s <= MAX_DIST_TIMEOUT_S):
            raise ValueError(
                f"train.dist_timeout_s={self.dist_timeout_s:g} must be a number of seconds from {MIN_DIST_TIMEOUT_S:g} "
                f"to {MAX_DIST_TIMEOUT_S:g}, e.g. 300"
            )
        if self.steps < 1:
            raise ValueError(f"train.steps={self.steps} must be at least 1")
        if self.trace_step is not None and self.trace_step > self.steps:
            raise ValueError(
                f"train.trace_step={self.trace_step} is past train.steps={self.steps}, so no step would be traced; "
                f"give a step from 1 to {self.steps}"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"train.checkpoint_every={self.checkpoint_every} must be 0 (only at the end) or more")
        if self.eval_batches < 1:
            raise ValueError(f"train.eval_batches={self.eval_batches} must be at least 1")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every={self.eval_every} must be 0 (only at the end) or more")
        if self.keep_last < 0:
            raise ValueError(f"train.keep_last={self.keep_last} must be 0 (keep every checkpoint) or more")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown:
            raise ValueError(
                f"train.loggers={list(self.loggers)!r}: {unknown[0]!r} is not a logger; "
                f"choose from {', '.join(LOGGERS)}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"train.num_threads={self.num_threads} must be at least 1, or None for torch's default")


@dataclass(frozen=True)
class RunConfig(OffloadConfig):
    """offload-train's whole configuration: the engine's sections, then the model, data, train and lora sections."""

    model: ModelConfig = ModelConfig()
    """The model offload-train builds."""

    data: DataConfig = DataConfig()
    """The corpus offload-train reads and its batching."""

    train: TrainConfig = TrainConfig()
    """Length, outputs and checkpoints of the run."""

    lora: LoraConfig = LoraConfig()
    """Low-rank adapters instead of full fine-tuning (off while lora.rank is 0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # What the engine takes alone (a loop may write its own rates there, a run may be extended
        # by hand) offload-train refuses: its loop writes no rate, and its length is train.steps.
        optimizer = self.optimizer
        if optimizer.lr == 0.0:
            raise ValueError(
                "optimizer.lr=0 trains nothing (every update is 0 times the gradient): give a rate above 0, e.g. 2e-3"
            )
        if optimizer.schedule is LRSchedule.WARMUP_COSINE:
            assert optimizer.total_steps is not None  # OptimizerConfig refuses warmup_cosine without it
            if optimizer.total_steps < self.train.steps:
                raise ValueError(
                    f"optimizer.total_steps={optimizer.total_steps} is shorter than train.steps={self.train.steps}: the "
                    f"cosine decay would end at step {optimizer.total_steps} and the last "
                    f"{self.train.steps - optimizer.total_steps} steps train at the flat floor "
                    f"(lr x min_lr_ratio); set optimizer.total_steps {self.train.steps}"
                )

    def warmup_note(self) -> "str | None":
        """A line saying the learning rate never reaches optimizer.lr within train.steps (a warmup longer
        than the run), or None. Not refused: a run resumed later with a larger train.steps goes on past it."""
        optimizer = self.optimizer
        if optimizer.schedule is not LRSchedule.WARMUP_COSINE or optimizer.warmup_steps <= self.train.steps:
            return None
        peak_fraction = self.train.steps / optimizer.warmup_steps
        return (
            f"optimizer.warmup_steps={optimizer.warmup_steps} is longer than train.steps={self.train.steps}: the "
            f"learning rate rises the whole run and ends at {peak_fraction:.0%} of optimizer.lr={optimizer.lr:g}; "
            f"lower optimizer.warmup_steps to at most {self.train.steps}, unless later resumes raise train.steps"
        )

    def engine_config(self) -> OffloadConfig:
        """The engine's sections alone, as initialize() takes them (and checkpoints save them)."""
        return OffloadConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(OffloadConfig)})
