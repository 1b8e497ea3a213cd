"""The offload-train loop: build the model and data from a RunConfig, train with the engine,
checkpoint, resume, evaluate, and summarise.

    python -m offload_trainer                        # the built-in default run (200 steps)
    python -m offload_trainer --config run.toml --train.steps 1000 --resume latest

`train_step` reads top to bottom: micro-batches forward and backward through the engine, then
one optimizer step. Everything a resumed run needs to continue bit for bit goes into each
checkpoint: the engine's shards and optimizer state, the data order's position and the random
generators, the CPU's and the CUDA device's (rng_state.py).

The order of a run (Trainer.run): check everything that can be checked before the model is
built (run_checks.py), build the model and data, initialise the engine and load the weights and
the checkpoint, and only then touch train.out_dir (run_dir.py): remove what killed runs left,
the replaced run (train.overwrite), the metrics of steps past the resumed checkpoint (TensorBoard's
are purged as its writer opens: loggers.py), and write config.json. A refused run leaves out_dir
as it was. On the way out of a failed or interrupted run, whatever this run left half written
(`*.tmp-*`) is removed, by rank 0 (a rank other than 0 writes only its checkpoint parts, which its
save removes; it removes the rest only after a collective failed); the engine's `with` block removes
its swap files.
"""

from __future__ import annotations

import enum
import itertools
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from io_engine.atomic_file import TEMP_MARKER, make_dirs, temporary_name, write_atomic

from offload_trainer.app.causal_lm import CausalLM, build_causal_lm, byte_tokens_note, mean_on_host
from offload_trainer.app.data import (
    IGNORE_INDEX, Batch, BatchStream, PackedDataset, Tokenizer, load_corpus, max_tokens_note,
)
from offload_trainer.app.data_identity import check_same_data, data_identity
from offload_trainer.app.model_identity import check_same_model, model_identity
from offload_trainer.app.keep_last import prune_checkpoints
from offload_trainer.app.loggers import Loggers, NoLoggers, check_loggers, json_values, open_loggers
from offload_trainer.app.progress import RunProgress, phase, say_on_stdout
from offload_trainer.app.rng_state import load_rng_state, rng_state
from offload_trainer.app.torch_threads import use_run_threads
from offload_trainer.app.ranks import RankFailure, Ranks, join_ranks
from offload_trainer.app.packed_attention import check_packed_attention
from offload_trainer.app.run_checks import (
    RESUME_AUTO, check_micro_batch_order, check_run, check_sequences_per_step, with_real_nvme_dir,
)
from offload_trainer.app.layer_major_step import train_step_layer_major
from offload_trainer.app.run_config import MicroBatchOrder, OnNonFinite, RunConfig
from offload_trainer.app.run_lock import OutDirInUse, OutDirLock
from offload_trainer.app.std_streams import surviving_lost
from offload_trainer.app.target_weights import target_weights, trained_tokens
from offload_trainer.app.run_dir import (
    CONFIG,
    EXPORTS,
    LATEST,
    METRICS,
    PLAN,
    checkpoint_name,
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
    point_latest,
    point_latest_nowhere,
    remove_entries,
    remove_first_start,
    remove_new_temporaries,
    remove_run,
    replacement_interrupted,
    run_contents,
    temporaries,
    take_metrics,
    trace_name,
    truncate_metrics,
)
from offload_trainer.app.user_errors import naming_path
from offload_trainer.config import Tier
from offload_trainer.config.byte_size import format_bytes
from offload_trainer.errors import CheckpointError, NonFiniteError
from offload_trainer.initialize import initialize
from offload_trainer.runtime.engine import Engine
from offload_trainer.runtime.metrics import StepStats

class NonFiniteStop(NonFiniteError):
    """A step's loss or gradients held inf or nan and train.on_nonfinite is "stop": the run ends, unsaved."""


@dataclass
class RunSummary:
    """What a run did: the numbers a person reads at the end (and tests check)."""

    steps: int = 0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    eval_loss: float = float("nan")
    wall_s: float = 0.0
    """The whole run, start-up, evals, saves and export included."""
    train_s: float = 0.0
    """The optimizer steps alone (what tokens/s is measured over)."""
    tokens: int = 0
    """Tokens the steps ran through the model (batch x seq_len per micro-batch): what tokens/s counts."""
    trained_tokens: int = 0
    """Of those, the targets the loss trained on (all but chat prompts' and padding): trained tokens/s."""
    phase_s: Dict[str, float] = field(default_factory=dict)
    bytes_read: Dict[str, int] = field(default_factory=dict)
    bytes_written: Dict[str, int] = field(default_factory=dict)
    peak_bytes: Dict[str, int] = field(default_factory=dict)
    checkpoints: List[str] = field(default_factory=list)
    export: Optional[str] = None
    nonfinite_steps: List[int] = field(default_factory=list)
    """Steps whose loss or gradients held inf or nan, skipped (train.on_nonfinite = "skip")."""
    overflow_steps: List[int] = field(default_factory=list)
    """fp16 steps whose gradients overflowed at the loss scale: skipped, the scale halved (not non-finite)."""
    resumed_step: Optional[int] = None
    """The step of the checkpoint this run resumed from (None: a fresh run). first_loss is then the
    whole run's, kept in the checkpoint: an uninterrupted run's summary and a resumed one's agree."""


def resolved_config(cfg: RunConfig, engine: Engine) -> RunConfig:
    """`cfg` as the engine runs it: under placement = "auto", with the planner's tiers and lookahead
    (placement then "manual", the budgets as the user set them), so config.json re-runs this placement."""
    choice = engine.placement_choice
    return cfg if choice is None else choice.apply(cfg)


def build_data(cfg: RunConfig, tokenizer: Tokenizer, say: Optional[Callable[[str], None]] = None) -> PackedDataset:
    return load_corpus(cfg.data, tokenizer, say)


def train_step(engine: Engine, lm: CausalLM, stream: BatchStream, accum: int) -> Tuple[float, int]:
    """One optimizer step over `accum` micro-batches; returns this rank's share of the step's loss, the
    mean over the step's target tokens (each micro-batch's mean weighed by its targets: target_weights.py),
    read on the host once, after step() (mean_on_host), and the targets this rank trained on (chat prompts'
    are not: trained_tokens)."""
    batches = [stream.next_batch() for _ in range(accum)]
    weights = target_weights([batch.targets for batch in batches], engine.collectives)
    losses: List[torch.Tensor] = []
    for (inputs, targets, position_ids), weight in zip(batches, weights):
        loss = lm.loss(engine, inputs, targets, position_ids) * weight
        engine.backward(loss / accum)
        losses.append(loss.detach())
    engine.step()
    return mean_on_host(losses), trained_tokens([batch.targets for batch in batches])


@torch.no_grad()
def evaluate(
    engine: Engine, lm: CausalLM, data: PackedDataset, batch_size: int, max_batches: int,
    on_batch: Optional[Callable[[], None]] = None,
) -> float:
    """The mean loss over the target tokens of the first `max_batches` held-out batches (each batch's
    mean weighed by its targets, as a step's: target_weights.py; a smaller last batch, or one of
    fewer trained tokens, weighs less), with the model in eval mode (dropout off); the model's
    train/eval mode is restored afterwards. The losses are read on the host once, at the end
    (mean_on_host). With several ranks each takes its rows of every batch (eval_share), as of a
    training batch, and every rank returns the mean over all of them."""
    collectives = getattr(engine, "collectives", None)
    rank, world = (collectives.rank, collectives.world_size) if collectives is not None else (0, 1)
    batches = [eval_share(batch, rank, world) for batch in itertools.islice(data.eval_batches(batch_size), max_batches)]
    weights = target_weights([batch.targets for batch in batches], collectives)
    was_training = lm.model.training
    lm.model.eval()
    try:
        losses: List[torch.Tensor] = []
        for (inputs, targets, position_ids), weight in zip(batches, weights):
            losses.append(lm.loss(engine, inputs, targets, position_ids) * weight)
            if on_batch is not None:
                on_batch()
    finally:
        lm.model.train(was_training)
    mine = mean_on_host(losses)
    if world == 1:
        return mine
    total = torch.tensor([mine], dtype=torch.float64)  # each rank's share of the mean (target_weights.py)
    collectives.all_reduce_sum(total)
    return float(total.item()) / world


def eval_share(batch: Batch, rank: int, world: int) -> Batch:
    """Rank `rank`'s rows of one held-out batch of the global data.batch_size (as even a split as can be):
    evaluating the whole batch on every rank took `world` times the logits and activations of a training
    micro-batch, which the run's checks and the planner size the device for. A rank left without a row
    (a last batch of fewer rows than ranks) gets the batch's first row with no target trained: it
    weighs nothing, but every rank must run each forward (it all-gathers the parameters)."""
    if world == 1:
        return batch
    mine = Batch(*(None if t is None else t.tensor_split(world)[rank] for t in batch))
    if mine.inputs.shape[0] == 0:
        positions = None if batch.position_ids is None else batch.position_ids[:1].clone()
        return Batch(batch.inputs[:1].clone(), torch.full_like(batch.targets[:1], IGNORE_INDEX), positions)
    return mine


def learning_rate(engine: Engine) -> Optional[float]:
    """The learning rate the engine's next step() applies: its schedule's at the step to come, or, once a
    torch scheduler drives them, the param groups' (the engine sets its groups from the schedule only
    inside step(), so between steps they hold the last step's rate, and a run resumed there the next's:
    metrics.jsonl's lr lagged a step in an uninterrupted run and differed in a resumed one)."""
    rates = getattr(engine, "lr_optimizer", None)
    schedule = getattr(engine, "lr_schedule", None)
    if schedule is not None and not (rates is not None and rates.driven_by_scheduler):
        return float(schedule(engine.global_step))
    groups = getattr(engine, "param_groups", None)
    return float(groups[0]["lr"]) if groups else None


class RankRows:
    """One rank's rows of each global batch (the global batch, and so the order, is the same on
    every rank, whatever their number)."""

    def __init__(self, stream: BatchStream, rank: int, world: int) -> None:
        self.stream, self.rank, self.world = stream, rank, world

    @property
    def tokens_per_batch(self) -> int:
        return self.stream.tokens_per_batch

    @property
    def epochs_done(self) -> float:
        return self.stream.epochs_done

    def next_batch(self) -> Batch:
        return Batch(*(None if t is None else t.chunk(self.world)[self.rank] for t in self.stream.next_batch()))

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


def _weights_said(lm: CausalLM) -> str:
    """Where the weights being loaded come from, for the start-up line: 'from DIR (N file(s), X GiB)'."""
    files = lm.weight_files if isinstance(lm.weight_files, list) else getattr(lm.weight_files, "paths", None)
    where = lm.hf_dir if lm.hf_dir is not None else (Path(files[0]).parent if files else None)
    said = f"from {where}" if where is not None else ""
    if files:
        nbytes = sum(os.path.getsize(f) for f in files)
        said += f" ({len(files)} file(s), {nbytes / 2**30:.2f} GiB)"
    return said.strip()


class RunPhase(enum.Enum):
    """How far a run has got: what its last line says if it ends there."""

    STARTING = "starting"
    """Checks, model, data, engine and the resumed checkpoint's load: train.out_dir is untouched."""
    TRAINING = "training"
    """train.out_dir prepared; the steps, their evals and saves, up to the last step's save."""
    EXPORTING = "exporting"
    """Every step is saved; the export at the end is being written."""
    FINISHING = "finishing"
    """Every step is saved and the export (if any) written; the engine and the logs are closing."""


def _say(line: str) -> None:
    """A note on stderr, above the progress bar when there is one."""
    from tqdm import tqdm

    with surviving_lost(sys.stderr):  # a note nobody can read is no reason to stop
        tqdm.write(f"offload-train: {line}", file=sys.stderr)


class Trainer:
    """One offload-train run. `step` (the last optimizer step completed) and `how_to_continue()` stay
    readable after run() raised, for the message the command line ends with."""

    def __init__(
        self,
        cfg: RunConfig,
        resume: Optional[str] = None,
        progress: bool = True,
        ranks: Optional[Ranks] = None,
        say: Callable[[str], None] = _say,
    ) -> None:
        self.cfg = cfg
        self.resume = resume
        self.progress = progress
        self.ranks = ranks
        self.say = say
        self.out_dir = Path(cfg.train.out_dir)
        self.out_dir_lock = OutDirLock(self.out_dir)
        """Rank 0's hold on out_dir while the run lives (run_lock.py): one run per directory."""
        self.step = 0
        """The last optimizer step completed (the resumed checkpoint's step before the first)."""
        self.stepping = False
        """True from the start of a step until it is counted in `step`: between steps (its eval, its log
        line, the checkpoint due before `saving` is set) the run is after step `step`, not in the next."""
        self.resumed_from: Optional[Path] = None
        self.data_identity: Dict[str, Any] = {}
        """What the data order depends on (data_identity.py): saved in each checkpoint, checked at resume."""
        self.show: Callable[[str], None] = lambda line: None
        """Rank 0's lines on stdout (the run's progress); set once the run starts."""
        self.saving: Optional[str] = None
        """The checkpoint whose save is under way (engine.save_checkpoint), else None."""
        self.loading: Optional[str] = None
        """The checkpoint being loaded to resume from, else None."""
        self.phase = RunPhase.STARTING
        """How far the run has got, for the line it ends with (moment(), how_to_continue())."""
        self.export_target: Optional[Path] = None
        """Where the export at the end writes, once it has begun."""

    # -- what to tell the user -------------------------------------------------------------------

    def how_to_continue(self) -> str:
        """What is on disk, and what continues this run after it ended early: resume, start over, run
        again, or nothing (it ended after its last step was saved)."""
        name = latest_checkpoint(self.out_dir)
        if self.phase in (RunPhase.EXPORTING, RunPhase.FINISHING) and name is not None:
            if self.phase is RunPhase.EXPORTING:
                return (
                    f"every step is saved ({name}) but the export to {self.export_target} is not written (what "
                    "was there is as it was): run with --resume latest to write it"
                )
            written = f" and the export is in {self.export_target}" if self.export_target is not None else ""
            return f"every step is saved ({name}){written}: the run is complete"
        if name is not None:
            return f"resume with --resume latest (the newest checkpoint is {name})"
        if replacement_interrupted(self.out_dir):
            return "the run before is half removed: start again with --train.overwrite true to finish replacing it"
        if self.resumed_from is not None:  # made to name none by this run, before it saved anything
            return f"resume with --resume {self.resumed_from} (the checkpoint this run resumed from)"
        complete = complete_checkpoints(self.out_dir)
        if complete:  # `latest` was made to name none while the checkpoint it named was being replaced
            return f"resume with --resume {complete[-1]} (the newest complete checkpoint; {LATEST} names none)"
        if run_contents(self.out_dir):
            if self.resume == RESUME_AUTO and self.phase is not RunPhase.STARTING:  # out_dir holds this run's files
                return "no checkpoint was written yet: run the same command again (--resume auto starts this run over)"
            return (
                "no checkpoint was written yet, so there is nothing to resume: start again with "
                "--train.overwrite true"
            )
        return "nothing was written: run the same command again"

    def moment(self) -> str:
        """Where the run was, for the line it ends with: "while saving ckpt-000004", "while exporting the
        weights", "while loading ckpt-000004" (to resume from it), "during step 5", "while starting"
        (before train.out_dir is touched), "after step 4" (its eval, its log line, on its way to its save)
        or "after its last step" (closing the engine and the logs)."""
        if self.saving is not None:
            return f"while saving {self.saving}"
        if self.loading is not None:
            return f"while loading {self.loading}"
        return {
            RunPhase.STARTING: "while starting",
            RunPhase.TRAINING: (
                f"during step {self.step + 1}" if self.stepping
                else f"after step {self.step}" if self.step > 0 else "before step 1"
            ),
            RunPhase.EXPORTING: "while exporting the weights",
            RunPhase.FINISHING: "after its last step",
        }[self.phase]

    def _peers_temporaries(self) -> Set[str]:
        """The temporaries of the save under way, in a run of several ranks, when this rank failed on
        its own (a signal to it alone, an error of its own): the other ranks may still be writing into
        its directory, so each rank's save removes its own part of it and the last one out the
        directory (runtime/persist/checkpoint.py). Removed whole here, a rank interrupted alone made
        its peers fail with "No such file or directory" instead of finding it gone. After a collective
        failure no peer writes any more (one is gone), and the rank left removes what a killed one left."""
        if self.saving is None or self.ranks is None or not self.ranks.several:
            return set()
        return {name for name in temporaries(self.out_dir) if name.startswith(f"{self.saving}{TEMP_MARKER}")}

    def _removes_leftovers(self, collective: bool) -> bool:
        """Whether this rank, on its way out of a failed or interrupted run, removes the temporaries that
        appeared in out_dir meanwhile. Rank 0 does: it writes every file there but the other ranks' parts
        of a checkpoint, which each rank's save removes itself. A rank other than 0 does only after a
        collective failure, when no peer writes any more: interrupted alone (a signal to it alone, between
        two collectives) it removed the atomic file rank 0 was writing (`latest`, config.json, the
        export), whose rename then failed with "No such file or directory", blaming train.out_dir (exit 2)."""
        ranks = self.ranks
        return ranks is None or not ranks.several or ranks.rank == 0 or collective

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Train as the config says, from scratch or from a checkpoint; returns the run's summary.

        Under torchrun every rank runs this: each takes its rows of every global batch, and rank 0
        alone writes the config, metrics and the `latest` pointer (saves and exports are collective).
        """
        own_ranks = self.ranks is None
        if self.ranks is None:
            self.ranks = join_ranks(self.cfg.train.dist_timeout_s)
        try:
            if self.ranks.rank == 0:
                self.out_dir_lock.acquire()  # before out_dir is read: another run's files are not ours
            before = temporaries(self.out_dir)
            try:
                return self._run(self.ranks)
            except BaseException as exc:
                # What this run left half written: a checkpoint's temporary directory, an atomic file's.
                # Not when another run holds out_dir: the temporaries that appeared meanwhile are its
                # (two fresh runs racing to make out_dir: `before` was taken when it did not exist).
                collective = self.ranks.is_collective_failure(exc)
                if not isinstance(exc, OutDirInUse) and self._removes_leftovers(collective):
                    remove_new_temporaries(self.out_dir, before if collective else before | self._peers_temporaries())
                if collective:
                    raise RankFailure(self.ranks.describe_failure(exc, self.moment(), self.how_to_continue())) from exc
                raise
        finally:
            self.out_dir_lock.release()
            if own_ranks:
                self.ranks.leave()

    def _run(self, ranks: Ranks) -> RunSummary:
        cfg, out_dir = self.cfg, self.out_dir
        start = time.perf_counter()
        checkpoint = check_run(cfg, self.resume, ranks.world_size)
        check_loggers(cfg.train.loggers)
        use_run_threads(cfg.train.num_threads)
        show = say_on_stdout if ranks.rank == 0 else (lambda line: None)
        lm = build_causal_lm(cfg)
        if ranks.rank == 0:  # notes, as the corpus cut's: the byte tokens' before the corpus is tokenized with them
            for note in (cfg.warmup_note(), byte_tokens_note(lm)):
                if note is not None:
                    self.say(note)
        data = build_data(cfg, lm.tokenizer, show)
        check_sequences_per_step(cfg, data.num_train_sequences)
        check_micro_batch_order(cfg, data.restarts_positions)
        self.data_identity = data_identity(cfg, data)
        summary = RunSummary()
        stream = BatchStream(data, cfg.data.batch_size, cfg.seed)
        stream = RankRows(stream, ranks.rank, ranks.world_size) if ranks.several else stream
        torch.manual_seed(cfg.seed)  # the initial weights: the same draws as building the model directly
        micro_batch = (cfg.data.batch_size // ranks.world_size, cfg.data.seq_len)
        params = sum(p.numel() for p in lm.model.parameters())  # tied ones once
        with naming_path(cfg.tiers.nvme_dir or out_dir), phase(
            show, f"building the engine ({params / 1e6:,.1f} M parameters into their homes)", "built the engine"
        ):
            engine_cfg = with_real_nvme_dir(cfg.engine_config())
            engine = initialize(lm.model, engine_cfg, init_fn=lm.init_fn, micro_batch=micro_batch)
        with engine:
            self._report_reclaimed(engine)
            if lm.weight_files and checkpoint is None:
                # A checkpoint holds every parameter, frozen ones (a LoRA base) included: reading the
                # model's own weights first, only to write over them, took minutes on a large model.
                with phase(show, f"loading the weights {_weights_said(lm)}", "loaded the weights"):
                    engine.load_safetensors(lm.weight_files)
            if checkpoint is not None:
                self.loading = checkpoint.name
                with phase(show, f"resuming from {checkpoint}", f"resumed from {checkpoint.name}"):
                    summary.first_loss = self._load_checkpoint(engine, stream, checkpoint)
                self.resumed_from, self.loading = checkpoint, None
            if data.restarts_positions and lm.hf_dir is not None:
                note = check_packed_attention(engine, lm)  # collective: every rank probes alike
                if note is not None and ranks.rank == 0:
                    self.say(note)
            self.step = engine.global_step
            if checkpoint is not None and engine.global_step > cfg.train.steps:
                raise ValueError(
                    f"train.steps={cfg.train.steps} is below the step of the checkpoint resumed ({checkpoint.name}: "
                    f"step {engine.global_step}), so there is nothing to train; raise train.steps above "
                    f"{engine.global_step}, or resume from an earlier checkpoint"
                )
            resolved = resolved_config(cfg, engine)
            resumed_step = engine.global_step if checkpoint is not None else None
            summary.resumed_step = resumed_step
            # Everything is validated and loaded, on every rank: only now is out_dir touched. The
            # barrier keeps a rank whose checks ran late (a loaded machine) from finding rank 0's
            # fresh config.json and refusing out_dir as another run's.
            ranks.barrier()
            self.phase = RunPhase.TRAINING
            if ranks.rank == 0:
                export = lm.export_target(out_dir).name if cfg.train.export_dtype is not None else None
                self._prepare_out_dir(resolved, resumed_step, export)
                cut = max_tokens_note(cfg.data, data)  # once the run goes on: a refusal stays one line
                if cut is not None:
                    self.say(cut)
            ranks.barrier()
            progress = RunProgress(cfg.train.steps, engine.global_step, bar=self.progress, enabled=ranks.rank == 0)
            self.show = progress.say
            loggers: Loggers = NoLoggers()
            try:
                self._show_placement(resolved, engine, micro_batch, ranks.world_size, params)
                if ranks.rank == 0:
                    # Resumed from another directory, out_dir's TensorBoard events are another run's: all purged
                    # (as if resumed at step 0), as its metrics rows are replaced (_prepare_out_dir).
                    kept_step = 0 if self._resumed_elsewhere() else resumed_step
                    loggers = open_loggers(cfg.train.loggers, out_dir, resolved, kept_step)
                self._train(engine, lm, data, stream, summary, progress, loggers)
                if summary.eval_loss != summary.eval_loss:  # no step ran: resumed at train.steps already
                    summary.eval_loss = self._evaluate(engine, lm, data, progress)
                if cfg.train.export_dtype is not None:
                    self.phase, self.export_target = RunPhase.EXPORTING, lm.export_target(out_dir)
                    exporting = f"exporting the weights ({cfg.train.export_dtype}) to {self.export_target}"
                    with progress.phase(exporting, "exported"):
                        with naming_path(out_dir):
                            summary.export = str(lm.export(engine, out_dir, cfg.train.export_dtype))
                self.phase = RunPhase.FINISHING
            finally:
                progress.close()
                loggers.close()
            summary.peak_bytes = {t.value: engine.peak_bytes(t) for t in Tier}
        summary.wall_s = time.perf_counter() - start
        return summary

    def _train(
        self, engine: Engine, lm: CausalLM, data: PackedDataset, stream: Any, summary: RunSummary,
        progress: RunProgress, loggers: Loggers,
    ) -> None:
        """The steps up to train.steps, each logged, with the evals and checkpoints due, then the last save."""
        cfg, out_dir, ranks = self.cfg, self.out_dir, self.ranks
        assert ranks is not None
        accum = cfg.grad_accum_steps
        tokens_per_step = stream.tokens_per_batch * accum
        phase = {"compute": 0.0, "io_wait": 0.0, "optimizer": 0.0, "communication": 0.0}
        moved: Dict[str, Dict[str, int]] = {"read": {}, "written": {}}
        summary.phase_s = phase
        summary.bytes_read, summary.bytes_written = moved["read"], moved["written"]
        while engine.global_step < cfg.train.steps:
            if cfg.train.trace_step == engine.global_step + 1:
                engine.trace_next_step(out_dir / trace_name(ranks.rank, ranks.world_size))
            lr = learning_rate(engine)
            step_start = time.perf_counter()
            self.stepping = True
            layer_major = cfg.train.micro_batch_order is MicroBatchOrder.LAYER_MAJOR
            local_loss, local_trained = (train_step_layer_major if layer_major else train_step)(engine, lm, stream, accum)
            step_s = time.perf_counter() - step_start
            loss, trained = self._sum_over_ranks(engine, local_loss, local_trained)
            self.step, self.stepping = engine.global_step, False
            stats = engine.stats()
            nonfinite = self._nonfinite(local_loss, loss, stats)
            summary.steps += 1
            summary.tokens += tokens_per_step
            summary.trained_tokens += trained
            summary.train_s += step_s
            for name in phase:
                phase[name] += getattr(stats, f"{name}_s")
            nvme_bytes = _add_moved(moved, stats)
            row: Dict[str, Any] = {
                "step": engine.global_step, "time": time.time(), "loss": loss if math.isfinite(loss) else None,
                "lr": lr,
            }
            row.update({k: v for k, v in stats.as_dict().items() if k != "step"})
            # The step alone (the engine's step_s runs from step() to step(), evals and saves included).
            # tokens: what the model ran through; trained_tokens: the targets the loss counted (chat data's
            # prompts are not), as torchtune's tokens/s counts them.
            row.update(step_s=step_s, tokens=tokens_per_step, tokens_per_s=tokens_per_step / step_s,
                       trained_tokens=trained, trained_tokens_per_s=trained / step_s,
                       nvme_gbps=nvme_bytes / step_s / 1e9, epoch=stream.epochs_done)
            if nonfinite is not None:
                row["nonfinite"] = True
                summary.nonfinite_steps.append(engine.global_step)
                if cfg.train.on_nonfinite is OnNonFinite.STOP:
                    loggers.log(row)
                    raise NonFiniteStop(self._stop_message(nonfinite))
                if ranks.rank == 0:
                    self.say(f"step {engine.global_step}: {nonfinite}; skipped (train.on_nonfinite = skip)")
            else:
                if stats.skipped:
                    summary.overflow_steps.append(engine.global_step)
                if summary.first_loss != summary.first_loss:
                    summary.first_loss = loss
                summary.last_loss = loss
            last = engine.global_step >= cfg.train.steps
            every = cfg.train.eval_every
            if last or (every and engine.global_step % every == 0):
                row["eval_loss"] = summary.eval_loss = self._evaluate(engine, lm, data, progress)
            loggers.log(row)
            progress.step(row)
            every = cfg.train.checkpoint_every
            if every and engine.global_step % every == 0 and not last:
                self._save(engine, stream, summary, progress, loggers)
        self._save(engine, stream, summary, progress, loggers)
        _add_moved(moved, engine.unreported_pass_stats())  # the last step's update pass: in no step's stats

    def _evaluate(self, engine: Engine, lm: CausalLM, data: PackedDataset, progress: RunProgress) -> float:
        """The eval loss; NaN (null in metrics.jsonl) where nothing is held out (data.eval_fraction = 0),
        without the "evaluating on N held-out batches" lines that said it measured one."""
        held_out = -(-data.num_eval_sequences // self.cfg.data.batch_size)
        batches = min(self.cfg.train.eval_batches, held_out)
        if batches == 0:
            return float("nan")
        bar = progress.batches("evaluating", batches)
        try:
            said = f"{batches} held-out batch" + ("" if batches == 1 else "es")
            with progress.phase(f"evaluating on {said}", "evaluated"):
                return evaluate(engine, lm, data, self.cfg.data.batch_size, batches, on_batch=lambda: bar.update(1))
        finally:
            bar.close()

    def _sum_over_ranks(self, engine: Engine, loss: float, trained: int) -> Tuple[float, int]:
        """The step's loss over the whole global batch, and its trained targets. Each rank's share of the
        loss (its micro-batches' means weighed by their targets against the step's mean count over every
        rank: target_weights.py), averaged over the ranks, is the mean over every target token of the
        step; not finite if any rank's is not. One all-reduce for both."""
        if self.ranks is None or not self.ranks.several:
            return loss, trained
        total = torch.tensor([loss, trained], dtype=torch.float64)  # counts far below 2**53: exact
        engine.collectives.all_reduce_sum(total)
        return float(total[0].item()) / self.ranks.world_size, int(total[1].item())

    def _show_placement(
        self, resolved: RunConfig, engine: Engine, micro_batch: Tuple[int, int], world: int, numel: int
    ) -> None:
        """Print where the state lives (what config.json holds) and, under placement = "auto", the planner's
        table. `numel`: the model's parameters, counted before initialize (the model holds placeholders since)."""
        from offload_trainer.planning.report import placement_words, render

        t = resolved.tiers
        choice = engine.placement_choice
        self.show(
            f"placement: {placement_words(t.params, t.grads, t.optimizer)}; lookahead "
            f"{resolved.prefetch.lookahead_groups} groups" + (" (planned: placement = auto)" if choice else "")
        )
        if choice is None:
            return

        title = f"the planner's choice for this run ({micro_batch[0]} x {micro_batch[1]} tokens per micro-batch)"
        table = render(choice, title, numel, world, resolved, None)
        self.show(table)
        if self.ranks is not None and self.ranks.rank == 0:
            with naming_path(self.out_dir / PLAN):
                write_atomic(self.out_dir / PLAN, table + "\n")

    def _load_checkpoint(self, engine: Engine, stream: Any, checkpoint: Path) -> float:
        """Restore the engine, the data order and the RNG from `checkpoint`; returns the run's first loss.
        What offload-train saved besides the engine's state is checked here (CheckpointError if wrong)."""
        try:
            extra = engine.load_checkpoint(checkpoint)
        except CheckpointError as exc:
            if _DAMAGE.search(str(exc)) is None:
                raise  # not damage (another model, another optimizer): its line says what to do
            raise CheckpointError(f"{exc}; {_other_checkpoint(checkpoint)}") from None
        scale = engine.state_dict().get("loss_scale", {}).get("scale")
        if not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise CheckpointError(
                f"{checkpoint} is corrupted: its loss scale is {scale!r}, which must be a number above 0"
            )
        check_same_data(extra.get("data_identity"), self.data_identity, checkpoint)  # ValueError naming what changed
        check_same_model(extra.get("model_identity"), model_identity(self.cfg), checkpoint)
        try:
            first_loss = float(extra.get("first_loss", float("nan")))
            stream.load_state_dict(extra["data"])  # checks it all before it changes anything
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            what = f"no {exc.args[0]!r} entry" if isinstance(exc, KeyError) else str(exc)
            raise CheckpointError(
                f"{checkpoint} was not saved by offload-train or is corrupted: the data position it "
                f"keeps for offload-train is unusable ({what}); resume from another checkpoint"
            ) from None
        load_rng_state(extra, engine.device, checkpoint)
        return first_loss

    def _report_reclaimed(self, engine: Engine) -> None:
        """Say what the engine's swap store removed of dead runs (io_engine/swap_dirs.py reclaims them)."""
        store = getattr(getattr(engine, "tiers", None), "store", None)
        dirs = getattr(store, "reclaimed_dirs", None) or []
        if dirs:
            freed = int(getattr(store, "reclaimed_bytes", 0) or 0)
            self.say(
                f"removed {len(dirs)} swap directories of dead runs in {self.cfg.tiers.nvme_dir}, "
                f"freeing {format_bytes(freed)}"
            )

    def _prepare_out_dir(self, resolved: RunConfig, resumed_step: Optional[int], export: Optional[str]) -> None:
        """Rank 0, after every check passed: make out_dir, remove the replaced run (train.overwrite, or
        under --resume auto what this same run left before its first checkpoint: started_before),
        what killed runs left and a resumed run's stale exports (`export`: the name of the one this
        run writes at its end, if any), make `latest` name no checkpoint past the resumed step, cut
        the metrics back to that step, write config.json (the config as resolved: under placement =
        "auto", the planner's placement and lookahead; its path settings absolute, so `--config
        out_dir/config.json` from another directory runs on the same corpus, model and directories)."""
        out_dir = self.out_dir
        with naming_path(out_dir):
            make_dirs(out_dir)
            self.out_dir_lock.acquire()  # a fresh run's out_dir exists only from here
            if self.cfg.train.overwrite:
                remove_run(out_dir)
            elif self.resume == RESUME_AUTO and resumed_step is None:
                remove_first_start(out_dir)  # the checks passed: nothing is there, or this run's own first start
            remove_entries(out_dir, sorted(temporaries(out_dir)))
            if resumed_step is not None:
                remove_entries(out_dir, self._stale_exports(resumed_step, export))
        if resumed_step is not None:
            with naming_path(out_dir / LATEST):
                self._point_latest_back_to(resumed_step)
            with naming_path(out_dir / METRICS):
                if self._resumed_elsewhere():  # out_dir's rows are not its history
                    take_metrics(out_dir, self.resumed_from.resolve().parent, resumed_step)
                else:
                    truncate_metrics(out_dir, resumed_step)
        with naming_path(out_dir / CONFIG):
            # Relative path settings meant this directory; read from another one they named another corpus or none.
            write_atomic(out_dir / CONFIG, resolved.with_absolute_paths().to_json())

    def _resumed_elsewhere(self) -> bool:
        """Whether this run resumed from a checkpoint of another directory than train.out_dir."""
        resumed = self.resumed_from
        return resumed is not None and resumed.resolve().parent != self.out_dir.resolve()

    def _stale_exports(self, resumed_step: int, rewritten: Optional[str]) -> List[str]:
        """The exports in out_dir that a resumed run removes before its first step, of those it does not
        write again at its end (`rewritten`: the name of its own export, None with train.export_dtype =
        none). An export is of the weights of the step `latest` named when it was written: it stays
        only when this run ends with those weights (it resumed from `latest` at train.steps already).
        Kept, a resume with train.export_dtype = none (or with another export: adapters now, the
        whole model before) left an export of older weights beside the newer checkpoints."""
        latest = latest_checkpoint(self.out_dir)
        resumed = self.resumed_from
        if (resumed is not None and latest is not None and resumed_step >= self.cfg.train.steps
                and resumed.resolve() == (self.out_dir / latest).resolve()):
            return []
        return [name for name in EXPORTS if name != rewritten]

    def _nonfinite(self, loss: float, mean_loss: float, stats: StepStats) -> Optional[str]:
        """What was not finite at the step just taken (the loss on any rank, or the gradients), or None.
        `mean_loss` is the loss over every rank (the same on each), so every rank decides alike."""
        finite_loss = math.isfinite(mean_loss)
        loss_text = (
            f"the loss is {loss}" if not math.isfinite(loss) else "the loss is not finite on another rank"
        )
        if stats.nonfinite:
            also = "" if finite_loss else loss_text + " and "
            floor = (
                f" even at the minimum loss scale (precision.min_loss_scale={stats.loss_scale:g})"
                if self.cfg.precision.uses_loss_scaling else ""
            )
            return also + f"the gradients hold inf or nan{floor}, so nothing was updated"
        return None if finite_loss else loss_text

    def _stop_message(self, what: str) -> str:
        name = latest_checkpoint(self.out_dir)
        then = (
            f"then resume from the last good checkpoint with --resume latest ({name})" if name is not None
            else "then start again with --train.overwrite true (no checkpoint was written yet)"
        )
        return (
            f"step {self.step}: {what}; the run stopped (train.on_nonfinite = stop) and saved nothing after it. "
            f"Lower optimizer.lr or set optimizer.grad_clip_norm, {then}; or pass --train.on_nonfinite skip "
            "to skip such steps"
        )

    def _save(
        self, engine: Engine, stream: Any, summary: RunSummary, progress: RunProgress, loggers: Loggers
    ) -> None:
        """Save the checkpoint of this step and point `latest` at it, once the metrics of the steps up to
        it are durable (a resume from it does not log them again).

        A checkpoint of this step may exist already: the one this run resumed from (nothing to save,
        but `latest` must name it), or one of a run that went on from an earlier checkpoint than this
        one did. That one is renamed aside (to a `*.tmp-*` name, which the next run removes if this
        one dies) and replaced; `latest` never names it meanwhile."""
        out_dir, ranks = self.out_dir, self.ranks
        assert ranks is not None
        name = checkpoint_name(engine.global_step)
        target = out_dir / name
        with naming_path(out_dir / METRICS):
            loggers.sync()
        if self.resumed_from is not None and target.resolve() == self.resumed_from.resolve():
            if ranks.rank == 0 and latest_checkpoint(out_dir) != name:
                point_latest(out_dir, name)
            return
        displaced: Optional[Path] = None
        if ranks.rank == 0 and os.path.lexists(target):
            if latest_checkpoint(out_dir) == name:
                self._point_latest_away_from(name)
            displaced = temporary_name(target)
            os.rename(target, displaced)
        ranks.barrier()
        extra = {
            "data": stream.state_dict(), "data_identity": self.data_identity, "model_identity": model_identity(self.cfg),
            **rng_state(engine.device),
            "first_loss": summary.first_loss,
        }
        self.saving = name
        with progress.phase(f"saving {target}", f"saved {name}"), naming_path(target):
            engine.save_checkpoint(target, extra=extra)
        self.saving = None
        if ranks.rank == 0:
            with naming_path(out_dir / LATEST):
                point_latest(out_dir, name)
            if displaced is not None:
                shutil.rmtree(displaced, ignore_errors=True)
            with naming_path(out_dir):
                deleted = prune_checkpoints(out_dir, self.cfg.train.keep_last)
            if deleted:
                progress.say(f"deleted {', '.join(deleted)} (train.keep_last = {self.cfg.train.keep_last})")
        summary.checkpoints.append(name)

    def _point_latest_back_to(self, resumed_step: int) -> None:
        """A run resumed from a checkpoint before the one `latest` names (going back to an earlier
        step): `latest` names the resumed checkpoint from now on, before the metrics of the steps after
        it are cut. It went on naming the later checkpoint until this run's first save, so a run killed
        before that was continued by --resume latest (and auto) from the checkpoint it had gone back
        from, with the metrics of the steps in between gone for good. Resumed from another directory,
        `latest` names none whatever its step: out_dir's checkpoints are not this run's history, and a
        run killed before its first save was continued by --resume auto from out_dir's own run; it names
        the resumed checkpoint's path instead, for --resume latest's refusal to name (point_latest_nowhere)."""
        latest = latest_checkpoint(self.out_dir)
        if self._resumed_elsewhere():
            point_latest_nowhere(self.out_dir, self.resumed_from)
        elif latest is not None and checkpoint_step(latest) > resumed_step:
            self._point_latest_away_from(latest)

    def _point_latest_away_from(self, name: str) -> None:
        """Before checkpoint `name` is replaced: `latest` names the checkpoint this run resumed from, if
        it is in out_dir, or nothing at all."""
        resumed = self.resumed_from
        if resumed is not None and resumed.resolve().parent == self.out_dir.resolve():
            point_latest(self.out_dir, resumed.name)
        else:
            point_latest_nowhere(self.out_dir, resumed)


_DAMAGE = re.compile(r"corrupted|truncated|cannot read|impossible shard record|is incomplete|has no \w+ for group")
"""What the runtime's CheckpointErrors say of a damaged checkpoint (they name the file, not the way on)."""


def _add_moved(moved: Dict[str, Dict[str, int]], stats: StepStats) -> int:
    """Add `stats`' bytes read and written per tier into the run's totals (tier name -> bytes); returns its NVMe bytes."""
    nvme_bytes = 0
    for key, table in (("read", stats.bytes_read), ("written", stats.bytes_written)):
        for tier, n in table.items():
            moved[key][tier.value] = moved[key].get(tier.value, 0) + n
            nvme_bytes += n if tier is Tier.NVME else 0
    return nvme_bytes


def _other_checkpoint(damaged: Path) -> str:
    """The way on from a damaged checkpoint: the newest other complete one beside it, or starting over."""
    others = [name for name in complete_checkpoints(damaged.parent) if name != damaged.name]
    if others:
        return f"resume from another checkpoint: --resume {others[-1]} (the newest other one in {damaged.parent})"
    return f"no other checkpoint is in {damaged.parent}: start over with --train.overwrite true"


def run(cfg: RunConfig, resume: Optional[str] = None, progress: bool = True) -> RunSummary:
    """Train as `cfg` says, from scratch or from a checkpoint; returns the run's summary (see Trainer)."""
    return Trainer(cfg, resume, progress).run()


def format_summary(summary: RunSummary) -> str:
    gib = 1 << 30
    train_s = max(summary.train_s, 1e-9)
    rate = f"{summary.tokens / train_s:,.0f} tokens/s"
    if summary.trained_tokens != summary.tokens:  # chat prompts run through the model but are not trained on
        rate += f", {summary.trained_tokens / train_s:,.0f} trained tokens/s"
    lines = [
        f"steps {summary.steps} in {summary.train_s:.1f} s of training "
        f"({rate}), {summary.wall_s:.1f} s in all "
        "(start-up, evals, saves and export included)",
        # A resumed run's first loss is the run's, from before the resume: said so, not as this process's first step.
        f"loss: first step{'' if summary.resumed_step is None else ' of the run'} {summary.first_loss:.4f}"
        + ("" if summary.resumed_step is None else f" (this process resumed it at step {summary.resumed_step})")
        + f", last step {summary.last_loss:.4f}; eval loss {summary.eval_loss:.4f}"
        + (f" (perplexity {perplexity(summary.eval_loss):,.2f})" if math.isfinite(summary.eval_loss) else ""),
        "time per phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary.phase_s.items()),
        "bytes read per tier: " + (", ".join(f"{k} {v / gib:.2f} GiB" for k, v in summary.bytes_read.items()) or "none"),
        "bytes written per tier: " + (", ".join(f"{k} {v / gib:.2f} GiB" for k, v in summary.bytes_written.items()) or "none"),
        "peak bytes per tier: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in summary.peak_bytes.items()),
        "checkpoints: " + (", ".join(summary.checkpoints) or "none"),
        "exported weights: " + (summary.export or "none"),
    ]
    if summary.nonfinite_steps:
        lines.append(f"non-finite steps skipped: {len(summary.nonfinite_steps)} ({_first_steps(summary.nonfinite_steps)})")
    if summary.overflow_steps:
        lines.append(
            f"fp16 overflow steps skipped: {len(summary.overflow_steps)} ({_first_steps(summary.overflow_steps)}; "
            "the loss scale halved at each)"
        )
    return "\n".join(lines)


def _first_steps(steps: List[int]) -> str:
    """'1, 3, 4': the first ten of `steps`, then '...'."""
    return ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")


def perplexity(loss: float) -> float:
    """exp(loss): the perplexity of a mean cross entropy in nats (inf past exp's range)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def summary_json(summary: RunSummary) -> Dict[str, Any]:
    """The summary as strict JSON values: a loss that is not finite (no eval over nothing held out) is None,
    as in metrics.jsonl; json.dumps wrote NaN, which jq and every strict reader refuse."""
    return json_values({**summary.__dict__, "eval_perplexity": perplexity(summary.eval_loss)})
