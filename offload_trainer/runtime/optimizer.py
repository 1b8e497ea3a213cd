"""StreamingOptimizer: AdamW or SGD over flat fp32 shards, group by group, IO pipelined.

The update itself is PyTorch's fused kernel (`torch._fused_adamw_`, `torch._fused_sgd_`), called
on per-parameter views of the flat shards: bitwise what `torch.optim.AdamW(fused=True)` (or
`SGD(fused=True)`) computes, since the kernel's vector/tail split is per tensor, and about as
fast as DeepSpeedCPUAdam on the CPU. One flat tensor per call would differ in the last bit.

States on NVMe stream through host staging slots: group k+1 is read while k is updated and k-1
written (io_engine handles complete in the background). Clipping multiplies gradients by
min(1, max_norm / (norm + 1e-6)) where norm is the L2 norm of the per-parameter norms in
model.parameters() order, exactly as torch.nn.utils.clip_grad_norm_ does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from io_engine import IOHandle

from offload_trainer.runtime.device.pending import IOPending, Pending, all_of

from offload_trainer.runtime.collectives import Collectives
from offload_trainer.runtime.gradients import GradAccumulator
from offload_trainer.config import OptimizerConfig, OptimizerKind, Tier
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.groups.shard_group import ShardGroup
from offload_trainer.runtime.groups.buffer_pool import BufferPool
from offload_trainer.runtime.groups.homes import Home
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.layout.param_kind import ParamKind, param_kinds
from offload_trainer.runtime.trace import Tracer

def weight_decay_of(kind: ParamKind, name: str, cfg: OptimizerConfig) -> float:
    """The weight decay of a parameter: none for biases, norms and other tensors of fewer than two
    dimensions, embeddings as optimizer.decay_embeddings says, none where a no_decay_patterns entry
    is in the name; cfg.weight_decay otherwise (layout/param_kind.py)."""
    if kind is ParamKind.NO_DECAY or (kind is ParamKind.EMBEDDING and not cfg.decay_embeddings):
        return 0.0
    lowered = name.lower()
    return 0.0 if any(p.lower() in lowered for p in cfg.no_decay_patterns) else cfg.weight_decay


def torch_param_groups(model: torch.nn.Module, cfg: OptimizerConfig) -> List[dict]:
    """The same split as the engine's, as param groups for a plain torch.optim optimizer (tests, references)."""
    kinds = param_kinds(model)
    groups: Dict[float, List[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(weight_decay_of(kinds[id(p)], name, cfg), []).append(p)
    return [{"params": params, "weight_decay": wd} for wd, params in groups.items()]


@dataclass
class _Loaded:
    """One group's tensors for an update: memory views, or staging slots being filled from NVMe."""

    group: ShardGroup
    tensors: Dict[str, torch.Tensor]
    reads: List[Pending] = field(default_factory=list)
    staged: Dict[str, torch.Tensor] = field(default_factory=dict)


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
    ) -> None:
        """`gradients`: whose accumulated gradients (and per-parameter norms) each step applies."""
        self.cfg = cfg
        self.gradients = gradients
        self.accel = tiers.accelerator
        self.tracer = tracer if tracer is not None else Tracer()
        self.collectives = collectives
        self.groups = groups
        self.tiers = tiers
        self.staging = staging
        self.stats = stats
        self.steps = {g.index: torch.zeros(len(g.plan.params), dtype=torch.float32) for g in groups}
        """Per group, per parameter: updates applied so far (a parameter without a gradient is skipped)."""
        self.weight_decay = {g.index: [weight_decay_of(s.kind, s.name, cfg) for s in g.plan.params] for g in groups}
        self._writes: List[tuple] = []

    # -- the step ------------------------------------------------------------------------------

    def step(self, lr: float, order: Sequence[int], inv_loss_scale: float = 1.0) -> Tuple[float, bool]:
        """Unscale, clip and update every group, in `order`.

        Returns the global norm of the unscaled gradients and whether the step was skipped: a step
        whose gradients hold inf or nan (norm not finite) changes nothing, so no parameter or
        optimizer state ever becomes non-finite through an update. (fp16's loss scaler then lowers
        its scale; in fp32/bf16 the caller decides whether to go on, see StepStats.nonfinite.)
        """
        start = time.perf_counter()
        groups = [self.groups[i] for i in order if self.groups[i].local_trainable_numel > 0]
        multiplier: Optional[torch.Tensor] = None
        total_t = self._global_norm(self.gradients.norms)
        if not bool(torch.isfinite(total_t)):
            self.stats.optimizer_s += time.perf_counter() - start
            return float(total_t) if inv_loss_scale == 1.0 else float("inf"), True
        if inv_loss_scale != 1.0:
            total_t = total_t * inv_loss_scale
            multiplier = torch.tensor(inv_loss_scale, dtype=torch.float32)
        if self.cfg.grad_clip_norm is not None:
            # As torch.nn.utils.clip_grad_norm_: one multiply by min(1, max_norm / (norm + 1e-6)).
            clip = torch.clamp(self.cfg.grad_clip_norm / (total_t + 1e-6), max=1.0)
            multiplier = clip if multiplier is None else clip * multiplier
        total = float(total_t)
        loads: List[_Loaded] = []
        if groups:
            loads.append(self._load(groups[0]))
        for k, group in enumerate(groups):
            if k + 1 < len(groups):
                loads.append(self._load(groups[k + 1]))
            loaded = loads.pop(0)
            self._wait_reads(loaded)
            update_start = self.tracer.now()
            self._update(loaded, lr, multiplier)
            self.tracer.span("optimizer", f"update {loaded.group.plan.name}", update_start, self.tracer.now())
            self._store(loaded)
        self._drain()
        self.stats.optimizer_s += time.perf_counter() - start
        return total, False

    def _global_norm(self, norms: Dict[int, torch.Tensor]) -> torch.Tensor:
        """L2 norm of all gradients: on one rank exactly clip_grad_norm_'s (the norm of per-parameter
        norms, in parameter order); on several, the root of the all-reduced sum of squares."""
        per_param: Dict[int, torch.Tensor] = dict(norms)
        for group in self.groups:
            got = self.gradients.got_grad(group)
            missing = [p for p in group.pieces if got[p.param] and group.plan.params[p.param].index not in per_param]
            if not missing:
                continue
            grad = self._read_home(group.grad_home)
            for p in missing:
                view = grad[p.shard_offset : p.shard_offset + p.numel]
                per_param[group.plan.params[p.param].index] = torch.linalg.vector_norm(view, 2)
            self._release_staging(group.grad_home, grad)
        if self.collectives.world_size == 1:
            if not per_param:
                return torch.zeros(())
            return torch.linalg.vector_norm(torch.stack([per_param[k].cpu() for k in sorted(per_param)]), 2)
        sum_sq = torch.stack([n.cpu().double() ** 2 for n in per_param.values()]).sum() if per_param else torch.zeros((), dtype=torch.float64)
        self.collectives.all_reduce_sum(sum_sq)
        return sum_sq.sqrt().float()

    def _read_home(self, home: Optional[Home]) -> torch.Tensor:
        """The whole home in host memory (NVMe and device homes through a staging buffer), blocking."""
        assert home is not None
        if home.tier is Tier.NVME or home.crosses(self.tiers):
            buf = self._take_staging(home.numel, home.dtype)
            home.read(self.tiers, buf)
            self.stats.add_bytes(self.stats.bytes_read, home.tier, home.nbytes)
            return buf
        assert home.tensor is not None
        return home.tensor

    def _release_staging(self, home: Optional[Home], buf: torch.Tensor) -> None:
        if home is not None and (home.tier is Tier.NVME or home.crosses(self.tiers)):
            assert self.staging is not None
            self.staging.give(buf)

    # -- pipeline stages -----------------------------------------------------------------------

    def _take_staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        assert self.staging is not None, "NVMe optimizer state needs host staging slots"
        while True:
            if self.staging.num_free:
                return self.staging.take_as(numel, dtype)
            if not self._writes:
                raise RuntimeError(
                    f"all {self.staging.num_buffers} host staging buffers are busy; raise tiers.host_budget_bytes"
                )
            handle, buf = self._writes.pop(0)
            handle.wait()
            self.staging.give(buf)

    def _homes(self, group: ShardGroup) -> Dict[str, Home]:
        homes = {"param": group.param_home, "grad": group.grad_home}
        homes.update(group.optimizer_homes)
        return homes  # type: ignore[return-value]

    def _updates_on_device(self, group: ShardGroup) -> bool:
        """Whether the group's update runs where its state is, on the device: every state kind homed
        there (else it runs on the host, its device homes copied off and back on the copy path)."""
        return all(home.tier is Tier.DEVICE for home in self._homes(group).values())

    def _load(self, group: ShardGroup) -> _Loaded:
        loaded = _Loaded(group, {})
        numel = group.local_trainable_numel
        on_device = self._updates_on_device(group)
        for name, home in self._homes(group).items():
            # With a master copy the parameter home is only written (the master's rounding).
            write_only = name == "param" and "master" in group.optimizer_homes
            if home.tier is Tier.NVME:
                # Whole homes move, so that every chunk's checksum is recorded on the way out: the
                # parameter shard's tail (frozen parameters, padding) is read too when it holds
                # anything, else written as the zeros it is.
                buf = self._take_staging(home.numel, home.dtype)
                loaded.staged[name] = buf
                if not write_only or (name == "param" and group.plan.trainable_numel < group.plan.real_numel):
                    handle = home.start_read(self.tiers, buf)
                    self.tracer.io("optimizer io", f"read {group.plan.name} {name}", handle)
                    loaded.reads.append(IOPending(handle))
                    self.stats.add_bytes(self.stats.bytes_read, Tier.NVME, buf.numel() * buf.element_size())
                else:
                    buf[numel:].zero_()
                loaded.tensors[name] = buf[:numel]
            elif home.crosses(self.tiers) and not on_device:
                buf = self._take_staging(numel, home.dtype)
                loaded.staged[name] = buf
                if not write_only:
                    assert home.tensor is not None
                    copy = self.accel.d2h(buf, home.tensor[:numel], home.writes)
                    self.tracer.io("optimizer io", f"copy {group.plan.name} {name} off the device", copy)
                    loaded.reads.append(copy)
                    self.stats.d2h_bytes += buf.numel() * buf.element_size()
                loaded.tensors[name] = buf
            else:
                assert home.tensor is not None
                if home.writes:
                    self.accel.compute_waits(all_of(home.writes), "home write")
                loaded.tensors[name] = home.tensor[:numel]
        return loaded

    def _wait_reads(self, loaded: _Loaded) -> None:
        for pending in loaded.reads:
            self.accel.host_waits(pending, "optimizer read")
        loaded.reads = []

    def _store(self, loaded: _Loaded) -> None:
        homes = self._homes(loaded.group)
        for name, buf in loaded.staged.items():
            home = homes[name]
            assert self.staging is not None
            if name == "grad":
                self.staging.give(buf)
                continue
            if home.tier is Tier.NVME:
                handle = home.start_write(self.tiers, buf)
                self.tracer.io("optimizer io", f"write {loaded.group.plan.name} {name}", handle)
                self.stats.add_bytes(self.stats.bytes_written, Tier.NVME, buf.numel() * buf.element_size())
                self._writes.append((handle, buf))
                continue
            # A device home updated on the host: copied back once; its next readers wait for it.
            assert home.tensor is not None
            copy = self.accel.h2d(home.tensor[: buf.numel()], buf)
            self.tracer.io("optimizer io", f"copy {loaded.group.plan.name} {name} to the device", copy)
            self.stats.h2d_bytes += buf.numel() * buf.element_size()
            home.writes = [copy]
            self.staging.give(buf, [copy])

    def _drain(self) -> None:
        for handle, buf in self._writes:
            handle.wait()
            assert self.staging is not None
            self.staging.give(buf)
        self._writes = []

    # -- the arithmetic ------------------------------------------------------------------------

    def _update(self, loaded: _Loaded, lr: float, multiplier: Optional[torch.Tensor]) -> None:
        group = loaded.group
        t = loaded.tensors
        piece_of = {p.param: p for p in group.pieces}
        got = self.gradients.got_grad(group)
        active = [p.param for p in group.pieces if got[p.param]]
        if not active:
            return
        steps = self.steps[group.index]
        weights = t.get("master", t["param"])
        # The fused kernels want the step counts where the weights are (a GPU, for a group updated there).
        counts = steps if weights.device == steps.device else steps.to(weights.device)

        def views(flat: torch.Tensor, idx: List[int]) -> List[torch.Tensor]:
            return [flat[piece_of[i].shard_offset : piece_of[i].shard_offset + piece_of[i].numel] for i in idx]

        if multiplier is not None:
            for g in views(t["grad"], active):
                g.mul_(multiplier)
        cfg = self.cfg
        for wd in sorted(set(self.weight_decay[group.index])):
            idx = [i for i in active if self.weight_decay[group.index][i] == wd]
            if not idx:
                continue
            if cfg.kind is OptimizerKind.ADAMW:
                step_views = [counts[i : i + 1].view(()) for i in idx]
                for s in step_views:
                    s.add_(1)
                torch._fused_adamw_(
                    views(weights, idx),
                    views(t["grad"], idx),
                    views(t["exp_avg"], idx),
                    views(t["exp_avg_sq"], idx),
                    [],
                    step_views,
                    lr=lr,
                    beta1=cfg.betas[0],
                    beta2=cfg.betas[1],
                    weight_decay=wd,
                    eps=cfg.eps,
                    amsgrad=False,
                    maximize=False,
                )
            else:
                # Momentum buffers start as a copy of the gradient on a parameter's first update.
                fresh = [i for i in idx if steps[i] == 0]
                for first, sub in ((True, fresh), (False, [i for i in idx if i not in fresh])):
                    if not sub:
                        continue
                    torch._fused_sgd_(
                        views(weights, sub),
                        views(t["grad"], sub),
                        views(t["momentum_buffer"], sub) if cfg.momentum != 0 else [],
                        weight_decay=wd,
                        momentum=cfg.momentum,
                        lr=lr,
                        dampening=0.0,
                        nesterov=False,
                        maximize=False,
                        is_first_step=first,
                    )
                    for i in sub:
                        counts[i] += 1
        if counts is not steps:
            steps.copy_(counts)
        if "master" in t:
            t["param"][: group.local_trainable_numel].copy_(t["master"])

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """This rank's update counts, JSON-safe: {"steps": {group index: [count per parameter]}}."""
        return {"steps": {str(k): v.tolist() for k, v in self.steps.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore update counts saved by state_dict() (on this or, merged by merge_rank_states, other ranks)."""
        for k, counts in state["steps"].items():
            self.steps[int(k)].copy_(torch.tensor(counts, dtype=torch.float32))

    @staticmethod
    def merge_rank_states(states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        """One state from those of the ranks that saved a checkpoint: a parameter's count is the most
        any rank applied (a rank whose shard holds none of a parameter never counts its updates)."""
        merged: Dict[str, List[float]] = {}
        for state in states:
            for k, counts in state["steps"].items():
                merged[k] = [max(a, b) for a, b in zip(merged[k], counts)] if k in merged else list(counts)
        return {"steps": merged}
