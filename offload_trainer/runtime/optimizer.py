"""StreamingOptimizer: AdamW or SGD over flat fp32 shards, group by group, IO pipelined.

The update itself is PyTorch's fused kernel (`torch._fused_adamw_`, `torch._fused_sgd_`), called
on per-parameter views of the flat shards: bitwise what `torch.optim.AdamW(fused=True)` (or
`SGD(fused=True)`) computes, since the kernel's vector/tail split is per tensor, and about as
fast as DeepSpeedCPUAdam on the CPU. One flat tensor per call would differ in the last bit.

States on NVMe stream through host staging slots: group k+1 is read while k is updated and k-1
written (io_engine handles complete in the background); a large group goes through in chunks
([Note: Chunked updates]). Clipping multiplies gradients by
min(1, max_norm / (norm + 1e-6)) where norm is the L2 norm of the per-parameter norms in
model.parameters() order, exactly as torch.nn.utils.clip_grad_norm_ does.

[Note: Batched per-group work]
A model cut into many small groups pays the optimizer's Python work once per group, so that work
is a handful of calls whatever the group's number of parameters: each flat state is cut into its
per-parameter views by one split_with_sizes (the sizes planned once per group; the views of
memory homes and staging buffers kept, those tensors being the same every step), the step
counts move by one add of a 0/1 vector, the unscale/clip multiply is one foreach call (as
clip_grad_norm_ does it), and the update one fused call per weight-decay value. Measured on the
CPU, 131 groups of a 128-layer dim-64 decoder, homes in host memory: 0.33 ms of CPU per group
before, 0.15 ms after.

[Note: Gradient patterns]
Which parameters of a group got a gradient can change every step (the experts of a
mixture-of-experts block, active in turn): nothing the update keeps may be one per pattern, and
nothing a new pattern needs may be copied to the device. A parameter without a gradient is
skipped and its count not moved, as torch.optim does: the counts move by one add of a 0/1
vector (x + 1 and x + 0 are exact in float32). That vector was made on the host and cached per
pattern: under CUDA each new pattern copied its vector to the device from pageable memory, a
copy that waits for the device, on the update thread, and the cache only grew (up to
2**num_params vectors per group, and as many _batches answers). Now it is made where the counts
are, by a zeros and a fill of each range of consecutive ones (kernels, no copy), and what the
update derives from a pattern (those ranges, the vectors, _batches' answers) is kept for the
group's last pattern only (_GradPattern): a model whose pattern is the same every step works it
out once, and pays one add per group and step, as before. Ruled out, by the process CPU time
of 2000 calls on the shared 2-core machine: a foreach add of 1 on the counts' views, about 4 us
per parameter (170 us for a group of 38, where the whole update of a small group costs about
150), and an add of 1 per range, about 12 us each (15 us a step for a dense group, against 4 for
the kept vector's add).

On NVMe a group's IO is batched too: _load reads every NVMe state kind the update needs (gradient,
moments, master, parameter shard) with ONE io_engine request (homes.start_reads ->
FileStore.pread_many, each kind into its own staging buffer, each chunk checked against its own
extent's checksums), and _store writes them back with ONE (StepStats.optimizer_nvme_requests
counts them: 2 per group, against one read and one write per kind before, 7 for fp32 all-NVMe).
The extents and the checkpoint format are unchanged. Measured on the shared 2-core machine (load
about 8), the 131-group decoder all on NVMe, process CPU of the update pass per group, 10 steps,
three runs of each in turn: 1.75, 2.66, 2.25 ms before, 1.68, 1.37, 1.55 ms after; wall times
there were too noisy to compare.

[Note: The parameter written first]
Of what an update writes back, the next forward reads only the parameter home (the scheduler's
load waits for it: OptimizerPipeline.wait_params); the master and the moments are read by the
next update pass only. So a group whose other NVMe states are large (PARAM_WRITE_FIRST_BYTES or
more) writes its parameter in a request of its own, issued before the request of the rest: the
next forward's load of it waits for its parameter bytes, not for all of the group's bytes (on
gpt2-124m, fp32 all on NVMe, the tied embedding's update writes 154 MB the forward needs and
308 MB of moments it does not). The rest goes in io_engine's background lane ([Note: Background
requests] in io_engine/engine.py), so that the forward's next parameter loads do not queue
behind it either. Smaller groups keep one write request, in the foreground (one more request
per group costs more than the wait it would save).

[Note: Chunked updates]
A group whose update stages a large shard (the tied embedding of gpt2-124m: 154 MB per state kind,
three kinds on NVMe) would need a staging buffer of its size per kind, three times over for the
pipeline, and the read-ahead would hold its 442 MiB through the forward and backward. So a group
whose fp32 shard is larger than optimizer.update_chunk_bytes (16 MiB) and whose update passes
through staging is updated in chunks, each a contiguous range [a, b) of its flat shard: every
staged kind's range is read into a chunk-sized buffer, updated and written back, as a group
would be, the chunks being the units of the read k+1 || update k || write k-1 pipeline (the last
chunk's parameter range runs to the end of the parameter home). The read-ahead reads a group's
first chunk only, and the staging pool is sized by chunks (MemoryPlan.update_cuts, which the
engine hands here, is where the plan and this class agree on the cuts). Two rules place the cuts
(layout/update_chunks.py): whole IO blocks from the shard's start, so that every NVMe read and
write stays whole checksum chunks (all bytes checked, O_DIRECT aligned); and inside a parameter
a multiple of 16 elements from its piece's start, since the CPU fused kernels work in 16-element
units from each tensor's start, so a parameter updated in parts is updated bitwise as a whole;
where no cut is allowed, the chunk grows. Exactness also needs: the step counts move once per
group, at its first chunk, and every chunk's fused call reads the same count (SGD's first-step
test is taken there too); the clipping multiplier and the got-gradient masks are the group's.
The pipeline is told about the group once, after its last chunk, with all its chunks' writes
(on_params_written with every chunk's parameter request, then on_written): a load of the group
waits for all of them. Smaller groups are one chunk, exactly as before. Gradients that pass
through staging are still collected whole (gradients.py), so they keep a buffer of their group's
size.

The update pass may run on OptimizerPipeline's worker thread (optimizer_pipeline.py): prepare()
runs on the training thread, update() on the worker, which then alone uses the staging buffers.
read_ahead() starts reading the first groups' states (all but gradients; a chunked group's first
chunk) for the next pass, whose update() then takes them over ([Note: Hiding the optimizer step]).
"""

from __future__ import annotations

import contextlib
import difflib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from io_engine import IOHandle, TransferError

from offload_trainer.runtime.device.pending import DONE, IOPending, Pending, all_of

from offload_trainer.runtime.collectives import Collectives
from offload_trainer.runtime.gradients import GradAccumulator
from offload_trainer.config import OptimizerConfig, OptimizerKind, Tier
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.buffer_pool import BufferPool
from offload_trainer.runtime.groups.homes import Home, start_reads, start_writes
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.layout.param_kind import ParamKind, param_kinds
from offload_trainer.runtime.layout.update_chunks import staged_numels
from offload_trainer.runtime.trace import Tracer


PARAM_WRITE_FIRST_BYTES = 1 << 20
"""The least bytes of a group's other NVMe states that make its update write the parameter in a
request of its own, first ([Note: The parameter written first])."""

def _on_host(norms: List[torch.Tensor]) -> List[torch.Tensor]:
    """The same norms, in order, in host memory: one copy off each device, not one per norm. Under
    CUDA each such copy waits for the device's compute: the step's one wait for it, then nothing
    left to wait for ([Note: Host waits in a step] in runtime/device/accelerator.py)."""
    out = list(norms)
    by_device: Dict[torch.device, List[int]] = {}
    for i, n in enumerate(norms):
        if n.device.type != "cpu":
            by_device.setdefault(n.device, []).append(i)
    for indices in by_device.values():
        moved = torch.stack([norms[i] for i in indices]).cpu()
        for j, i in enumerate(indices):
            out[i] = moved[j]
    return out


def weight_decay_of(kind: ParamKind, name: str, cfg: OptimizerConfig) -> float:
    """The weight decay of a parameter: none for biases, norms and other tensors of fewer than two
    dimensions, embeddings as optimizer.decay_embeddings says, none where a no_decay_patterns entry
    is in the name; cfg.weight_decay otherwise (layout/param_kind.py)."""
    if kind is ParamKind.NO_DECAY or (kind is ParamKind.EMBEDDING and not cfg.decay_embeddings):
        return 0.0
    lowered = name.lower()
    return 0.0 if any(p.lower() in lowered for p in cfg.no_decay_patterns) else cfg.weight_decay


def check_no_decay_patterns(names: Sequence[str], cfg: OptimizerConfig) -> None:
    """ValueError naming the first of optimizer.no_decay_patterns that is in none of `names` (the
    trainable parameters' names), and some of the names to choose from. A pattern with a typo, or one
    copied from another model's config ("LayerNorm.weight" for a model whose norms are "norm"), exempted
    nothing, and the parameters it was written for decayed without a word; PEFT refuses target_modules
    that match no module the same way, as the partition refuses grouping.module_classes."""
    lowered = [name.lower() for name in names]
    for pattern in cfg.no_decay_patterns:
        if not any(pattern.lower() in name for name in lowered):
            parts = sorted({part for name in names for part in name.split(".") if not part.isdigit()})
            close = difflib.get_close_matches(pattern.lower(), [p.lower() for p in parts], n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"optimizer.no_decay_patterns={list(cfg.no_decay_patterns)} holds {pattern!r}, which is in the name of "
                f"no trainable parameter{hint}; their names are made of {', '.join(parts[:12])}"
                f"{', ...' if len(parts) > 12 else ''}: correct it or remove it"
            )


def torch_param_groups(model: torch.nn.Module, cfg: OptimizerConfig) -> List[dict]:
    """The same split as the engine's, as param groups for a plain torch.optim optimizer (tests, references)."""
    kinds = param_kinds(model)
    groups: Dict[float, List[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(weight_decay_of(kinds[id(p)], name, cfg), []).append(p)
    return [{"params": params, "weight_decay": wd} for wd, params in groups.items()]


@dataclass
class PreparedStep:
    """What StreamingOptimizer.prepare decided for one step, for update() to apply."""

    norm: float
    """The global norm of the unscaled gradients (inf or nan when non-finite)."""
    skipped: bool
    """True when a gradient held inf or nan: nothing may be updated."""
    multiplier: Optional[torch.Tensor]
    """What every gradient is multiplied by first (unscale and clip); None for 1."""
    groups: List[ShardGroup]
    """The groups to update, in order (those with trainable elements on this rank)."""
    got: Dict[int, List[bool]]
    """Per group index, per parameter: whether it got a gradient this step."""
    compute: Pending = DONE
    """The compute issued before the step (accelerator.compute_done() in prepare): the backward that
    wrote the device gradient homes, and whatever may still read a device home the pass writes back.
    The pass's copies of device homes follow it, and only it: compute issued after the step reads a
    group's homes only once its update is written (OptimizerPipeline.wait_params, Home.writes), so
    waiting for all compute issued so far would tie each update to the next forward's progress on
    the device ([Note: Host waits in a step] in device/accelerator.py)."""


@dataclass
class _Loaded:
    """One group's tensors for an update: memory views, or staging slots being filled from NVMe."""

    group: ShardGroup
    tensors: Dict[str, torch.Tensor]
    reads: List[Pending] = field(default_factory=list)
    staged: Dict[str, torch.Tensor] = field(default_factory=dict)
    chunk: int = 0
    """Which of the group's update chunks these tensors are ([Note: Chunked updates])."""


@dataclass(frozen=True)
class _Chunk:
    """One update chunk of a group: elements [start, end) of its trainable shard, and how they split
    into the parts of its parameters' pieces ([Note: Batched per-group work])."""

    start: int
    end: int
    sizes: List[int]
    """split_with_sizes of [start, end): each piece's part and the gaps between them; a last -1
    (no tail) is dropped at split time."""
    position: Dict[int, int]
    """Per parameter index with a part in the chunk: its position in that split."""
    staged_numel: int
    """Elements of each of its staging buffers (update_chunks.staged_numels: the plan's size)."""


@dataclass
class _GradPattern:
    """What a group's update derives from which of its parameters got a gradient this step, kept
    for its last pattern only ([Note: Gradient patterns])."""

    got: Tuple[bool, ...]
    """Per parameter of the group: whether it got a gradient."""
    count_runs: List[Tuple[int, int]]
    """Ranges [a, b) of parameter indices whose step counts move: the parameters with a piece in
    this shard that got a gradient, consecutive ones in one range."""
    increments: Dict[torch.device, torch.Tensor] = field(default_factory=dict)
    """Per device where the group's counts are: 1 per parameter whose count moves, else 0."""
    batches: Dict[int, List[Tuple[float, List[int], List[int]]]] = field(default_factory=dict)
    """Per chunk, made at its first update: StreamingOptimizer._batches."""


class ParamTarget(Protocol):
    """Where an update pass copies a group's new parameter shard as it computes each chunk of it: a
    load's device slot, filled from the pass's staging buffers instead of read back from the NVMe
    home ([Note: The next forward's load from the update] in optimizer_pipeline.py)."""

    shard: torch.Tensor
    """This rank's shard of the group in the slot (the parameter home's size)."""
    after: Sequence[Pending]
    """What the slot's last users still do: every copy into it follows them."""

    def add(self, copy: Pending) -> None:
        """A chunk's copy into `shard`, issued."""

    def issued(self) -> None:
        """Every chunk's copy is issued (called once, after the last `add`)."""


@dataclass
class ReadAhead:
    """Optimizer states read for the next update pass before it starts (StreamingOptimizer.read_ahead);
    it holds their staging buffers until that pass takes it over (or drop() gives them back)."""

    loads: Dict[int, _Loaded] = field(default_factory=dict)
    """Per group index, in the pass's order: its homes but the gradient, being read into staging."""


class StreamingOptimizer:
    """The optimizer step over every group's shards, on whatever tiers they live."""

    def __init__(
        self,
        cfg: OptimizerConfig,
        groups: List[ShardGroup],
        tiers: MemoryTiers,
        staging: Optional[BufferPool],
        stats: StepStats,
        collectives: Collectives,
        gradients: GradAccumulator,
        tracer: Optional[Tracer] = None,
        update_cuts: Optional[Sequence[Tuple[int, ...]]] = None,
    ) -> None:
        """`gradients`: whose accumulated gradients (and per-parameter norms) each step applies.
        `update_cuts`: per group, the boundaries of its update chunks (MemoryPlan.update_cuts, which
        sized the staging pool for them; [Note: Chunked updates]); None: every group whole."""
        self.cfg = cfg
        self.gradients = gradients
        self.accel = tiers.accelerator
        self.tracer = tracer if tracer is not None else Tracer()
        self.collectives = collectives
        self.groups = groups
        self.tiers = tiers
        self.staging = staging
        self.param_write_first_bytes = PARAM_WRITE_FIRST_BYTES
        """A group whose other NVMe states to write are at least this many bytes writes its parameter
        first, in a request of its own ([Note: The parameter written first])."""
        self.reclaim_staging: Optional[Callable[[], bool]] = None
        """Gives back staging buffers held for later (the read-ahead), True if it did: tried by the
        global norm's reads on the training thread (_take_staging's `reclaim`) when no buffer of their
        size is free (set by the engine)."""
        self.stats = stats
        """The engine's running counts (the training thread's: prepare() counts its reads here)."""
        self._pass_stats = stats
        """Where the update pass in progress counts its bytes (update()'s `stats`)."""
        self._pass_compute: Pending = DONE
        """The compute the pass in progress follows (PreparedStep.compute); DONE outside a pass: the
        read-ahead reads states, which only the passes' own write-backs write (Home.writes)."""
        self.steps = {g.index: torch.zeros(len(g.plan.params), dtype=torch.float32) for g in groups}
        """Per group, per parameter: updates applied so far (a parameter without a gradient is skipped)."""
        self._device_steps: Dict[int, torch.Tensor] = {}
        """Per group updated on a device that is not the host's: its `steps` kept there too ([Note:
        Step counts on the device])."""
        self.weight_decay = {g.index: [weight_decay_of(s.kind, s.name, cfg) for s in g.plan.params] for g in groups}
        self._num_model_params = 1 + max((s.index for g in groups for s in g.plan.params), default=-1)
        self._writes: List[Tuple[List[IOHandle], List[torch.Tensor], List[Pending]]] = []
        """NVMe writes in flight, oldest first: the handles of one _start_writes (one per swap file),
        the staging buffers they free once all are done, and what else still reads those buffers (a
        parameter's copy into a load's device slot: [Note: The next forward's load from the update])."""
        self._chunks: Dict[int, List[_Chunk]] = {}
        """Per group: its update chunks, in order (one, the whole shard, for most groups)."""
        self._counting: Optional[Tuple[torch.Tensor, List[bool]]] = None
        """While a group's chunks are updated: its step counts where the weights are, and per
        parameter whether it had no update before this one (SGD's first step), both taken at its
        first chunk, so that every chunk of a parameter sees the same count."""
        self._patterns: Dict[int, _GradPattern] = {}
        """Per group: what its update derives from its last gradient pattern ([Note: Gradient patterns])."""
        self._views: Dict[tuple, Sequence[torch.Tensor]] = {}
        """Per group, state kind and flat tensor (a memory home, a staging buffer): its split."""
        for g in groups:
            cuts = update_cuts[g.index] if update_cuts is not None else ()
            self._plan_chunks(g, cuts if len(cuts) > 2 else (0, g.local_trainable_numel))

    # -- the step ------------------------------------------------------------------------------

    def prepare(
        self, order: Sequence[int], inv_loss_scale: float = 1.0, failed: Optional[BaseException] = None
    ) -> "PreparedStep":
        """The part of a step that needs every gradient final: the global norm (a collective on
        several ranks) and the multiplier (unscale, clip). Runs on the training thread. `failed`: the
        error this rank met on its way here, which the norm's all-reduce tells every rank, each then
        raising ([Note: A step that failed on one rank] in collectives.py); so does an error in the
        norm's own reads.

        A step whose gradients hold inf or nan (norm not finite) is marked skipped and must change
        nothing, so no parameter or optimizer state ever becomes non-finite through an update.
        (fp16's loss scaler then lowers its scale; in fp32/bf16 the caller decides whether to go
        on, see StepStats.nonfinite.)"""
        groups = [self.groups[i] for i in order if self.groups[i].local_trainable_numel > 0]
        multiplier: Optional[torch.Tensor] = None
        total_t = self._global_norm(self.gradients.norms, failed)
        if not bool(torch.isfinite(total_t)):
            norm = float(total_t) if inv_loss_scale == 1.0 else float("inf")
            return PreparedStep(norm, True, None, [], {})
        if inv_loss_scale != 1.0:
            total_t = total_t * inv_loss_scale
            multiplier = torch.tensor(inv_loss_scale, dtype=torch.float32)
        if self.cfg.grad_clip_norm is not None:
            # As torch.nn.utils.clip_grad_norm_: one multiply by min(1, max_norm / (norm + 1e-6)).
            clip = torch.clamp(self.cfg.grad_clip_norm / (total_t + 1e-6), max=1.0)
            multiplier = clip if multiplier is None else clip * multiplier
        # Copied now: the gradient accumulator forgets this step's bookkeeping before the updates run.
        got = {g.index: list(self.gradients.got_grad(g)) for g in groups}
        return PreparedStep(float(total_t), False, multiplier, groups, got, self.accel.compute_done())

    def update(
        self,
        prepared: "PreparedStep",
        lrs: Dict[float, Tuple[float, float]],
        stats: StepStats,
        on_written: Optional[Callable[[ShardGroup, List[Pending]], None]] = None,
        ahead: Optional["ReadAhead"] = None,
        on_params_written: Optional[Callable[[ShardGroup, List[Pending]], None]] = None,
        fill_for: Optional[Callable[[ShardGroup], Optional[ParamTarget]]] = None,
    ) -> None:
        """Update every group of `prepared`, in its order: read states (k+1) || update (k) || write
        (k-1). `lrs`: per weight decay the config gives a set of parameters (their key), the
        learning rate and weight decay to apply (LearningRates.by_weight_decay). `stats`: where this pass counts
        its bytes (it may run on a worker thread: the caller owns that object while it runs).
        `on_written(group, writes)`: called once a group is updated, with what its homes still
        wait for (NVMe writes in flight); the group's homes hold the new values once those are
        done. Before it, `on_params_written(group, param_writes)` for a group that writes its
        parameter home in a request of its own ([Note: The parameter written first]): that home
        holds the new values once `param_writes` are done, whatever `writes` are.
        `ahead`: the states read_ahead() started reading before this pass; it owns them now.
        `fill_for(group)`: asked once per group whose parameter home is on NVMe, before its first
        chunk is stored: where to copy its new parameter shard as well (a load waiting for it), or
        None. A group updated in chunks runs its chunks through the same pipeline, each as a group would
        be, and is reported once, after its last chunk, with all its chunks' writes ([Note:
        Chunked updates])."""
        self._pass_stats = stats
        self._pass_compute = prepared.compute
        groups = prepared.groups
        early = self._claim(ahead, groups)
        units = [(group, chunk) for group in groups for chunk in range(len(self._chunks[group.index]))]
        loads: List[_Loaded] = []
        try:
            self._update_units(units, early, loads, lrs, prepared, stats, on_written, on_params_written, fill_for)
        except BaseException:
            # No write of this pass may still be in flight once the failure is raised: the next step,
            # or a checkpoint loaded over the homes, writes them again ([Note: A failed write is
            # drained with the rest]). Their own failures are the same disk's: the first one is raised.
            # The loads not stored yet give their staging buffers back too ([Note: A failed pass
            # gives its reads' buffers back]).
            for loaded in [*loads, *early.values()]:
                self._abandon(loaded)
            with contextlib.suppress(TransferError):
                self._drain()
            raise
        self._pass_compute = DONE

    def _update_units(
        self,
        units: List[Tuple[ShardGroup, int]],
        early: Any,
        loads: "List[_Loaded]",
        lrs: Dict[float, Tuple[float, float]],
        prepared: "PreparedStep",
        stats: StepStats,
        on_written: Optional[Callable[[ShardGroup, List[Pending]], None]],
        on_params_written: Optional[Callable[[ShardGroup, List[Pending]], None]],
        fill_for: Optional[Callable[[ShardGroup], Optional[ParamTarget]]],
    ) -> None:
        """update()'s pipeline over `units` (each group's chunks): read (k+1) || update (k) || write (k-1).
        `loads` (empty, the caller's): the loads started and not stored yet, whose staging buffers the
        caller gives back if this raises."""
        if units:
            loads.append(self._load_for_update(*units[0], early))
        param_writes: List[Pending] = []
        writes: List[Pending] = []
        target: Optional[ParamTarget] = None
        for k, (group, chunk) in enumerate(units):
            if k + 1 < len(units):
                loads.append(self._load_for_update(*units[k + 1], early))
            loaded = loads[0]  # listed until stored: a failure before gives its buffers back
            wait_start = time.perf_counter()
            self._wait_reads(loaded)
            stats.optimizer_read_wait_s += time.perf_counter() - wait_start
            traced = self.tracer.active
            update_start = self.tracer.now() if traced else 0.0
            self._update(loaded, lrs, prepared.multiplier, prepared.got[group.index])
            last = chunk == len(self._chunks[group.index]) - 1
            if traced:
                name = group.plan.name if last and chunk == 0 else f"{group.plan.name} chunk {chunk}"
                self.tracer.span("optimizer", f"update {name}", update_start, self.tracer.now())
            tell = None
            if on_params_written is not None and last:
                # Told once, with every chunk's parameter write, before the last chunk's other states go.
                def tell(own: List[Pending], group: ShardGroup = group) -> None:
                    on_params_written(group, param_writes + own)  # type: ignore[misc]

            if chunk == 0:
                target = None
                if fill_for is not None and group.param_home.tier is Tier.NVME:
                    target = fill_for(group)
            own, rest = self._store(loaded, tell, target, last)
            loads.pop(0)
            if on_params_written is None:
                writes += own
            else:
                param_writes += own
            writes += rest
            if last:
                if on_written is not None:
                    on_written(group, writes)
                param_writes, writes = [], []
        self._drain()

    def read_ahead(
        self, order: Sequence[int], max_groups: int, reserve_buffers: int, stats: StepStats
    ) -> "ReadAhead":
        """Start reading the optimizer states of the first groups of `order` (the next update pass's),
        all but their gradients, which the next backward has still to make. At most `max_groups`
        groups, and only while `reserve_buffers` host staging buffers stay free for what else takes
        them before that pass (the gradients, the global norm). By whoever owns the staging
        buffers: the update pass's thread, once its own writes have landed. A state home changes
        only in an update pass, so it can be read as soon as the last pass wrote it, long before the
        next norm is known ([Note: Hiding the optimizer step]). `stats`: where the reads count."""
        ahead = ReadAhead()
        if self.staging is None or max_groups <= 0:
            return ahead
        self._pass_stats = stats
        for gi in order:
            group = self.groups[gi]
            if len(ahead.loads) >= max_groups or group.local_trainable_numel == 0:
                continue
            names = self._state_names(group)
            need = self._staged_kinds(group, names)
            if need == 0:
                continue  # nothing to read: its states are where the update runs
            if self.staging.num_free - need < reserve_buffers:
                break  # in order: a later group never goes ahead of an earlier one
            before = self._state_bytes_read()
            try:
                ahead.loads[gi] = self._load(group, 0, names)  # a group updated in chunks: its first
            except BaseException:
                for loaded in ahead.loads.values():  # the reads ahead started before it
                    self._abandon(loaded)
                raise
            stats.optimizer_bytes_read_ahead += self._state_bytes_read() - before
            stats.optimizer_groups_read_ahead += 1
        return ahead

    def drop(self, ahead: "ReadAhead") -> None:
        """Wait for the reads of loads no pass will use (new weights were loaded, the engine closes)
        and give their staging buffers back."""
        for loaded in ahead.loads.values():
            self._release(loaded)
        ahead.loads = {}

    def _state_bytes_read(self) -> int:
        return self._pass_stats.bytes_read.get(Tier.NVME, 0) + self._pass_stats.d2h_bytes

    def _state_names(self, group: ShardGroup) -> List[str]:
        """The group's homes an update reads that do not depend on this step's gradients."""
        return [name for name in self._homes(group) if name != "grad"]

    def _staged_kinds(self, group: ShardGroup, names: Sequence[str]) -> int:
        """How many of the group's homes in `names` pass through host staging for an update (at most
        one staging buffer each)."""
        homes = self._homes(group)
        on_device = self._updates_on_device(group)
        return sum(
            1 for name in names if homes[name].tier is Tier.NVME or (homes[name].crosses(self.tiers) and not on_device)
        )

    def _release(self, loaded: _Loaded) -> None:
        self._wait_reads(loaded)
        assert self.staging is not None
        for buf in loaded.staged.values():
            self.staging.give(buf)
        loaded.staged = {}

    def _abandon(self, loaded: _Loaded) -> None:
        """Give back the staging buffers of a load a failed pass will not store, once its reads are
        over, failed or not (their errors are the pass's, raised already or about to be).

        [Note: A failed pass gives its reads' buffers back]
        A pass that fails (a read's EIO, a checksum that does not match, a failed write found when
        a buffer was needed) holds the buffers of the loads it started and had not stored: the
        chunk being updated, the one read ahead of it, and the states read ahead for its first
        groups. They went with the failure: 6 of 15 on the tiny decoder after one failed read,
        6 more after each pass after it, until "all 15 host staging buffers are busy" for good,
        a checkpoint loaded or not. Each buffer leaves the load as it goes to a write request
        (_store), so none is given back twice."""
        for pending in loaded.reads:
            with contextlib.suppress(Exception):
                self.accel.host_waits(pending, "optimizer read")
        loaded.reads = []
        assert self.staging is not None or not loaded.staged
        for buf in loaded.staged.values():
            self.staging.give(buf)  # type: ignore[union-attr]
        loaded.staged = {}

    def _claim(self, ahead: Optional["ReadAhead"], groups: Sequence[ShardGroup]) -> Dict[int, _Loaded]:
        """The loads read ahead for this pass's first groups; those read ahead for any other group
        (the recorded order changed since the pass that read them) are dropped first, so that the
        pass never holds more staging buffers than the read-ahead and its own one-group-ahead reads."""
        if ahead is None or not ahead.loads:
            return {}
        early, ahead.loads = ahead.loads, {}
        kept: Dict[int, _Loaded] = {}
        for group in groups:
            if group.index in early:
                kept[group.index] = early.pop(group.index)
            elif self._staged_kinds(group, self._state_names(group)):
                break  # read_ahead stopped before this group: any read ahead after it is out of order
        for loaded in early.values():
            self._release(loaded)
        return kept

    def _load_for_update(self, group: ShardGroup, chunk: int, early: Dict[int, _Loaded]) -> _Loaded:
        """The group's homes for the update of one chunk: the gradient added to what was read ahead
        (the first chunk's), or all of them."""
        loaded = early.get(group.index) if chunk == 0 else None
        if loaded is None:
            return self._load(group, chunk)
        rest = self._load(group, chunk, ["grad"])
        del early[group.index]  # not before: a failed load of the gradient leaves it to be given back
        loaded.tensors.update(rest.tensors)
        loaded.reads += rest.reads
        loaded.staged.update(rest.staged)
        return loaded

    def _global_norm(self, norms: Dict[int, torch.Tensor], failed: Optional[BaseException] = None) -> torch.Tensor:
        """L2 norm of all gradients: on one rank exactly clip_grad_norm_'s (the norm of per-parameter
        norms, in parameter order); on several, the root of the all-reduced sum of squares, whose
        all-reduce is the step's agreement (`failed`, or an error reading the gradient homes here)."""
        per_param: Dict[int, torch.Tensor] = {}
        if failed is None:
            try:
                per_param = self._local_norms(norms)
            except BaseException as error:  # noqa: B902 - raised on every rank by the agreement
                if self.collectives.world_size == 1:
                    raise
                failed = error
        if self.collectives.world_size == 1:
            if not per_param:
                return torch.zeros(())
            norms_list = [per_param[k] for k in sorted(per_param)]
            # Where clip_grad_norm_ takes it: on the gradients' device when they share one (one
            # transfer of the result, not one per parameter), else on the host.
            if len({n.device for n in norms_list}) > 1:
                norms_list = _on_host(norms_list)
            return torch.linalg.vector_norm(torch.stack(norms_list), 2).cpu()
        on_host = _on_host(list(per_param.values()))
        zero = torch.zeros((), dtype=torch.float64)
        sum_sq = torch.stack([n.double() ** 2 for n in on_host]).sum() if on_host else zero
        # One all-reduce: the sum of squares, and per parameter how many ranks gave it a gradient
        # (a parameter no rank's backward reached is then skipped, as on one rank).
        got = self.gradients.local_got(self._num_model_params)
        both = torch.cat([sum_sq.reshape(1), got if failed is None else torch.zeros_like(got)])
        self.collectives.all_reduce_sum_agreed(both, failed)
        self.gradients.agree_got(both[1:])
        return both[0].sqrt().float()

    def _local_norms(self, norms: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """Per model parameter with a gradient here: its gradient's norm (this rank's shard of it), those
        `norms` lacks read from the gradient homes."""
        per_param: Dict[int, torch.Tensor] = dict(norms)
        for group in self.groups:
            got = self.gradients.got_grad(group)
            missing = [p for p in group.pieces if got[p.param] and group.plan.params[p.param].index not in per_param]
            if not missing:
                continue
            if group.grad_home is not None and group.grad_home.lent:  # its pieces are whole parameters
                pieces = group.grad_home.pieces
                assert pieces is not None
                for p in missing:
                    layout = group.plan.params[p.param]
                    per_param[layout.index] = torch.linalg.vector_norm(layout.flatten(pieces[p.param]), 2)
                continue
            grad = self._read_home(group.grad_home)
            for p in missing:
                view = grad[p.shard_offset : p.shard_offset + p.numel]
                per_param[group.plan.params[p.param].index] = torch.linalg.vector_norm(view, 2)
            self._release_staging(group.grad_home, grad)
        return per_param

    def _read_home(self, home: Optional[Home]) -> torch.Tensor:
        """The whole home in host memory (NVMe and device homes through a staging buffer), blocking."""
        assert home is not None
        if home.tier is Tier.NVME or home.crosses(self.tiers):
            buf = self._take_staging(home.numel, home.dtype, reclaim=True)
            if home.tier is not Tier.NVME:
                home.read(self.tiers, buf)
            else:
                handle = None
                try:
                    handle = home.start_read(self.tiers, buf)
                    assert handle is not None
                    handle.wait()
                except BaseException:
                    # Failed, or a Ctrl-C in the wait (the global norm's read of a gradient home, in
                    # step()): the buffer goes back, written again once the read is over. Before, it
                    # was lost, one fewer for every later step.
                    assert self.staging is not None
                    self.staging.give(buf, [IOPending(handle)] if handle is not None else [])
                    raise
            self.stats.add_bytes(self.stats.bytes_read, home.tier, home.nbytes)
            return buf
        assert home.tensor is not None
        return home.tensor

    def _release_staging(self, home: Optional[Home], buf: torch.Tensor) -> None:
        if home is not None and (home.tier is Tier.NVME or home.crosses(self.tiers)):
            assert self.staging is not None
            self.staging.give(buf)

    # -- pipeline stages -----------------------------------------------------------------------

    def _take_staging(self, numel: int, dtype: torch.dtype, reclaim: bool = False) -> torch.Tensor:
        """A staging buffer of numel's size class, waiting for this pass's oldest writes to free one;
        with `reclaim` (the training thread's reads, never the update pass's), also dropping what
        the read-ahead holds (reclaim_staging)."""
        assert self.staging is not None, "NVMe optimizer state needs host staging slots"
        while True:
            buf = self.staging.try_take_as(numel, dtype)  # from numel's size class only
            if buf is not None:
                return buf
            if not self._writes:
                if reclaim and self.reclaim_staging is not None and self.reclaim_staging():
                    continue
                raise RuntimeError(
                    f"all {self.staging.num_buffers} host staging buffers are busy; raise tiers.host_budget_bytes"
                )
            self._retire_oldest()

    def _take_unit(self, staged_numel: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """`numel` elements of `dtype` at the start of a staging buffer of `staged_numel` fp32
        elements' size class (see _take_staging)."""
        buf = self._take_staging(staged_numel, torch.float32)
        return buf.view(torch.uint8)[: numel * dtype.itemsize].view(dtype)

    def _homes(self, group: ShardGroup) -> Dict[str, Home]:
        homes = {"param": group.param_home, "grad": group.grad_home}
        homes.update(group.optimizer_homes)
        return homes  # type: ignore[return-value]

    def _updates_on_device(self, group: ShardGroup) -> bool:
        """Whether the group's update runs where its state is, on the device: every state kind homed
        there (else it runs on the host, its device homes copied off and back on the copy path)."""
        return all(home.tier is Tier.DEVICE for home in self._homes(group).values())

    def _load(self, group: ShardGroup, chunk: int = 0, names: Optional[Sequence[str]] = None) -> _Loaded:
        """Start loading the range of update chunk `chunk` of the group's homes (those in `names`, or
        all); the last chunk's parameter range runs to the end of the parameter home."""
        loaded = _Loaded(group, {}, chunk=chunk)
        try:
            self._start_load(loaded, names)
        except BaseException:
            self._abandon(loaded)  # the buffers it took before the failure
            raise
        return loaded

    def _start_load(self, loaded: _Loaded, names: Optional[Sequence[str]]) -> None:
        """_load's work, into `loaded` as it goes."""
        group, chunk = loaded.group, loaded.chunk
        plan = self._chunks[group.index][chunk]
        a, b = plan.start, plan.end
        last = chunk == len(self._chunks[group.index]) - 1
        # Every staged kind of a chunk takes a buffer of one size, the one the plan's staging
        # classes were sized by (MemoryPlan.update_cuts), so that they all come from its class.
        staged_numel = plan.staged_numel
        on_device = self._updates_on_device(group)
        nvme_reads: List[Tuple[Home, torch.Tensor, int]] = []
        for name, home in self._homes(group).items():
            if names is not None and name not in names:
                continue
            # With a master copy the parameter home is only written (the master's rounding).
            write_only = name == "param" and "master" in group.optimizer_homes
            if home.tier is Tier.NVME:
                # Whole IO blocks move (every cut is a multiple of one), so that every chunk's
                # checksum is recorded on the way out: the parameter shard's tail (frozen
                # parameters, padding) is read too when it holds anything, else written as the
                # zeros it is.
                end = home.numel if last else b
                buf = self._take_unit(staged_numel, home.dtype, end - a)
                loaded.staged[name] = buf
                if not write_only or (name == "param" and last and group.plan.trainable_numel < group.plan.used_numel):
                    nvme_reads.append((home, buf, a))
                    self._pass_stats.add_bytes(self._pass_stats.bytes_read, Tier.NVME, buf.numel() * buf.element_size())
                else:
                    buf[b - a :].zero_()
                loaded.tensors[name] = buf[: b - a]
            elif home.crosses(self.tiers) and not on_device:
                buf = self._take_unit(staged_numel, home.dtype, b - a)
                loaded.staged[name] = buf
                if not write_only:
                    assert home.tensor is not None
                    copy = self.accel.d2h(buf, home.tensor[a:b], home.writes, written_by=self._pass_compute)
                    self.tracer.io("optimizer io", f"copy {group.plan.name} {name} off the device", copy)
                    loaded.reads.append(copy)
                    self._pass_stats.d2h_bytes += buf.numel() * buf.element_size()
                loaded.tensors[name] = buf
            else:
                if home.lent:
                    continue  # a gradient lent per parameter: `split` takes its pieces ([Note: Gradient homes lent from the heap])
                if home.writes:
                    self.accel.compute_waits(all_of(home.writes), "home write")
                loaded.tensors[name] = home.tensor[a:b]
        if nvme_reads:
            # Every NVMe state kind of the chunk in one request ([Note: Batched per-group work]).
            for handle in start_reads(self.tiers, nvme_reads):
                self.tracer.io("optimizer io", f"read {group.plan.name}", handle)
                loaded.reads.append(IOPending(handle))
                self._pass_stats.optimizer_nvme_requests += 1

    def _wait_reads(self, loaded: _Loaded) -> None:
        for pending in loaded.reads:
            self.accel.host_waits(pending, "optimizer read")
        loaded.reads = []

    def _store(
        self,
        loaded: _Loaded,
        tell: Optional[Callable[[List[Pending]], None]] = None,
        target: Optional[ParamTarget] = None,
        last: bool = True,
    ) -> Tuple[List[Pending], List[Pending]]:
        """Start writing the chunk's staged states back at its range of their homes; returns the
        NVMe writes in flight: the parameter's request where it goes first, in a request of its own
        ([Note: The parameter written first]), and the others. Where it does, `tell` is given the
        former before the others are issued. `target`: where the new parameter chunk is copied too,
        before any write is issued (`last`: the group's last chunk, after which it is told so)."""
        group = loaded.group
        homes = self._homes(group)
        a = self._chunks[group.index][loaded.chunk].start
        nvme_writes: List[Tuple[Home, torch.Tensor, int]] = []
        names: List[str] = []
        readers: List[Pending] = []
        # A buffer leaves loaded.staged as it goes back or to a write request, which then gives it back.
        for name, buf in list(loaded.staged.items()):
            home = homes[name]
            assert self.staging is not None
            if name == "grad":
                del loaded.staged[name]
                self.staging.give(buf)
                continue
            if home.tier is Tier.NVME:
                nvme_writes.append((home, buf, a))
                names.append(name)
                self._pass_stats.add_bytes(self._pass_stats.bytes_written, Tier.NVME, buf.numel() * buf.element_size())
                if name == "param" and target is not None:
                    # The bytes the write puts in the home, into the load's slot: the buffer goes back
                    # to the pool once both have read it.
                    assert a + buf.numel() <= target.shard.numel(), (group.plan.name, a, buf.numel())
                    copy = self.accel.h2d(target.shard[a : a + buf.numel()], buf, target.after)
                    self.tracer.io("optimizer io", f"copy {group.plan.name} param to its load", copy)
                    target.add(copy)
                    readers.append(copy)
                    if last:
                        target.issued()
                continue
            # A device home updated on the host: copied back once; its next readers wait for it
            # (for every chunk's copy, once the group's chunks have all been written). The copy
            # follows the compute before the step, which may still read the home under CUDA (a
            # parameter home nothing copied off first, being written only, from the master).
            assert home.tensor is not None
            copy = self.accel.h2d(home.tensor[a : a + buf.numel()], buf, [self._pass_compute])
            self.tracer.io("optimizer io", f"copy {group.plan.name} {name} to the device", copy)
            self._pass_stats.h2d_bytes += buf.numel() * buf.element_size()
            home.writes = [copy] if loaded.chunk == 0 else home.writes + [copy]
            del loaded.staged[name]
            self.staging.give(buf, [copy])
        if not nvme_writes:
            return [], []

        def write(chosen: List[str], background: bool = False) -> List[Pending]:
            moves = [m for m, n in zip(nvme_writes, names) if n in chosen]
            pending = self._start_writes(group, moves, background, readers if "param" in chosen else ())
            for name in chosen:
                del loaded.staged[name]
            return pending

        # One request for all of them, as the reads ([Note: Batched per-group work]), unless the
        # group's other states are large enough that the next forward should not wait for them
        # (decided per group, so that all its chunks do the same): then the parameter goes
        # first, in a request of its own.
        param = [name for name in names if name == "param"]
        states = [name for name in names if name != "param"]
        if not param or not states or self._other_state_bytes(group) < self.param_write_first_bytes:
            return [], write(names)
        param_writes = write(param)
        if tell is not None:
            tell(param_writes)
        return param_writes, write(states, background=True)

    def _other_state_bytes(self, group: ShardGroup) -> int:
        """Bytes of the group's NVMe homes an update writes, but the parameter's."""
        return sum(
            home.nbytes for name, home in self._homes(group).items()
            if name not in ("param", "grad") and home.tier is Tier.NVME
        )

    def _start_writes(
        self,
        group: ShardGroup,
        moves: List[Tuple[Home, torch.Tensor, int]],
        background: bool = False,
        readers: Sequence[Pending] = (),
    ) -> List[Pending]:
        """Start one write request (per swap file) of `moves`; their staging buffers go back to the
        pool once it is done, and `readers` (other work reading them). `background`: behind the IO
        that compute waits for."""
        handles = start_writes(self.tiers, moves, background)
        for handle in handles:
            self.tracer.io("optimizer io", f"write {group.plan.name}", handle)
        self._pass_stats.optimizer_nvme_requests += len(handles)
        # The buffers go back once every request is done (each request holds some of them).
        self._writes.append((handles, [buf for _, buf, _ in moves], list(readers)))
        return [IOPending(handle) for handle in handles]

    def _drain(self) -> None:
        """Wait for every write _start_writes started (_retire_oldest each); then raise the first that
        failed, if any (TransferError, its path, offset and size).

        [Note: A failed write is drained with the rest]
        A request that failed is over: its buffers go back and it leaves the list like any other, and
        the writes after it are waited for all the same. Before, the first failure ended the drain: the
        failed write stayed listed, so every later pass raised the same error again, the buffers of it
        and of the writes after it never went back to the pool, and those writes could still be in
        flight when a checkpoint was loaded over their homes. What a failed write leaves in its swap
        extent is refused to every read until written again (io_engine's LostWriteError). Anything
        else (a Ctrl-C in the wait) leaves the write listed, for the next drain."""
        failure: Optional[TransferError] = None
        while self._writes:
            try:
                self._retire_oldest()
            except TransferError as error:
                failure = failure or error
        if failure is not None:
            raise failure

    def _retire_oldest(self) -> None:
        """Wait for the oldest write _start_writes started, give its staging buffers back and take it off
        the list, a failed one too (its TransferError raised after: [Note: A failed write is drained
        with the rest])."""
        assert self.staging is not None
        handles, bufs, readers = self._writes[0]
        failure: Optional[TransferError] = None
        for handle in handles:
            try:
                handle.wait()
            except TransferError as error:
                failure = failure or error
        del self._writes[0]
        for buf in bufs:
            self.staging.give(buf, readers)
        if failure is not None:
            raise failure

    # -- the arithmetic ------------------------------------------------------------------------

    def _update(
        self, loaded: _Loaded, lrs: Dict[float, Tuple[float, float]], multiplier: Optional[torch.Tensor], got: List[bool]
    ) -> None:
        """One chunk's update (of most groups, the whole group's): a handful of calls whatever its
        number of parameters ([Note: Batched per-group work]). Per-parameter views come from one
        split per state; the step counts, the unscale/clip multiply and the update itself are one
        foreach or fused call per weight-decay value. A group's step counts move once, at its
        first chunk, and every chunk's fused call reads them ([Note: Chunked updates])."""
        group = loaded.group
        t = loaded.tensors
        chunks = self._chunks[group.index]
        plan = chunks[loaded.chunk]
        steps = self.steps[group.index]
        weights = t.get("master", t["param"])
        if loaded.chunk == 0:
            # SGD's momentum buffers start as a copy of the gradient on a parameter's first update.
            fresh = (steps == 0).tolist() if self.cfg.kind is OptimizerKind.SGD else []
            # Every parameter that got a gradient counts one more update; the others keep theirs.
            self._count_update(steps, group, got)
            apart = not self.accel.is_host and self._updates_on_device(group)
            counts = self._counts_on(group, weights.device, got) if apart else steps
            self._counting = (counts, fresh)
        assert self._counting is not None
        counts, fresh = self._counting
        self._update_chunk(loaded, plan, lrs, multiplier, got, counts, fresh)
        if "master" in t:
            t["param"][: plan.end - plan.start].copy_(t["master"])
        if loaded.chunk == len(chunks) - 1:
            self._counting = None

    def _counts_on(self, group: ShardGroup, device: torch.device, got: List[bool]) -> torch.Tensor:
        """The step counts of a group updated on an accelerator's device (the fused kernels want them
        where the weights are), already counting this update (`steps` does).

        [Note: Step counts on the device]
        A group updated on a GPU keeps a copy of its counts there, made once and moved by the same
        0/1 vector as the host's, made there ([Note: Gradient patterns]; exact in float32 either
        way), so that a steady-state update copies no count across: `steps.to(device)` before the
        kernel and `steps.copy_(counts)` after it were each a copy between pageable host memory
        and the device, which waits for the device's stream, on the update thread, once per group
        and step; the next forward's loads wait for that thread, so its run-ahead of the GPU was
        one group. `self.steps` stays on the host for checkpoints and SGD's first-update test;
        load_state_dict drops the copies."""
        counts = self._device_steps.get(group.index)
        if counts is None:  # a copy even where the device's memory is the host's (the simulated accelerator)
            counts = self._device_steps[group.index] = self.steps[group.index].to(device, copy=True)
            return counts
        self._count_update(counts, group, got)
        return counts

    def _update_chunk(
        self,
        loaded: _Loaded,
        plan: _Chunk,
        lrs: Dict[float, Tuple[float, float]],
        multiplier: Optional[torch.Tensor],
        got: List[bool],
        counts: torch.Tensor,
        fresh: List[bool],
    ) -> None:
        """The fused calls of one chunk, on its parts of its parameters' pieces."""
        group = loaded.group
        t = loaded.tensors
        batches = self._batches(group, loaded.chunk, got)
        if not batches:
            return
        sizes = plan.sizes[:-1] if plan.sizes[-1] < 0 else plan.sizes

        def split(name: str) -> Sequence[torch.Tensor]:
            # Memory homes are the same tensors every step, staging buffers a few: their views are kept.
            # A lent gradient home is per parameter and new each step: its pieces' parts of the chunk, at
            # their positions (a parameter without a gradient has none, and no batch reads it).
            home = group.grad_home
            if name == "grad" and home is not None and home.lent:
                parts: List[Any] = [None] * len(sizes)
                for piece in group.pieces:
                    pos = plan.position.get(piece.param)
                    lent = None if pos is None or home.pieces is None else home.pieces[piece.param]
                    if lent is not None:
                        lo = max(plan.start, piece.shard_offset) - piece.shard_offset
                        parts[pos] = group.plan.params[piece.param].flatten(lent)[lo : lo + sizes[pos]]
                return parts
            flat = t[name]
            key = (group.index, loaded.chunk, name, flat.data_ptr(), flat.numel(), flat.dtype, flat.device)
            views = self._views.get(key)
            if views is None:
                views = self._views[key] = flat.split_with_sizes(sizes)
            return views

        grads = split("grad")
        if multiplier is not None:
            # As clip_grad_norm_ does it: one foreach multiply (elementwise, so bitwise a mul_ each).
            # `multiplier` is a CPU 0-dim tensor (prepare's); for a group updated on the GPU torch
            # reads it with .item() of host memory and runs its scalar kernel: no device wait.
            torch._foreach_mul_([grads[k] for _, pos, _ in batches for k in pos], multiplier)
        cfg = self.cfg
        if cfg.kind is OptimizerKind.ADAMW:
            w, m, v = split("master" if "master" in t else "param"), split("exp_avg"), split("exp_avg_sq")
            step_views = counts.unbind(0)
            for wd, pos, idx in batches:
                lr, decay = lrs[wd]
                torch._fused_adamw_(
                    [w[k] for k in pos],
                    [grads[k] for k in pos],
                    [m[k] for k in pos],
                    [v[k] for k in pos],
                    [],
                    [step_views[i] for i in idx],
                    lr=lr,
                    beta1=cfg.betas[0],
                    beta2=cfg.betas[1],
                    weight_decay=decay,
                    eps=cfg.eps,
                    amsgrad=False,
                    maximize=False,
                )
        else:
            w = split("master" if "master" in t else "param")
            bufs = split("momentum_buffer") if cfg.momentum != 0 else None
            for wd, pos, idx in batches:
                lr, decay = lrs[wd]
                first = [k for k, i in zip(pos, idx) if fresh[i]]
                for is_first, sub in ((True, first), (False, [k for k, i in zip(pos, idx) if not fresh[i]])):
                    if not sub:
                        continue
                    torch._fused_sgd_(
                        [w[k] for k in sub],
                        [grads[k] for k in sub],
                        [bufs[k] for k in sub] if bufs is not None else [],
                        weight_decay=decay,
                        momentum=cfg.momentum,
                        lr=lr,
                        dampening=0.0,
                        nesterov=False,
                        maximize=False,
                        is_first_step=is_first,
                    )

    def _pattern(self, group: ShardGroup, got: List[bool]) -> _GradPattern:
        """The group's _GradPattern for `got`: the one kept if `got` is its last pattern, else a new
        one, kept in its place ([Note: Gradient patterns])."""
        pattern = tuple(got)
        kept = self._patterns.get(group.index)
        if kept is not None and kept.got == pattern:
            return kept
        runs: List[Tuple[int, int]] = []
        for i in sorted(piece.param for piece in group.pieces if got[piece.param]):
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        kept = self._patterns[group.index] = _GradPattern(pattern, runs)
        return kept

    def _count_update(self, counts: torch.Tensor, group: ShardGroup, got: List[bool]) -> None:
        """Add 1 to the counts (per parameter of `group`, wherever they are) of the parameters in this
        shard that got a gradient; the others keep theirs ([Note: Gradient patterns])."""
        kept = self._pattern(group, got)
        inc = kept.increments.get(counts.device)
        if inc is None:
            # Made there, not copied from pageable host memory: under CUDA that copy waits for the device.
            inc = torch.zeros(len(got), dtype=torch.float32, device=counts.device)
            for a, b in kept.count_runs:
                inc[a:b].fill_(1.0)
            kept.increments[counts.device] = inc
        counts.add_(inc)

    def _batches(self, group: ShardGroup, chunk: int, got: List[bool]) -> List[Tuple[float, List[int], List[int]]]:
        """Per weight-decay value: the split positions and the parameter indices of the parts of the
        chunk's pieces that got a gradient; made once per chunk and gradient pattern, kept with the
        group's last pattern ([Note: Gradient patterns])."""
        kept = self._pattern(group, got)
        cached = kept.batches.get(chunk)
        if cached is not None:
            return cached
        decay = self.weight_decay[group.index]
        position = self._chunks[group.index][chunk].position
        active = [p.param for p in group.pieces if got[p.param] and p.param in position]
        out = []
        for wd in sorted(set(decay)):
            idx = [i for i in active if decay[i] == wd]
            if idx:
                out.append((wd, [position[i] for i in idx], idx))
        kept.batches[chunk] = out
        return out

    def _plan_chunks(self, group: ShardGroup, cuts: Sequence[int]) -> None:
        """Per chunk [a, b) of `cuts`: the sizes that cut it into its parts of the group's pieces and
        the gaps between them (split_with_sizes: one call for all views), and each part's position
        in that split."""
        pieces = sorted(group.pieces, key=lambda p: p.shard_offset)
        chunks: List[_Chunk] = []
        for a, b, staged in zip(cuts, cuts[1:], staged_numels(cuts, group.plan.shard_numel)):
            sizes: List[int] = []
            position: Dict[int, int] = {}
            at = a
            for piece in pieces:
                lo, hi = max(a, piece.shard_offset), min(b, piece.shard_offset + piece.numel)
                if lo >= hi:
                    continue
                if lo > at:
                    sizes.append(lo - at)
                position[piece.param] = len(sizes)
                sizes.append(hi - lo)
                at = hi
            # The tail to the chunk's end (-1 when there is none: dropped at split time).
            sizes.append(b - at if b > at else -1)
            chunks.append(_Chunk(a, b, sizes, position, staged))
        self._chunks[group.index] = chunks

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """This rank's update counts, JSON-safe: {"steps": {group index: [count per parameter]}}."""
        return {"steps": {str(k): v.tolist() for k, v in self.steps.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore update counts saved by state_dict() (on this or, merged by merge_rank_states, other ranks)."""
        for k, counts in state["steps"].items():
            self.steps[int(k)].copy_(torch.tensor(counts, dtype=torch.float32))
        self._device_steps = {}  # made again from the loaded counts at each group's next update

    @staticmethod
    def merge_rank_states(states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        """One state from those of the ranks that saved a checkpoint: a parameter's count is the most
        any rank applied (a rank whose shard holds none of a parameter never counts its updates)."""
        merged: Dict[str, List[float]] = {}
        for state in states:
            for k, counts in state["steps"].items():
                merged[k] = [max(a, b) for a, b in zip(merged[k], counts)] if k in merged else list(counts)
        return {"steps": merged}
