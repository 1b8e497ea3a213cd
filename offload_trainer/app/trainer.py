"""The offload-train loop: build the model and data from a RunConfig, train with the engine,
checkpoint, resume, evaluate, and summarise.

    python -m offload_trainer                        # the built-in default run (a few minutes)
    python -m offload_trainer --config run.toml --train.steps 1000 --resume latest

`train_step` reads top to bottom: micro-batches forward and backward through the engine, then
one optimizer step. Everything a resumed run needs to continue bit for bit goes into each
checkpoint: the engine's shards and optimizer state, the data order's position and the RNG.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from io_engine.atomic_file import write_atomic

from offload_trainer.config import Tier
from offload_trainer.app.causal_lm import CausalLM, build_causal_lm
from offload_trainer.app.data import BatchStream, PackedDataset, Tokenizer, default_corpus_dir, read_documents
from offload_trainer.app.run_config import RunConfig
from offload_trainer.initialize import initialize
from offload_trainer.runtime.engine import Engine

LATEST = "latest"
"""File in train.out_dir naming the newest complete checkpoint (written after it is in place)."""


@dataclass
class RunSummary:
    """What a run did: the numbers a person reads at the end (and tests check)."""

    steps: int = 0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    eval_loss: float = float("nan")
    wall_s: float = 0.0
    tokens: int = 0
    phase_s: Dict[str, float] = field(default_factory=dict)
    bytes_read: Dict[str, int] = field(default_factory=dict)
    bytes_written: Dict[str, int] = field(default_factory=dict)
    peak_bytes: Dict[str, int] = field(default_factory=dict)
    checkpoints: List[str] = field(default_factory=list)
    export: Optional[str] = None


def build_data(cfg: RunConfig, tokenizer: Tokenizer) -> PackedDataset:
    path = cfg.data.path if cfg.data.path is not None else default_corpus_dir()
    documents = read_documents(path)
    return PackedDataset(documents, tokenizer, cfg.data.seq_len, cfg.data.eval_fraction, cfg.data.max_tokens)


def train_step(engine: Engine, lm: CausalLM, stream: BatchStream, accum: int) -> float:
    """One optimizer step over `accum` micro-batches; returns the mean loss."""
    total = 0.0
    for _ in range(accum):
        inputs, targets = stream.next_batch()
        loss = lm.loss(engine, inputs, targets)
        engine.backward(loss / accum)
        total += float(loss.detach())
    engine.step()
    return total / accum


@torch.no_grad()
def evaluate(engine: Engine, lm: CausalLM, data: PackedDataset, batch_size: int, max_batches: int) -> float:
    losses = []
    for i, (inputs, targets) in enumerate(data.eval_batches(batch_size)):
        if i >= max_batches:
            break
        losses.append(float(lm.loss(engine, inputs, targets)))
    return sum(losses) / len(losses) if losses else float("nan")


def resolve_checkpoint(out_dir: Path, resume: str) -> Path:
    """`resume` is "latest" (the newest complete checkpoint of the run) or a checkpoint's path."""
    if resume != LATEST:
        return Path(resume)
    pointer = out_dir / LATEST
    if not pointer.is_file():
        raise ValueError(f"--resume latest: {out_dir} has no checkpoint yet (no {pointer.name} file); start without --resume")
    return out_dir / pointer.read_text().strip()


def _remove_interrupted_saves(out_dir: Path) -> None:
    """Delete what a killed save left (`ckpt-*.tmp-*`, never a complete checkpoint) and stale
    `latest.tmp-*` files; complete checkpoints are never touched."""
    for path in out_dir.glob("*.tmp-*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class RankRows:
    """One rank's rows of each global batch (the global batch, and so the order, is the same on
    every rank, whatever their number)."""

    def __init__(self, stream: BatchStream, rank: int, world: int) -> None:
        self.stream, self.rank, self.world = stream, rank, world

    @property
    def tokens_per_batch(self) -> int:
        return self.stream.tokens_per_batch

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.stream.next_batch()
        return inputs.chunk(self.world)[self.rank], targets.chunk(self.world)[self.rank]

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


def _save(engine: Engine, stream: BatchStream, out_dir: Path, summary: RunSummary) -> None:
    name = f"ckpt-{engine.global_step:06d}"
    if (out_dir / name).exists():
        return  # already saved at this step (a resumed run ending where it started)
    extra = {"data": stream.state_dict(), "torch_rng": torch.get_rng_state().tolist(), "first_loss": summary.first_loss}
    engine.save_checkpoint(out_dir / name, extra=extra)
    if engine.collectives.rank == 0:
        write_atomic(out_dir / LATEST, name)
    summary.checkpoints.append(name)


def join_ranks() -> Tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1), join the process group: gloo on CPU, NCCL on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def run(cfg: RunConfig, resume: Optional[str] = None, progress: bool = True) -> RunSummary:
    """Train as `cfg` says, from scratch or from a checkpoint; returns the run's summary.

    Under torchrun every rank runs this: each takes its rows of every global batch, and rank 0
    alone writes the config, metrics and the `latest` pointer (saves and exports are collective).
    """
    from tqdm import tqdm

    start = time.perf_counter()
    rank, world = join_ranks()
    if cfg.data.batch_size % world:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} must be a multiple of the {world} ranks")
    if cfg.train.num_threads is not None:
        torch.set_num_threads(cfg.train.num_threads)
    out_dir = Path(cfg.train.out_dir)
    checkpoint = resolve_checkpoint(out_dir, resume) if resume is not None else None
    lm = build_causal_lm(cfg)
    data = build_data(cfg, lm.tokenizer)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        _remove_interrupted_saves(out_dir)
        write_atomic(out_dir / "config.json", cfg.to_json())
    if world > 1:
        dist.barrier()
    summary = RunSummary()
    stream = BatchStream(data, cfg.data.batch_size, cfg.seed)
    stream = RankRows(stream, rank, world) if world > 1 else stream
    torch.manual_seed(cfg.seed)  # the initial weights: the same draws as building the model directly
    micro_batch = (cfg.data.batch_size // world, cfg.data.seq_len)
    with initialize(lm.model, cfg.engine_config(), init_fn=lm.init_fn, micro_batch=micro_batch) as engine:
        if lm.weight_files:
            engine.load_safetensors(lm.weight_files)
        if checkpoint is not None:
            extra = engine.load_checkpoint(checkpoint)
            stream.load_state_dict(extra["data"])
            torch.set_rng_state(torch.tensor(extra["torch_rng"], dtype=torch.uint8))
            summary.first_loss = float(extra.get("first_loss", float("nan")))
        accum = cfg.grad_accum_steps
        tokens_per_step = stream.tokens_per_batch * accum
        phase = {"compute": 0.0, "io_wait": 0.0, "optimizer": 0.0, "communication": 0.0}
        moved: Dict[str, Dict[str, int]] = {"read": {}, "written": {}}
        metrics = open(out_dir / "metrics.jsonl", "a") if rank == 0 else open(os.devnull, "w")
        bar = tqdm(
            total=cfg.train.steps, initial=engine.global_step, disable=not progress or rank != 0, unit="step", dynamic_ncols=True
        )
        try:
            while engine.global_step < cfg.train.steps:
                step_start = time.perf_counter()
                if cfg.train.trace_step == engine.global_step + 1:
                    engine.trace_next_step(out_dir / "trace.json")
                loss = train_step(engine, lm, stream, accum)
                step_s = time.perf_counter() - step_start
                stats = engine.stats()
                if summary.first_loss != summary.first_loss:
                    summary.first_loss = loss
                summary.last_loss = loss
                summary.steps += 1
                summary.tokens += tokens_per_step
                for name in phase:
                    phase[name] += getattr(stats, f"{name}_s")
                io_bytes = 0
                for key, table in (("read", stats.bytes_read), ("written", stats.bytes_written)):
                    for tier, n in table.items():
                        moved[key][tier.value] = moved[key].get(tier.value, 0) + n
                        io_bytes += n if tier is Tier.NVME else 0
                record = {"step": engine.global_step, "loss": loss, "step_s": step_s, "tokens": tokens_per_step}
                record.update({k: v for k, v in stats.as_dict().items() if k != "step"})
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / step_s:,.0f}", nvme_gbps=f"{io_bytes / step_s / 1e9:.2f}")
                bar.update(1)
                every = cfg.train.checkpoint_every
                if every and engine.global_step % every == 0 and engine.global_step < cfg.train.steps:
                    _save(engine, stream, out_dir, summary)
            _save(engine, stream, out_dir, summary)
            summary.eval_loss = evaluate(engine, lm, data, cfg.data.batch_size, cfg.train.eval_batches)
            if cfg.train.export_dtype is not None:
                summary.export = str(lm.export(engine, out_dir, cfg.train.export_dtype))
        finally:
            bar.close()
            metrics.close()
        summary.phase_s = phase
        summary.bytes_read, summary.bytes_written = moved["read"], moved["written"]
        summary.peak_bytes = {t.value: engine.peak_bytes(t) for t in Tier}
    summary.wall_s = time.perf_counter() - start
    return summary


def format_summary(summary: RunSummary) -> str:
    gib = 1 << 30
    lines = [
        f"steps {summary.steps} in {summary.wall_s:.1f} s ({summary.tokens / max(summary.wall_s, 1e-9):,.0f} tokens/s overall)",
        f"loss: first step {summary.first_loss:.4f}, last step {summary.last_loss:.4f}; eval loss {summary.eval_loss:.4f}",
        "time per phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary.phase_s.items()),
        "bytes read per tier: " + (", ".join(f"{k} {v / gib:.2f} GiB" for k, v in summary.bytes_read.items()) or "none"),
        "bytes written per tier: " + (", ".join(f"{k} {v / gib:.2f} GiB" for k, v in summary.bytes_written.items()) or "none"),
        "peak bytes per tier: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in summary.peak_bytes.items()),
        "checkpoints: " + (", ".join(summary.checkpoints) or "none"),
        "exported weights: " + (summary.export or "none"),
    ]
    return "\n".join(lines)


def summary_json(summary: RunSummary) -> Dict[str, Any]:
    return dict(summary.__dict__)
