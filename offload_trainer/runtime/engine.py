"""Engine: the ZeRO-3 offload engine a user drives (built by offload_trainer.initialize).

    engine = ot.initialize(model, cfg)      # takes ownership of the model's parameters
    loss = loss_fn(engine(x), y)            # forward: groups are fetched as modules run
    engine.backward(loss)                   # gradients flow to their homes group by group
    engine.step()                           # at the accumulation boundary: clip, update, zero
    engine.close()                          # waits for IO, removes swap files

Construction plans everything up front (groups, the home tier of each state kind of each group,
device slots, host staging) and refuses a plan that cannot fit its budgets, with the numbers.
The engine wires its components together and owns the step's bookkeeping (the optimizer step
count, the step statistics); what each component does lives in its own file (docs/design.md).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from io_engine import IOEngine

from offload_trainer.config import OffloadConfig, PlacementMode, Tier
from offload_trainer.errors import BackwardOutsideEngineError, CheckpointError, PartialStateError
from offload_trainer.runtime.collectives import Collectives
from offload_trainer.runtime.device.accelerator import Accelerator
from offload_trainer.runtime.device.choose import accelerator_for
from offload_trainer.runtime.device.pending import Pending
from offload_trainer.runtime.gradients import GradAccumulator
from offload_trainer.runtime.groups.buffer_pool import BufferPool
from offload_trainer.runtime.groups.homes import Home
from offload_trainer.runtime.groups.shard_group import CopyState, ShardGroup
from offload_trainer.runtime.groups.freed_heap import give_back_freed_heap
from offload_trainer.runtime.groups.tiers import MemoryTiers, arena_bytes
from offload_trainer.runtime.hooks import HookCallbacks, Hooks, unresident_classes
from offload_trainer.runtime.layer_major import BlockStack, LayerMajorSchedule
from offload_trainer.runtime.layout.memory_plan import plan_memory
from offload_trainer.runtime.layout.merge_groups import merge_small_groups
from offload_trainer.runtime.layout.partition import PartitionPlan, plan_partition
from offload_trainer.runtime.metrics import StepStats
from offload_trainer.runtime.learning_rate import LearningRates, check_rate
from offload_trainer.runtime.optimizer import StreamingOptimizer, check_no_decay_patterns
from offload_trainer.runtime.optimizer_pipeline import OptimizerPipeline
from offload_trainer.runtime.persist import checkpoint
from offload_trainer.runtime.persist.consolidate import group_parameters
from offload_trainer.runtime.persist.export import StoredAs, export_safetensors
from offload_trainer.runtime.persist.materialize import (
    has_meta_parameters, materialize, put_back_meta_parameters, replace_meta_parameters,
)
from offload_trainer.runtime.persist.safetensors_load import WeightSource, load_safetensors
from offload_trainer.runtime.precision import LossScaler, buffer_dtype
from offload_trainer.runtime.residency.phase import Phase
from offload_trainer.runtime.residency.recorded_order import RecordedOrder
from offload_trainer.runtime.residency.scheduler import PrefetchScheduler
from offload_trainer.runtime.tied_gradients import TiedGradients
from offload_trainer.runtime.trace import Tracer
from offload_trainer.runtime import model_changes, model_claims, unresident_read

FP32 = torch.float32
_STRIDED = torch.strided
_get_grad = torch._C.TensorBase.grad.__get__  # type: ignore[attr-defined]
_set_grad = torch._C.TensorBase.grad.__set__  # type: ignore[attr-defined]
_DYNAMO = "torch._dynamo.eval_frame"  # imported by torch.compile and Module.compile(): nothing is compiled before


def _communicates(method: Callable[..., Any]) -> Callable[..., Any]:
    """A public method that may communicate: an error leaving it on this rank alone is posted for the
    other ranks ([Note: A rank that left a call alone] in collectives.py)."""

    @functools.wraps(method)
    def call(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        with self.collectives.call("engine(...)" if method.__name__ == "__call__" else f"engine.{method.__name__}()"):
            try:
                return method(self, *args, **kwargs)
            except BaseException as error:  # noqa: B902 - raised again
                if self.collectives.just_disagreed() and not self._closed:
                    self._evict_after_disagreement(error)
                raise

    return call


_open_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()
"""Engines built and not closed yet: closed at interpreter exit ([Note: Engines still open at exit])."""


def _close_open_engines() -> None:
    """Close every engine still open; registered with atexit.

    [Note: Engines still open at exit]
    A script may end without engine.close(), as it may without closing a file. Its engine's update
    pass may still run then (step() returns before the last updates are done: [Note: Hiding the
    optimizer step]), inside a torch op with the GIL released. A daemon thread that tries to take
    the GIL back while the interpreter finalizes is ended by pthread_exit, whose unwind through
    the op's C++ frames (pybind11's gil_scoped_release) became std::terminate: the process
    aborted, exit code 134, "terminate called without an active exception" (about half the runs
    of a short script). atexit runs before finalization, with every thread still alive: each
    engine still open is closed there (its pass finished, its threads ended, its swap files
    removed). An error closing one is told on stderr and the others are closed all the same."""
    for engine in list(_open_engines):
        try:
            engine.close()
        except BaseException as error:  # noqa: B902 - at exit there is no caller to raise to
            print(f"offload_trainer: closing an engine at exit: {error!r}", file=sys.stderr)


atexit.register(_close_open_engines)


def check_engine_arguments(model: object, config: object, lr_schedule: object = None, init_fn: object = None) -> None:
    """TypeError naming what was passed and what to pass, unless `model` is a module, `config` an
    OffloadConfig and `lr_schedule` and `init_fn` callables or None: a dict or a path there failed later as
    an AttributeError deep in the engine, and a rate (lr_schedule=3e-4) as "'float' object is not callable"."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__} ({_short_repr(model)})")
    if not isinstance(config, OffloadConfig):
        raise TypeError(
            f"config must be an OffloadConfig, not {type(config).__name__} ({_short_repr(config)}): build one with "
            "OffloadConfig(...), OffloadConfig.from_dict(a_dict) or OffloadConfig.from_file('run.toml')"
        )
    for name, value, example in (("lr_schedule", lr_schedule, "lambda step: 3e-4"),
                                 ("init_fn", init_fn, "offload_trainer.models.init_weights")):
        if value is not None and not callable(value):
            raise TypeError(
                f"{name} must be a callable or None, not {type(value).__name__} ({_short_repr(value)}): "
                f"pass a function, e.g. {name}={example}"
                + ("; a constant rate is optimizer.lr in the config" if name == "lr_schedule" else "")
            )


def _check_loss(loss: object) -> None:
    """What Engine.backward takes, refused before anything starts: torch's own errors came from inside the
    backward ('float' has no attribute 'backward', "grad can be implicitly created only for scalar outputs",
    "element 0 of tensors does not require grad"), which then dropped the step's gradients so far, as for any
    backward that raised, where plain PyTorch's .grad keeps them."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"engine.backward(loss): the loss must be the torch.Tensor the model's forward gave, not "
            f"{type(loss).__name__} ({_short_repr(loss)}); a number (loss.item()) has no graph to backpropagate"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"engine.backward(loss): the loss has shape {list(loss.shape)}, but backward needs one number: reduce "
            "it (loss.mean(), or loss.sum()). The step's gradients so far are kept"
        )
    if not loss.requires_grad:
        raise ValueError(
            "engine.backward(loss): the loss does not require grad, so there is nothing to backpropagate: its "
            "forward ran under torch.no_grad() or torch.inference_mode() (an evaluation forward), or no "
            "trainable parameter reached it; run the forward with gradients enabled. The step's gradients "
            "so far are kept"
        )


_STATE_ERRORS = (KeyError, IndexError, TypeError, ValueError, OverflowError, AttributeError)
"""How reading a saved state that lacks or misstates a value fails (a list where a dict belongs: AttributeError)."""


def _state_refusal(call: str, source: str, exc: BaseException) -> str:
    what = f"lacks {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else f"misstates a value ({exc})"
    return (
        f"engine.{call}: the state {what}, so nothing of it was loaded (the engine is as it was); pass what "
        f"engine.{source} gave"
    )


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Engine(HookCallbacks):
    """One model's training state across the tiers, and the step that updates it."""

    def __init__(
        self,
        model: nn.Module,
        config: OffloadConfig,
        device: "torch.device | str | Accelerator | None" = None,
        lr_schedule: Optional[Callable[[int], float]] = None,
        init_fn: Optional[Callable[[nn.Module], None]] = None,
    ) -> None:
        """`device`: "cpu", "cuda[:n]", an Accelerator (e.g. runtime.device.host.SimulatedAccelerator),
        or None for the GPU if there is one. `lr_schedule(step)` gives the learning rate of optimizer
        step `step` (from 0); default config.optimizer.lr_at. `init_fn(module)` initialises one
        module's own parameters: needed, and only allowed, for a model built on the meta device (see
        persist/materialize.py). A torch.optim.lr_scheduler scheduler attached to `lr_optimizer`
        drives the learning rate instead of `lr_schedule`."""
        check_engine_arguments(model, config, lr_schedule, init_fn)
        if config.placement is PlacementMode.AUTO:
            raise ValueError(
                'placement="auto" is resolved by offload_trainer.initialize(model, cfg, micro_batch=...), '
                "which plans before it builds the Engine: call that instead of Engine(...)"
            )
        model_claims.refuse_compiled(model)
        model_claims.refuse_claimed(model)
        model_claims.refuse_unsupported_features(model)
        self._meta = has_meta_parameters(model)
        if self._meta and init_fn is None:
            raise ValueError(
                "the model's parameters are on the meta device: pass init_fn=..., a function that "
                "initialises one module's own parameters in place (offload_trainer.models.init_weights "
                "for the built-in decoder), so that they are materialised straight into their homes"
            )
        if not self._meta and init_fn is not None:
            raise ValueError("init_fn is for a model built on the meta device; this model's parameters already exist")
        meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ValueError(
                f"buffers {meta_buffers[:3]} are on the meta device and the engine materialises only "
                "parameters: create buffers on the CPU (or compute them in forward)"
            )
        self._init_fn = init_fn
        self.model = model
        self.config = config
        self.lr_schedule = lr_schedule if lr_schedule is not None else config.optimizer.lr_at
        self.accelerator = accelerator_for(device)
        """The compute device and the copy path between it and host memory (runtime/device/)."""
        self._meta_replaced: List[Tuple[nn.Module, str, nn.Parameter]] = []
        try:
            self._assemble(model, config)
        except BaseException as error:
            self._unwind_failed_build(error)
            raise

    # -- construction --------------------------------------------------------------------------

    def _assemble(self, model: nn.Module, config: OffloadConfig) -> None:
        """Everything after the accelerator: a failure anywhere here is unwound by __init__
        ([Note: A build that fails gives the model back])."""
        self.device = self.accelerator.torch_device
        self.placement_choice: Optional[Any] = None
        """The planner's PlacementChoice when offload_trainer.initialize resolved placement = "auto"
        (self.config then holds its settings); None otherwise."""
        self._running = StepStats()
        """The counts of the step in progress: one object, shared by every component that counts."""
        self._last = StepStats()
        self.tracer = Tracer()
        self.collectives = Collectives(self._running, tracer=self.tracer)
        grouping = config.grouping
        self.plan: PartitionPlan = merge_small_groups(
            plan_partition(model, grouping, world_size=self.collectives.world_size),
            grouping.min_group_bytes, grouping.max_group_bytes,
        )
        check_no_decay_patterns(
            [p.name for g in self.plan.groups for p in g.params if p.requires_grad], config.optimizer
        )
        self.compute_dtype = config.precision.compute_dtype.torch_dtype
        model_dtypes = {g.dtype for g in self.plan.groups}
        if model_dtypes - {FP32}:
            raise ValueError(
                f"the model's parameters are {sorted(str(d) for d in model_dtypes)}; pass an fp32 model "
                "(model.float()) and choose the compute dtype with precision.compute_dtype"
            )
        self.has_master = self.compute_dtype != FP32
        """Low-precision compute keeps an fp32 master copy of trainable parameters as an optimizer state."""
        self.scaler = LossScaler(config.precision)
        if self._meta:
            self._meta_replaced = replace_meta_parameters(model)
        self._params_by_index = list(model.parameters())
        self._param_devices = [p.device for p in self._params_by_index]
        """Where each parameter was before the engine took it: a failed build gives it back there."""
        self.io = IOEngine(config.io)
        self.tiers = MemoryTiers(
            self.accelerator, config.tiers.device_budget_bytes, config.tiers.host_budget_bytes, self.io,
            config.tiers.nvme_dir, config.tiers.release_idle_memory,
        )
        self._build()

    def _unwind_failed_build(self, error: BaseException) -> None:
        """After construction raised `error`: the model back as it came, then every part made so far
        closed, in close()'s order (the IO engine finishes its requests before the arenas go). Before,
        a failure ahead of `_build` (a model refused by its dtype, an nvme_dir that cannot be used)
        left the copy workers and IO engine running: two to ten threads per failed initialize."""
        self._give_back_model(error)
        for name in ("io", "accelerator", "tiers"):
            part = getattr(self, name, None)
            if part is None:
                continue
            try:
                part.close()
            except BaseException as second:  # noqa: B902 - reported on the error being raised
                error.add_note(f"closing the engine's {name} after the failure raised too: {second!r}")

    def _give_back_model(self, error: BaseException) -> None:
        """After `_build` raised `error`: the model's hooks come off and the parameters the engine took
        get their values back from its homes (one rank), before the homes are freed.

        [Note: A build that fails gives the model back]
        `_build` takes the model's parameters group by group (each group's values written to its
        homes, its parameters then pointed at an empty placeholder), and puts the hooks on after.
        An error past the first group (a disk error writing a later group, a refusal or an
        allocation after the hooks) used to leave the user's model with placeholders and, past the
        hooks, with hooks calling an engine that never ran: a model loaded over minutes was lost.
        On one rank each taken parameter is read back from its homes (the fp32 master for a
        trainable one when compute is in low precision; a frozen one then keeps its compute-dtype
        rounding, as the homes hold no more) onto the device it was on. With several ranks each
        holds a part only, and gathering them would need the other ranks, which may not have
        failed: the error says to build the model again. A model on the meta device gets its meta
        parameters back (the build had swapped them for empty CPU ones: a retry, its budget raised
        after a PlanError, was refused as "init_fn is for a model built on the meta device", or
        without init_fn built an engine over the empty ones). Either way `error` gets a note saying
        which."""
        hooks = getattr(self, "hooks", None)
        if hooks is not None:
            hooks.give_back()
        put_back_meta_parameters(self._meta_replaced)  # a meta model gets its meta parameters back
        taken = list(getattr(self, "groups", []))
        if self._meta or not taken:
            return
        if self.collectives.world_size > 1:
            error.add_note(
                f"the engine had taken the parameters of {len(taken)} group(s), of which this rank holds a part "
                "only: build the model again before giving it to another engine"
            )
            return
        try:
            for group in taken:
                values = group_parameters(group, self.tiers, self.collectives)
                for layout in group.plan.params:
                    self._params_by_index[layout.index].data = values[layout.index].to(
                        self._param_devices[layout.index]
                    )
        except BaseException as second:  # noqa: B902 - reported on the error being raised
            error.add_note(
                f"the engine had taken the parameters of {len(taken)} group(s) and could not give them back "
                f"({second!r}): build the model again"
            )
            return
        rounded = self.has_master and any(not layout.requires_grad for g in taken for layout in g.plan.params)
        error.add_note(
            f"the model's parameters were given back (the {len(taken)} group(s) the engine had taken)"
            + (f"; frozen ones rounded to {self.compute_dtype}" if rounded else "")
        )

    def _build(self) -> None:
        cfg = self.config
        plans = self.plan.groups
        rank = self.collectives.rank
        mp = plan_memory(self.plan, cfg, rank, self.compute_dtype, self.tiers.device_is_host)
        self.memory_plan = mp
        for tier in (Tier.DEVICE, Tier.HOST):
            self.tiers.reserve(tier, arena_bytes(mp.arena_bytes[tier]))

        self.device_slots = (
            BufferPool(
                self.tiers, Tier.DEVICE, mp.num_device_slots, mp.device_slot_numels, self.compute_dtype, "device slot",
                guard_references=True,
            )
            if mp.uses_slots
            else None
        )
        if self.device_slots is not None and self.collectives.world_size > 1:
            self.device_slots.agree = self.collectives.all_true
        # Host buffers: their next writer is the host (an NVMe read into them, a merge of gradients)
        # or a copy issued from it, so taking one waits on the host for its earlier users.
        host_waits = self._host_waits_for_reuse
        self.staging = (
            BufferPool(
                self.tiers, Tier.HOST, mp.num_staging, mp.staging_numels, FP32, "staging buffer", guard_references=False,
                host_waits=host_waits, exact_class=True,
            )
            if mp.num_staging
            else None
        )
        self.param_staging = (
            BufferPool(
                self.tiers, Tier.HOST, mp.num_param_staging, mp.param_staging_numels, self.compute_dtype,
                "parameter staging buffer", guard_references=False, host_waits=host_waits,
            )
            if mp.num_param_staging
            else None
        )
        buckets = scratch = None
        if mp.bucket_numel:
            # Device buffers written by compute: their next user waits for their earlier ones on its
            # stream (GradAccumulator._into_bucket), not the host ([Note: Host waits in a step]).
            buckets = BufferPool(
                self.tiers, Tier.DEVICE, 2, mp.bucket_numel, FP32, "gradient bucket", guard_references=False,
            )
            scratch = self.tiers.allocate(Tier.DEVICE, mp.scratch_numel, FP32, "reduce-scatter output")

        per_group = list(zip(plans, mp.local_trainable_numel, mp.param_tiers, mp.grad_tiers, mp.optimizer_tiers))
        pbytes = torch.empty((), dtype=self.compute_dtype).element_size()
        nvme_sizes: Dict[str, int] = {}
        labels: Dict[str, str] = {}
        for g, n, pt, gt, ot in per_group:
            kinds = [("param", g.shard_numel * pbytes)] if pt is Tier.NVME else []
            if n and gt is Tier.NVME:
                kinds.append(("grad", n * 4))
            if n and ot is Tier.NVME:
                kinds += [(name, n * 4) for name in mp.optimizer_states]
            for kind, nbytes in kinds:
                nvme_sizes[f"g{g.index}.{kind}"] = nbytes
                labels[f"g{g.index}.{kind}"] = f"group {g.name!r} {kind}"
        if nvme_sizes:
            self.tiers.allocate_extents(nvme_sizes, labels)

        self.groups: List[ShardGroup] = []
        for g, n, pt, gt, ot in per_group:
            params = [self._params_by_index[p.index] for p in g.params]
            param_home = self._home(pt, g.shard_numel, f"g{g.index}.param", self.compute_dtype)
            grad_home = self._home(gt, n, f"g{g.index}.grad", FP32, lent=mp.grad_homes_lent) if n else None
            opt_homes = {name: self._home(ot, n, f"g{g.index}.{name}", FP32) for name in mp.optimizer_states} if n else {}
            group = ShardGroup(g, params, param_home, grad_home, opt_homes, self.device, rank)
            if not self._meta:
                self._write_initial_shard(group, params)
            group._unbind()
            self.groups.append(group)
        if self._init_fn is not None:
            materialize(self.model, self.groups, self.tiers, self._init_fn)

        self._forward_open: Dict[Any, float] = {}
        self._backward_open: Optional[Tuple[Any, float]] = None
        self.order = RecordedOrder()
        self.scheduler = PrefetchScheduler(
            self.groups,
            self.tiers,
            self.order,
            self.device_slots,
            cfg.prefetch.lookahead_groups,
            self._running,
            self.collectives,
            cfg.prefetch.lookahead_bytes,
            self.tracer,
            self.param_staging,
        )
        self.grads = GradAccumulator(
            self.tiers, self.staging, self._running, cfg.grad_accum_steps, self.collectives, buckets, scratch, self.tracer
        )
        self.optimizer = StreamingOptimizer(
            cfg.optimizer, self.groups, self.tiers, self.staging, self._running, self.collectives, self.grads, self.tracer,
            mp.update_cuts,
        )
        self.pipeline = OptimizerPipeline(
            self.optimizer, len(self.groups), self._running, cfg.prefetch.optimizer_groups_ahead,
            self._staging_kept_for_gradients(),
        )
        """The updates of the last step, running behind the next forward ([Note: Hiding the optimizer step])."""
        # Loads wait for the parameter's write; with lent gradient homes or tiers.release_idle_memory
        # they also give the group's grad home back meanwhile (no work on the load path otherwise).
        gives_back = self.tiers.release_idle_memory or self.memory_plan.grad_homes_lent
        self.scheduler.before_load = self._before_load if gives_back else self.pipeline.wait_params
        # A load of a group whose update is queued takes its parameters from the update pass itself
        # ([Note: The next forward's load from the update] in optimizer_pipeline.py).
        self.scheduler.fill_from_update = self.pipeline.fill_params
        if gives_back:  # such a load finished: the group's update is done, its grad home idle
            self.scheduler.after_fill = self._after_fill
        # The read-ahead's staging buffers go back whenever the training thread needs one of their
        # size class and none is free (the pass then reads those states itself): never a refusal.
        self.grads.reclaim_staging = self.pipeline.drop_ahead
        engine = weakref.ref(self)  # the collectives are the engine's: a bound method would be a cycle
        if self.collectives.world_size > 1:  # [Note: An update pass that failed on one rank]
            self.pipeline.hold_errors = True
            self.collectives.failed_here = lambda: Engine._pass_failed_here(engine())
            self.collectives.on_agreed_failure = lambda ranks: Engine._raise_failed_pass(engine(), ranks)
        self.optimizer.reclaim_staging = self.pipeline.drop_ahead
        self.lr_optimizer = LearningRates(self._scheduled_lr(0), self._weight_decays_in_model_order(cfg))
        """A torch.optim.Optimizer holding only the learning rates (learning_rate.py): give it to a
        torch.optim.lr_scheduler scheduler to drive them; else they follow `lr_schedule`."""
        # The engine owns lr_optimizer: a bound method would be a cycle (the weak `engine` above).
        self.lr_optimizer.on_zero_grad = lambda set_to_none: Engine._zero_grad(engine(), set_to_none)
        self._frozen = [
            (layout.name, self._params_by_index[layout.index]) for g in self.plan.groups for layout in g.params
            if not layout.requires_grad
        ]
        """The parameters frozen when the engine was built: it keeps no gradient or optimizer state for them."""
        self._param_refs = {id(p): (group, i) for group in self.groups for i, p in enumerate(group.params)}
        """Each parameter's group (the one that owns it, for a shared one) and its index there."""
        for module in self.model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is None:
                    continue
                dtype = buffer_dtype(module, buf, self.compute_dtype)  # a norm's running statistics: compute dtype
                if buf.device != self.device or buf.dtype != dtype:
                    module._buffers[name] = buf.to(self.device, dtype)
        self.tied = TiedGradients(self.model)
        """Hooks that let autograd sum a tied parameter's gradient in place ([Note: Summing a tied
        parameter's gradient in place] in runtime/tied_gradients.py)."""
        enclosing_params = [(p, gi) for gi in self.plan.enclosing_groups() for p in self.groups[gi].params]
        self.hooks = Hooks(
            self.model, self.plan.module_uses, self._params_by_index, self, self.plan.entry_uses, enclosing_params
        )
        # The model's hooks outlive close(); they must not keep the engine alive (the weak `engine` above).
        self.hooks.refuse_state_dict(
            self.model, lambda: getattr(engine(), "_closed", True), lambda m: Engine._binds(engine(), m)
        )
        self.layer_major = LayerMajorSchedule(
            self.scheduler, self.grads, self.scaler, self.tiers, self.hooks.saved_tensors, self._grad_to_home,
            self.tied, self.device,
        )
        # As backward() does: the gradient homes and staging buffers are the updates' until done.
        self.layer_major.before_backward = self._before_backward
        give_back_freed_heap()  # the model's old parameter storage
        # Last: a build that fails before gives the model back unclaimed ([Note: A build that fails
        # gives the model back]).
        def closed() -> bool:  # one function per engine: model_changes tells engines apart by it
            return getattr(engine(), "_closed", True)

        model_claims.claim(self.model, closed)
        def forget(param: nn.Parameter) -> None:  # a write to its placeholder (parametrize's set_) undone
            this = engine()
            if this is not None:
                this._param_refs[id(param)][0].note_values()

        def grads_held() -> bool:  # [Note: Reads of .grad] in model_changes.py
            this = engine()
            return this is not None and this.grads.micro_batch > 0 and this.scheduler.phase is not Phase.BACKWARD

        model_changes.hold(self.model, self._param_forms(), closed, forget, self._params_by_index, grads_held)
        unbound_of = unresident_classes(self)  # [Note: Reads of unbound parameters] in hooks.py
        for group in self.groups:
            group.set_param_classes([
                (type(p), unbound_of(type(p))) if isinstance(p, model_changes.HeldParameter) else (None, None)
                for p in group.params
            ])
        self._note_all_values()  # after materialize's init_fn, whose writes count in the versions
        self.global_step = 0
        self._partial_load: Optional[str] = None
        """The load that failed part-way (`engine.load_checkpoint('ckpt')`), leaving the homes part its
        values and part the engine's own, until a load completes; None while they hold one state
        ([Note: A load that failed part-way])."""
        self._partial_params_only = False
        """Whether that load wrote parameters only (load_safetensors): a complete one mends it too."""
        self._step_started = time.perf_counter()
        self._closed = False
        _open_engines.add(self)

    def _param_forms(self) -> Dict[int, model_changes.ParamForm]:
        """By id of each parameter: how the engine computes with it (model_changes refuses conversions
        that would change it)."""
        device = torch.empty(0, device=self.device).device  # with its index: "cuda:0", not "cuda"
        forms: Dict[int, model_changes.ParamForm] = {}
        for g in self.plan.groups:
            for layout in g.params:
                dims = len(layout.shape)
                order = model_changes.memory_order(layout.stride) if layout.stride is not None else tuple(range(dims))
                forms[id(self._params_by_index[layout.index])] = model_changes.ParamForm(
                    layout.name, self.compute_dtype, device, dims, order
                )
        return forms

    def _note_all_values(self) -> None:
        """Every parameter's values are the engine's as they are now (ShardGroup.note_values)."""
        for group in self.groups:
            group.note_values()

    def _refuse_changes_outside(self) -> None:
        """Refuse, by name, writes to parameters made outside their use (the placeholders they hold
        then): [Note: Parameters changed in place] in groups/shard_group.py. The change is dropped, so
        the loop may go on. Called by a step's first forward (a write between its micro-batches is
        the step's to refuse: each check reads every parameter, about 0.7 us each), step() and the
        saves."""
        changed = [name for g in self.groups if g.state is not CopyState.READY for name in g.changed_outside()]
        if not changed:
            return
        for group in self.groups:
            if group.state is not CopyState.READY:
                group.note_values()
        raise ValueError(
            f"parameters {changed[:3]} were written outside the engine's use of them (model.apply(init_fn), a "
            "torch.no_grad() p.mul_() or p.copy_(), p.data = ... or p.data.clamp_() as weight clipping or a momentum "
            "encoder's update does): between uses a parameter holds an empty placeholder, so the write changed nothing the engine "
            "trains; it is dropped and the engine's values kept. Set weights before offload_trainer.initialize or "
            "with engine.load_safetensors([files]); keep weights the loop updates itself in buffers "
            "(register_buffer), which stay in place"
        )

    def _binds(self: "Optional[Engine]", module: nn.Module) -> bool:
        """Whether `module`'s own parameters are bound to their values now, inside a forward or backward
        of this engine (open) whose acquisitions hold them (its state dict then holds the values)."""
        if self is None or self._closed or self.scheduler.phase is Phase.IDLE:
            return False
        refs = self._param_refs
        return all(refs[id(p)][0].state is CopyState.READY for p in module._parameters.values() if p is not None)

    def _staging_kept_for_gradients(self) -> int:
        """Host staging buffers the optimizer's read-ahead leaves free for the backward before the
        next pass: one per group whose gradients reach their home through staging (gradients.py may
        hold all of them at once, each waiting for its copies off the device or its last parameter),
        one more for a flush's old values; at least two (a reduce-scatter's shard and its copy on
        several ranks, the global norm's read of a gradient home)."""
        staged = sum(1 for g in self.groups if g.grad_home is not None and self.grads.is_staged(g.grad_home))
        return max(2, staged + 1)

    def _weight_decays_in_model_order(self, cfg: OffloadConfig) -> List[float]:
        """The weight-decay values of the trainable parameters, in the order torch_param_groups gives its
        groups (first use in named_parameters), as the optimizer decided them from the partition's
        kinds: the model's parameters are empty placeholders by now, so their shapes can no longer say."""
        decay = {
            s.name: wd for g in self.groups for s, wd in zip(g.plan.params, self.optimizer.weight_decay[g.index])
        }
        names = [n for n, p in self.model.named_parameters() if p.requires_grad and n in decay]
        # Every value the optimizer uses has a learning rate, whatever the names say.
        return list(dict.fromkeys([*(decay[n] for n in names), *decay.values()])) or [cfg.optimizer.weight_decay]

    def _home(self, tier: Tier, numel: int, key: str, dtype: torch.dtype, lent: bool = False) -> Home:
        """A home; memory homes start zeroed, NVMe extents read as zeros until written. `lent`: a memory
        home gets its tensor from GradAccumulator for a step at a time ([Note: Gradient homes lent
        from the heap] in gradients.py), its bytes counted against the budget now."""
        if tier is Tier.NVME:
            return Home(tier, numel, dtype, key=key)
        if lent:
            self.tiers.count(tier, numel * dtype.itemsize, key)
            return Home(tier, numel, dtype, lent=True)
        tensor = self.tiers.allocate(tier, numel, dtype, key)
        tensor.zero_()
        return Home(tier, numel, dtype, tensor=tensor)

    def _before_load(self, gi: int) -> None:
        """Before group gi's parameters are loaded (with lent gradient homes or tiers.release_idle_memory):
        its update is done, and with it the last use of its grad home until the next backward writes
        it, so the home's memory is given back meanwhile. Only the parameter's write is waited for ([Note: The
        parameter written first]): the update, the grad home's last reader, is done before that
        write is issued."""
        self.pipeline.wait_params(gi)
        self.grads.discard_home(self.groups[gi])

    def _after_fill(self, gi: int) -> None:
        """A load of group gi filled by its update pass has finished (with lent gradient homes or
        tiers.release_idle_memory): the update, the grad home's last reader, is done, so the home's
        memory is given back, as _before_load does for a load that waited for the update."""
        self.grads.discard_home(self.groups[gi])

    def _before_backward(self) -> None:
        """Before a backward: the last step's updates are done (they own the gradient homes and the
        staging buffers until then); on the step's first micro-batch, the staging buffers nothing holds
        (the read-ahead keeps its own) sit idle until the next update pass, so their memory is given
        back meanwhile. Together with discard_home this keeps dead buffers out of the peak resident
        set, which falls in backward (docs/design.md, Memory)."""
        self.pipeline.wait_all()
        if self.tiers.release_idle_memory and self.staging is not None and self.grads.micro_batch == 0:
            self.staging.discard_free()

    def _pass_failed_here(self: "Optional[Engine]") -> bool:
        """This rank's side of each agreement: whether its last update pass failed."""
        return self is not None and self.pipeline.has_failed()

    def _raise_failed_pass(self: "Optional[Engine]", ranks: List[int]) -> None:
        """An agreement found that the update pass of `ranks` failed: every rank refuses from now on,
        the failed ones raising their own error, the others PartialStateError naming them ([Note: An
        update pass that failed on one rank] in optimizer_pipeline.py)."""
        assert self is not None
        own = self.pipeline.take_held()
        elsewhere = f"on rank(s) {ranks}, whose errors name why"
        self.pipeline.fail(f"{type(own).__name__}: {own}" if own is not None else elsewhere)
        if own is not None:
            own.add_note(f"the update pass failed on rank(s) {ranks}: every rank refuses until engine.load_checkpoint(dir)")
            raise own
        raise PartialStateError(
            f"the update pass of the last engine.step() failed part-way {elsewhere}: their groups hold part that "
            "step's update and part the step before's, so no rank trains, saves or exports; load a checkpoint "
            "(engine.load_checkpoint(dir)) on every rank, which writes every home again"
        )

    def _host_waits_for_reuse(self, pending: Pending) -> None:
        self.accelerator.host_waits(pending, "buffer reuse")

    def _write_initial_shard(self, group: ShardGroup, params: List[nn.Parameter]) -> None:
        """This rank's shard of the model's parameters into its homes. Every rank starts from the same model."""
        homes = (group.param_home, group.optimizer_homes.get("master"))
        if not any(home is not None and (home.tier is Tier.NVME or home.crosses(self.tiers)) for home in homes):
            group.write_shard(self.tiers, params, None)
            return
        assert self.staging is not None
        # The largest buffer where the shard is larger (a group updated in chunks): written in windows.
        buffer = self.staging.take_as(min(group.plan.shard_numel, self.staging.buffer_numel), FP32)
        try:
            group.write_shard(self.tiers, params, buffer)
        finally:
            self.staging.give(buffer)

    # -- hook callbacks ------------------------------------------------------------------------

    def on_forward_start(self, groups: Any) -> None:
        # In backward this is recomputation under activation checkpointing, which PyTorch may stop
        # before the module's forward returns (early stop): no release would come, so it pins
        # the groups like a backward acquisition instead of counting a use.
        if self.layer_major.holding:
            self.layer_major.hold(groups)
            return
        backward = self.scheduler.phase is Phase.BACKWARD
        self.scheduler.acquire(groups, backward=backward)
        if self.tracer.active and not backward:
            self._forward_open[groups] = self.tracer.now()

    def on_forward_end(self, groups: Any) -> None:
        if self.layer_major.holding or self.scheduler.phase is Phase.BACKWARD:
            return
        self.scheduler.release(groups)
        if self.tracer.active:
            start = self._forward_open.pop(groups, None)
            if start is not None:
                self.tracer.span("compute", "forward " + self._group_names(groups), start, self.tracer.now())

    def on_backward_start(self, groups: Any) -> None:
        if self._backward_open is not None:
            self._close_backward_span()
        self.scheduler.acquire(groups, backward=True)
        if self.tiers.release_idle_memory:
            start = time.perf_counter()
            if self.tiers.release_freed_heap():
                self._running.heap_release_s += time.perf_counter() - start
        if self.tracer.active:
            self._backward_open = (groups, self.tracer.now())

    def begin_model_call(self) -> bool:
        if self._closed or self.scheduler.phase is not Phase.IDLE:
            # engine.__call__ (which looked for torch.compile on the stack already), a backward's
            # recomputation or a layer-major step runs it
            return False
        if _DYNAMO in sys.modules:
            model_claims.refuse_called_compiled()  # torch.compile(model) after initialize
        self._check_whole()
        if self.grads.micro_batch == 0:
            self._refuse_changes_outside()
        self.scheduler.begin(Phase.FORWARD)
        return True

    def end_model_call(self) -> None:
        self.scheduler.end()

    def _close_backward_span(self) -> None:
        if self._backward_open is not None:
            groups, start = self._backward_open
            self._backward_open = None
            self.tracer.span("compute", "backward " + self._group_names(groups), start, self.tracer.now())

    def _group_names(self, groups: Any) -> str:
        return "+".join(self.groups[g].plan.name for g in groups)

    def in_backward(self) -> bool:
        return self.scheduler.phase is Phase.BACKWARD

    def holds(self, groups: Any) -> bool:
        if self.layer_major.holding:
            return self.layer_major.holds(groups)
        held = self.scheduler.pinned if self.scheduler.phase is Phase.BACKWARD else self.scheduler.in_use
        return all(g in held for g in groups)

    def saved_tensor_sources(self) -> Tuple[Dict[int, int], Callable[[int], torch.Tensor]]:
        return self.scheduler.resident_by_storage, self.scheduler.copy_for_unpack

    def before_accumulate(self, group: int) -> None:
        if self.scheduler.phase is Phase.BACKWARD and self.groups[group].state is not CopyState.READY:
            self.scheduler.ensure_resident(group)

    def read_unresident(self, param: nn.Parameter) -> None:
        ref = self._param_refs.get(id(param))  # None: a tensor of the class this engine does not hold
        if ref is not None and self.scheduler.phase is not Phase.IDLE:
            self.scheduler.ensure_resident(ref[0].index)

    def param_name(self, param: nn.Parameter) -> str:
        ref = self._param_refs.get(id(param))
        return "?" if ref is None else ref[0].plan.params[ref[1]].name

    def param_meta(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        ref = self._param_refs.get(id(param))
        if ref is None:
            return None
        layout = ref[0].plan.params[ref[1]]
        with torch._C.DisableTorchFunctionSubclass():
            dtype = param.dtype
        meta = torch.empty(layout.shape, dtype=dtype, device="meta")
        return meta if layout.stride is None else meta.as_strided(layout.shape, layout.stride)

    def on_grad(self, param: nn.Parameter) -> None:
        if self.scheduler.phase is not Phase.BACKWARD:
            param.grad = None
            raise BackwardOutsideEngineError(
                "loss.backward() reached the engine's parameters outside engine.backward(loss): their "
                "gradients go to their homes, the loss is scaled and the micro-batch counted only there, so "
                "engine.step() would not update from this backward; call engine.backward(loss) instead. If it "
                "is another engine's backward through this engine's model (a GAN's generator loss through its "
                "discriminator), freeze this model for it (model.requires_grad_(False), True again after)"
            )
        if self.layer_major.deferring:
            self.layer_major.keep(param)  # summed over the unit's micro-batches, handed over at its end
            return
        # torch's own accessors: what autograd just wrote, without HeldParameter's Python property
        # (its refusal is for the user's reads: [Note: Reads of .grad]), twice per parameter per backward.
        grad = _get_grad(param)
        if grad is None:
            # Autograd runs the hook even where no gradient came: a custom autograd.Function that takes
            # the parameter as an input and returns None for it (a reversible block whose backward
            # computes its weights' gradients itself). Plain PyTorch's .grad stays as it was: nothing to add.
            return
        _set_grad(param, None)
        self._grad_to_home(param, grad)

    def _grad_to_home(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """A finished gradient of `param` (no longer its `.grad`) to the gradient accumulator."""
        group, i = self._param_refs[id(param)]
        if grad.layout is not _STRIDED:
            raise ValueError(
                f"parameter {group.plan.params[i].name!r} got a {grad.layout} gradient (F.embedding(..., sparse=True), "
                "say); the engine's optimizer, as torch.optim.AdamW, takes dense gradients only: compute it with "
                "sparse=False"
            )
        self.grads.on_grad(group, i, grad)

    # -- the public face -----------------------------------------------------------------------

    @_communicates
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward."""
        self._check_open()
        self._check_whole()
        if _DYNAMO in sys.modules:
            if model_claims.compiled_since(self.model, self.hooks.modules):
                model_claims.refuse_compiled(self.model)
            model_claims.refuse_called_compiled()
        if self.grads.micro_batch == 0:
            self._refuse_changes_outside()
        start = time.perf_counter()
        wait_before = self._running.io_wait_s + self._running.optimizer_exposed_s
        self.scheduler.begin(Phase.FORWARD)
        try:
            with self.hooks.saved_tensors():
                return self.model(*args, **kwargs)
        finally:
            self.scheduler.end()
            waited = self._running.io_wait_s + self._running.optimizer_exposed_s - wait_before
            self._running.compute_s += time.perf_counter() - start - waited

    @_communicates
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backpropagate `loss`; gradients are accumulated (fp32) into their homes across micro-batches.
        `retain_graph` as for `loss.backward()`: the graph stays for another backward through it.
        Each call counts toward `grad_accum_steps` (step() updates after that many calls): a
        micro-batch backpropagated in two calls counts two."""
        self._check_open()
        self._check_whole()
        _check_loss(loss)
        self._refuse_unfrozen()
        # The gradient homes and the host staging buffers are the updates' until they are done.
        self._before_backward()
        start = time.perf_counter()
        wait_before = self._running.io_wait_s
        self.scheduler.begin(Phase.BACKWARD)
        try:
            self.tied.sum_in_place(loss)
            with unresident_read.explained(self.plan.groups):
                self.scaler.scale_loss(loss).backward(retain_graph=retain_graph)
            self._close_backward_span()
            self.grads.end_backward()
        except BaseException:
            # Part of the gradients reached their homes: none of this step's are kept (the user's
            # loop may catch the error, out of memory say, and go on with the next batch).
            if self.collectives.world_size == 1:
                self._backward_open = None
                self.grads.abandon_step()
            raise
        finally:
            self.scheduler.end()
            self._running.compute_s += time.perf_counter() - start - (self._running.io_wait_s - wait_before)

    def _zero_grad(self: "Optional[Engine]", set_to_none: bool) -> None:
        """engine.lr_optimizer.zero_grad(set_to_none) (a torch loop's optimizer.zero_grad()).

        Between micro-batches, plain PyTorch's zero_grad() drops the gradients the step's earlier
        backwards left in `.grad`, and the next backwards start over. The engine's gradients are in
        its homes, not `.grad`, and zero_grad() changed nothing: the next step() updated from the
        gradients the loop had dropped, added to the new ones, silently. Now it drops them, as a
        backward that raised does (one rank). zero_grad(set_to_none=False), whose zeros plain
        AdamW would still update from, and a zero_grad() on several ranks are refused, naming what
        to do. At the accumulation boundary there is nothing to drop: step() began the next."""
        if self is None or self._closed or self.grads.micro_batch == 0:
            return
        done = f"{self.grads.micro_batch} backward() call(s) of this step ran"
        if not set_to_none:
            raise ValueError(
                f"engine.lr_optimizer.zero_grad(set_to_none=False) between micro-batches ({done}): the engine keeps "
                "no .grad to fill with zeros; call zero_grad() (set_to_none=True) to drop the step's gradients so "
                "far, or nothing: engine.step() starts the next accumulation itself"
            )
        if self.collectives.world_size > 1:
            raise ValueError(
                f"engine.lr_optimizer.zero_grad() between micro-batches ({done}) on {self.collectives.world_size} "
                "ranks: dropping a step's gradients is supported on one rank; let the step finish (engine.step() "
                "starts the next accumulation itself)"
            )
        self.pipeline.wait_all()  # the last update pass reads the gradient homes until it is done
        self.grads.abandon_step()

    def _refuse_unfrozen(self) -> None:
        """A parameter frozen at construction and trainable now would get gradients nothing trains
        (plain PyTorch trains it if its optimizer holds it): refused by name. Freezing later is fine:
        a parameter without a gradient is skipped, as torch.optim skips it."""
        unfrozen = [name for name, p in self._frozen if p.requires_grad]
        if unfrozen:
            raise ValueError(
                f"parameters {unfrozen[:3]} were frozen (requires_grad=False) when the engine was built and are "
                "trainable now; the engine keeps gradient and optimizer state only for parameters trainable at "
                "offload_trainer.initialize: set requires_grad before it (freezing later is fine)"
            )

    def _update_order(self) -> List[int]:
        """Every group, in the order the next forward first uses them (per the recorded order)."""
        order = self.order.first_use_order()
        seen = set(order)
        return order + [g.index for g in self.groups if g.index not in seen]

    @_communicates
    def forward_backward_layer_major(
        self,
        micro_batches: Sequence[Any],
        loss_fn: Callable[[Any, int], torch.Tensor],
        stack: Optional[BlockStack] = None,
    ) -> List[torch.Tensor]:
        """Forward and backward of all grad_accum_steps micro-batches of one step, block by block, so
        each group is fetched once per step in forward and once in backward (runtime/layer_major.py);
        then call step(). `stack` declares the model's blocks (default: the model, if it implements
        BlockStack, as the built-in decoder does). `loss_fn(output, m)` is micro-batch m's loss (with
        tied embeddings it is called twice per micro-batch, the head running again: [Note: Tied
        weights], so it must depend on its arguments alone); returns the losses (detached). Results are those of
        `for m, x in enumerate(micro_batches): engine.backward(loss_fn(engine(x), m) / M)`."""
        self._check_open()
        self._check_whole()
        if stack is None:
            if not isinstance(self.model, BlockStack):
                raise ValueError(
                    f"{type(self.model).__name__} does not declare its block stack (stack_begin, stack_blocks, "
                    "stack_block, stack_end): pass stack=..., e.g. offload_trainer.models.hf_block_stack(model) "
                    "for a Hugging Face decoder-only model, or train micro-batch-major"
                )
            stack = self.model
        self._refuse_unfrozen()
        self._refuse_changes_outside()
        start = time.perf_counter()
        wait_before = self._running.io_wait_s + self._running.optimizer_exposed_s
        own_step = self.grads.micro_batch == 0  # else run() refuses before it starts, the gradients kept
        try:
            with unresident_read.explained(self.plan.groups):
                return self.layer_major.run(self.model, stack, micro_batches, loss_fn)
        except BaseException:
            # As backward(): the blocks whose backward ran had handed their gradients to the homes and
            # counted the step's micro-batches, so step() updated from part of the model's gradients,
            # and the retry was refused as coming after backward() calls. None are kept.
            if own_step and self.collectives.world_size == 1:
                self.grads.abandon_step()
            raise
        finally:
            waited = self._running.io_wait_s + self._running.optimizer_exposed_s - wait_before
            self._running.compute_s += time.perf_counter() - start - waited

    @_communicates
    def step(self) -> bool:
        """At the accumulation boundary (grad_accum_steps backward() calls since the last update):
        clip, update every group, zero gradients, and return True. Before it: nothing, and False,
        so calling step() after every micro-batch, as with DeepSpeed, is right too.

        The updates run behind the next forward (see [Note: Hiding the optimizer step] in
        docs/design.md): step() returns once the global norm is known and the first groups the
        next forward needs are written; each later group is loaded only once its update is done,
        and the next backward, a checkpoint or an export wait for all of them. Nothing in the
        user's loop changes for this.

        A step whose gradients hold inf or nan updates nothing (stats().skipped; in fp32/bf16 also
        stats().nonfinite): the caller decides whether to stop. fp16 lowers its loss scale instead,
        down to precision.min_loss_scale; an overflow at that scale is stats().nonfinite too."""
        self._check_open()
        self._check_whole()
        if self.grads.micro_batch < self.config.grad_accum_steps:
            return False  # not at the boundary (none since the last update, or since a backward that raised)
        # The rates first, checked before the step does anything (a nan rate made every weight nan,
        # without a word; a step refused here keeps its gradients for a step() with a usable rate).
        if self.lr_optimizer.follows_schedule():
            self.lr_optimizer.set_all(self._scheduled_lr(self.global_step))
        self.lr_optimizer.check_rates()
        start = time.perf_counter()
        failed: Optional[BaseException] = None
        try:
            self.pipeline.wait_all()
            # The previous step's update pass is done now: its counts are this step's, always (collected
            # after this step's submit, a quick pass would land in its own step or the next by timing).
            for counts in self.pipeline.collect():
                self._running.add_counts(counts)
            self.grads.drain()
        except BaseException as error:  # noqa: B902 - several ranks: raised on every rank by the norm's agreement
            if self.collectives.world_size == 1:
                raise
            failed = error
        try:
            self.scheduler.evict_all()  # every group, whatever it refuses: then it raises
            if failed is None:
                self._refuse_changes_outside()  # every group evicted: each parameter is checked
        except BaseException as error:  # noqa: B902 - as above
            if self.collectives.world_size == 1:
                raise
            failed = failed or error
        # On every rank, whatever failed: the next forward's all-gathers follow what is resident (none,
        # now) and the recorded order, so both must be the same on every rank after a step that raised on one.
        self.order.end_step()  # first, so that the first step's updates also follow its own order
        order = self._update_order()
        norm_start = time.perf_counter()
        # Several ranks: the norm's all-reduce is the step's agreement, on a pass that failed on one rank
        # too ([Note: A step that failed on one rank] in collectives.py).
        prepared = self.optimizer.prepare(order, 1.0 / self.scaler.scale, failed)
        norm_s = time.perf_counter() - norm_start
        self._running.optimizer_total_s += norm_s
        self._running.optimizer_exposed_s += norm_s
        if not prepared.skipped:
            self.pipeline.submit(prepared, self.lr_optimizer.by_weight_decay(), held=True)
            self.lr_optimizer.step()
        overflow = prepared.skipped
        overflow_at_minimum = overflow and self.scaler.at_minimum
        self.scaler.update(overflow)
        self._running.grad_norm = prepared.norm
        self._running.skipped = overflow
        self._running.nonfinite = overflow and (not self.scaler.enabled or overflow_at_minimum)
        self._running.loss_scale = self.scaler.scale
        self.grads.begin_step()
        try:
            # The next forward's first loads, before the pass begins: each takes its group's new
            # parameters from the pass itself ([Note: The next forward's load from the update]).
            # A load that waits (a group not filled so) starts the pass first.
            self.scheduler.prefetch_next_step()
            self.pipeline.start()
            if self.tracer.active:
                self.pipeline.wait_all()  # a traced step holds its own update pass, every group of it
        finally:
            self.pipeline.start()  # however the prefetch ended
            # The update is submitted: the step happened, whatever interrupts the waits after it.
            # Counted only after them, a Ctrl-C there left global_step one behind the updates for
            # good: every later step's learning rate was its predecessor's, and checkpoints named
            # the wrong step.
            self.global_step += 1
        self._running.optimizer_s += time.perf_counter() - start
        self._running.step = self.global_step
        self._running.re_records = max(0, self.order.num_records - 1)
        now = time.perf_counter()
        self._running.step_s = now - self._step_started
        self._step_started = now
        self._running.peak_bytes = {t: a.peak_bytes for t, a in self.tiers.accounts.items()}
        self.tracer.finish()
        self._last = self._running.snapshot()
        self._running.reset()
        return True

    def train(self, mode: bool = True) -> "Engine":
        """The wrapped model's train(mode) (dropout and the like); returns the engine."""
        self.model.train(mode)
        return self

    def eval(self) -> "Engine":
        """The wrapped model's eval(); returns the engine."""
        return self.train(False)

    @_communicates
    def wait_for_updates(self) -> None:
        """Return once every update of the last step() (running behind the next forward) is written.
        Never needed for correctness (what reads the state waits itself); for timing a step on its
        own, as a benchmark that runs something else between steps must."""
        self._check_open()
        self.pipeline.wait_all()

    @_communicates
    def unreported_pass_stats(self) -> StepStats:
        """Wait for the last step()'s update pass and return its counts (bytes read and written per tier,
        NVMe requests, optimizer_total_s): a step's stats() holds the pass that ran behind it, so after
        a run's last step its own pass is in no step's. They are taken out of the next step's stats; a run
        adds them to its totals once it has stepped for the last time."""
        self._check_open()
        self.pipeline.wait_all()
        counts = StepStats()
        for finished in self.pipeline.collect():
            counts.add_counts(finished)
        return counts

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The learning rate of each weight-decay group, as torch.optim's param_groups (see
        lr_optimizer, the object to give a torch.optim.lr_scheduler scheduler)."""
        return self.lr_optimizer.param_groups

    def stats(self) -> StepStats:
        """The breakdown of the last completed step (StepStats.as_dict() for JSON)."""
        return self._last

    def group_parameters(self, group: ShardGroup) -> Dict[int, torch.Tensor]:
        """One group's parameters, consolidated across ranks (a collective), as CPU tensors in the
        model's dtype by model.parameters() index; trainable ones from the fp32 master if any."""
        self.pipeline.wait_group(group.index)
        self.collectives.check_none_failed()
        return group_parameters(group, self.tiers, self.collectives)

    @_communicates
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every parameter, consolidated, as CPU tensors by name (tied parameters under each name)."""
        self._check_open()
        self._check_whole()
        self._refuse_changes_outside()
        by_index: Dict[int, torch.Tensor] = {}
        for group in self.groups:
            by_index.update(self.group_parameters(group))
        index_of = {id(p): i for i, p in enumerate(self._params_by_index)}
        return {name: by_index[index_of[id(p)]] for name, p in self.model.named_parameters(remove_duplicate=False)}

    @_communicates
    def export_safetensors(
        self, path: "str | os.PathLike[str]", dtype: torch.dtype = torch.float32, stored_as: Optional[StoredAs] = None
    ) -> Path:
        """Consolidated weights as one safetensors file, streamed one group at a time (see persist/export.py);
        `stored_as` maps a group's parameters to the names and layout to store (the model's own when None,
        and then the model's persistent buffers are stored too, as model.state_dict() holds them)."""
        self._check_open()
        self._check_whole()
        self._refuse_changes_outside()
        self.pipeline.wait_all()
        self.collectives.check_none_failed()
        buffers = self._persistent_buffers() if stored_as is None else None
        return export_safetensors(path, dtype, self.model, self.groups, self.tiers, self.collectives, stored_as, buffers)

    @_communicates
    def load_safetensors(self, paths: "Sequence[str | os.PathLike[str]] | WeightSource") -> None:
        """Load weights from safetensors files, or from any WeightSource (a checkpoint in another layout),
        straight into the shards, one stored tensor or fused parameter at a time (persist/safetensors_load.py);
        files may hold the model's persistent buffers too (export_safetensors writes them). One that
        raises once it has written (a NaN found in a later tensor, Ctrl-C) leaves the engine refusing
        to train until a load completes ([Note: A load that failed part-way])."""
        self._check_open()
        wrote = False

        def writing() -> None:
            nonlocal wrote
            wrote = True
            self._mark_weights_partial()

        try:
            self.pipeline.wait_all()
            self.pipeline.drop_ahead()  # states read ahead would be the old weights'
            self.scheduler.evict_all()
            load_safetensors(self.model, self.groups, self.tiers, paths, self._persistent_buffers(), writing)
        except BaseException:
            self._agree_on_weights(failed=True, wrote=wrote)
            raise
        self._agree_on_weights(failed=False, wrote=wrote)
        if self._partial_params_only:
            self._partial_load, self._partial_params_only = None, False
        self._note_all_values()  # the loaded values replace any write to a placeholder since

    def _mark_weights_partial(self) -> None:
        if self._partial_load is None:  # one of load_checkpoint's stays until a checkpoint mends it
            self._partial_load, self._partial_params_only = "engine.load_safetensors(...)", True

    def _agree_on_weights(self, failed: bool, wrote: bool) -> None:
        """On several ranks, at the end of load_safetensors: whether any rank failed and any wrote.

        [Note: A weights load that failed on one rank]
        Each rank writes its own shards from the files, with no collective. One whose load raised
        (its copy of a file unreadable, Ctrl-C), before it wrote or part-way, kept its old values in
        some or all of its shards while the others held the files' values: every all-gather then
        joined shards of two models, and each rank's loop, having caught its error or seen none,
        trained on without a word. Now the ranks agree: where one failed and any wrote, every rank
        refuses (PartialStateError, the failed one raising its own error) until a load completes on
        every rank. Where none wrote, every engine is as it was. A second error on a failed rank's
        way out (the process group gone too) is dropped: its own error is raised."""
        if self.collectives.world_size == 1:
            return
        counts = torch.tensor([int(failed), int(wrote)], dtype=torch.int32)
        try:
            self.collectives.all_reduce_sum(counts)
        except BaseException:  # noqa: B902 - on a failed rank its own error is raised
            if failed:
                return
            raise
        num_failed, num_wrote = counts.tolist()
        if num_failed:
            self.collectives.failure_agreed()  # each rank raises, or goes on in step
        if not num_failed or not num_wrote:
            return
        self._mark_weights_partial()
        if not failed:
            raise PartialStateError(
                f"engine.load_safetensors(...): the load raised on {num_failed} other rank(s) (their errors name "
                "why) after the ranks had written part of the weights, so no rank trains, saves or exports until a "
                "load completes on every rank: load again"
            )

    def trace_next_step(self, path: "str | os.PathLike[str]") -> None:
        """Record a Chrome/Perfetto trace from now to the end of the next step() into `path`; that
        step() returns only once its own update pass is done, so the trace holds every group's update."""
        self._check_open()
        self.tracer.arm(path)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The engine's small state, the same on every rank, JSON-safe: the optimizer step count, the
        loss scale, the recorded group order and the learning rates' param groups. (Shards go to
        checkpoints; see rank_state_dict.)"""
        return {
            "step": self.global_step, "loss_scale": self.scaler.state_dict(), "recorded_order": self.order.state_dict(),
            "learning_rates": self.lr_optimizer.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what state_dict() gave. One that lacks or misstates a value raises ValueError naming it
        and leaves the engine as it was (its step count was changed before the value that failed)."""
        self._check_open()
        own = self.state_dict()
        try:
            self._load_shared_state(state)
        except _STATE_ERRORS as exc:
            self._load_shared_state(own)
            raise ValueError(_state_refusal("load_state_dict(state)", "state_dict()", exc)) from None

    def _load_shared_state(self, state: Dict[str, Any]) -> None:
        self.global_step = int(state["step"])
        self.scaler.load_state_dict(state["loss_scale"])
        self.order.load_state_dict(state["recorded_order"])
        rates = state.get("learning_rates")  # absent from checkpoints saved before it was kept
        if rates is not None:
            self.lr_optimizer.load_state_dict(rates)
        if self.lr_optimizer.follows_schedule() and not (rates is not None and rates["driven_by_scheduler"]):
            # Saved under the engine's own schedule: the rate of the step to come, as step() will set.
            self.lr_optimizer.set_all(self._scheduled_lr(self.global_step))

    def _scheduled_lr(self, step: int) -> float:
        """lr_schedule(step) as a float, or ValueError/TypeError naming the value (check_rate)."""
        value = self.lr_schedule(step)
        try:
            lr = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"lr_schedule({step}) gave {value!r}, which is not a number: return the learning rate") from None
        return check_rate(lr, f"lr_schedule({step})")

    def rank_state_dict(self) -> Dict[str, Any]:
        """This rank's own small state, JSON-safe: the optimizer's update counts of its shard."""
        self.pipeline.wait_all()
        return {"optimizer": self.optimizer.state_dict()}

    def load_rank_state_dicts(self, states: Sequence[Dict[str, Any]]) -> None:
        """Restore from the rank states of any number of saved ranks (merged where they overlap). States
        that lack or misstate a value raise ValueError naming it and leave the engine as it was."""
        self._check_open()
        own = self.rank_state_dict()
        try:
            self._load_rank_states(states)
        except _STATE_ERRORS as exc:
            self._load_rank_states([own])
            raise ValueError(
                _state_refusal("load_rank_state_dicts(states)", "rank_state_dict() of each rank", exc)
            ) from None

    def _load_rank_states(self, states: Sequence[Dict[str, Any]]) -> None:
        self.optimizer.load_state_dict(StreamingOptimizer.merge_rank_states([s["optimizer"] for s in states]))

    def _checkpoint_shards(self) -> checkpoint.Shards:
        return checkpoint.Shards(self.groups, self.tiers, self.collectives)

    def _persistent_buffers(self) -> Dict[str, torch.Tensor]:
        """The model's buffers that `model.state_dict()` holds (BatchNorm's running statistics; not
        those registered persistent=False): they live on the model, and go with every checkpoint."""
        modules = dict(self.model.named_modules())
        out: Dict[str, torch.Tensor] = {}
        for name, buf in self.model.named_buffers():
            owner, _, attr = name.rpartition(".")
            if attr not in modules[owner]._non_persistent_buffers_set:
                out[name] = buf
        return out

    def _param_layout(self) -> List[Dict[str, Any]]:
        # A parameter's strides only where it is not row-major ([Note: Parameter memory order] in
        # layout/partition.py): its saved elements are in that order, and a checkpoint of the model
        # in another memory format is another model's. Checkpoints of row-major models are unchanged.
        return [
            {
                "name": p.name, "shape": list(p.shape), "group": g.index, "offset": p.offset_numel,
                "requires_grad": p.requires_grad, **({"stride": list(p.stride)} if p.stride is not None else {}),
            }
            for g in self.plan.groups
            for p in g.params
        ]

    @_communicates
    def save_checkpoint(self, directory: "str | os.PathLike[str]", extra: Optional[Dict[str, Any]] = None) -> Path:
        """Write a checkpoint (atomic, checksummed; see persist/checkpoint.py) right after step()."""
        self._check_open()
        self._check_whole()
        if self.grads.micro_batch != 0:
            raise ValueError(
                f"save_checkpoint between micro-batches ({self.grads.micro_batch} of this step ran): save right "
                "after engine.step(), where no gradient is pending"
            )
        self._refuse_changes_outside()
        self.pipeline.wait_all()  # a checkpoint holds every update of the steps before it
        self.collectives.check_none_failed()
        self.grads.drain()
        header = {"config": self.config.to_dict(), "params": self._param_layout()}
        return checkpoint.save(
            directory, self._checkpoint_shards(), self.state_dict(), self.rank_state_dict(), header, extra or {},
            self._persistent_buffers(),
        )

    @_communicates
    def load_checkpoint(self, directory: "str | os.PathLike[str]") -> Dict[str, Any]:
        """Restore from a checkpoint saved by any number of ranks; returns the `extra` saved with it.

        A checkpoint that cannot be used (damaged, another model's, a small state that this engine
        refuses) raises CheckpointError and leaves the engine as it was."""
        self._check_open()
        # A write that failed earlier (raised then) is dropped: the load writes every home again.
        self.pipeline.wait_all_dropping_failures()
        self.pipeline.drop_ahead()  # states read ahead would be the old ones
        self.scheduler.evict_all()
        loaded = checkpoint.load(
            directory, self._checkpoint_shards(), self._param_layout(), self.memory_plan.optimizer_states,
            self._persistent_buffers(), adopt=lambda saved: self._adopt_small_state(saved, directory),
        )
        # Every home written: whatever a load or an update pass left part-way is gone.
        self._partial_load, self._partial_params_only = None, False
        self.pipeline.forget_failed_pass()
        self._note_all_values()  # the loaded values replace any write to a placeholder since
        self.grads.begin_step()
        return loaded.extra

    def _adopt_small_state(self, saved: checkpoint.Loaded, directory: "str | os.PathLike[str]") -> None:
        """Load a checkpoint's small state (before its shards are written); one that does not load
        (a manifest whose checksum matches yet its state lacks or misstates a value: not saved by this
        version) puts the engine's own state back and raises CheckpointError naming the checkpoint."""
        own_shared, own_rank = self.state_dict(), self.rank_state_dict()
        own_partial = self._partial_load, self._partial_params_only
        # From here until load_checkpoint returns, the engine's state is part the checkpoint's.
        self._partial_load, self._partial_params_only = f"engine.load_checkpoint({os.fspath(directory)!r})", False
        try:
            self._load_rank_states(saved.rank_states)
            self._load_shared_state(saved.shared_state)
        except _STATE_ERRORS as exc:
            self._load_rank_states([own_rank])
            self._load_shared_state(own_shared)
            self._partial_load, self._partial_params_only = own_partial
            what = f"lacks {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else f"misstates a value ({exc})"
            raise CheckpointError(
                f"{os.fspath(directory)} is corrupted or of another version: its saved engine state {what}"
            ) from None

    def peak_bytes(self, tier: "Tier | str") -> int:
        """The most bytes `tier` held at once so far: a Tier, or its name ("device", "host", "nvme")."""
        return self.tiers.accounts[Tier.named(tier, "tier")].peak_bytes

    def _evict_after_disagreement(self, error: BaseException) -> None:
        """Every rank raised from an agreement that found them at different engine calls (a forward of
        one rank's own, say), which left each rank's device copies as its own calls did: the next forward
        on each would all-gather after what it holds, and the ranks disagreed at every forward after.
        Every rank drops them here, so the next calls start alike ([Note: Agreements of one shape] in
        collectives.py); and where each is in the recorded order is forgotten alike (a rank whose forward
        raised part-way stood further on in it). An error evicting is told with `error`."""
        self.order.forget_position()
        try:
            self.scheduler.evict_all()
        except BaseException as evicting:  # noqa: B902 - the disagreement is the error to raise
            error.add_note(f"evicting the device copies after it raised too: {type(evicting).__name__}: {evicting}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this engine is closed")

    def _check_whole(self) -> None:
        """PartialStateError unless every home holds one state, by whatever computes, saves or exports.

        [Note: A load that failed part-way]
        load_checkpoint checks every record before it writes anything, then writes the homes group
        by group; load_safetensors checks names and shapes first, then writes each tensor as it reads
        it. One that raises after its first write (a file truncated or unreadable while it is read,
        a NaN in a later tensor, Ctrl-C in a load that takes minutes) leaves the homes part the load's
        values and part the engine's own, and a checkpoint's step count and learning rates already
        adopted: a loop (a notebook) that caught the error and went on trained on that mix without a
        word, and could save it as a checkpoint. The engine refuses to from then on, until a load
        completes; so after an update pass that failed part-way ([Note: A pass that failed part-way]
        in optimizer_pipeline.py)."""
        if self._partial_load is not None:
            fix = "engine.load_checkpoint(dir)" + (
                ", or the weights again with engine.load_safetensors(...)" if self._partial_params_only else ""
            )
            raise PartialStateError(
                f"{self._partial_load} raised after it had written part of the engine's state: part of it is the "
                f"load's and part the engine's own, so nothing trains, saves or exports from it; load again: {fix}"
            )
        failed = self.pipeline.failed_pass
        if failed is not None:
            raise PartialStateError(
                f"the update pass of the last engine.step() failed part-way ({failed}): some groups hold that "
                "step's update and the others the step before's, so nothing trains, saves or exports from it; "
                "load a checkpoint (engine.load_checkpoint(dir)), which writes every home again"
            )

    def close(self) -> None:
        """Wait for IO in flight, remove hooks and swap files. Idempotent.

        Every part is closed whatever an earlier one raised (a swap write that failed, Ctrl-C while
        waiting): then the first error is raised, after the threads have ended and the swap files are
        gone. Before, one error skipped the rest, and each engine closed after an IO error kept its
        threads and swap files until the process ended. The IO engine is closed only after the parts
        that issue IO, and it finishes every request queued before the arenas are given back. Each
        thread is waited for to its end even when a second Ctrl-C lands in the wait, which is raised
        after: nothing is freed while a thread may still touch it ([Note: A close interrupted while a
        thread runs] in io_engine/thread_join.py)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.collectives.closed()
        errors: List[BaseException] = []
        for part in (
            self.pipeline.close,
            self.scheduler.finish_gathers,  # no all-gather may still write into a slot being freed
            self.grads.drain,
            self._unhook,
            self.io.close,
            self.accelerator.close,
            self.tiers.close,
        ):
            try:
                part()
            except BaseException as error:  # noqa: B902 - raised below, once every part is closed
                errors.append(error)
        if errors:
            raise errors[0]

    def _unhook(self) -> None:
        """The engine's hooks off the model; its modules then refuse a forward over the placeholders
        the engine leaves (Hooks.refuse_forward)."""
        self.hooks.remove()
        for group in self.groups:
            group.set_param_classes(None)
        model_changes.let_go(self._params_by_index)
        held = [
            (layout.name, self._params_by_index[layout.index]) for g in self.plan.groups for layout in g.params
            if layout.numel > 0
        ]
        self.hooks.refuse_forward(self.model, [p for _, p in held])
        model_claims.refuse_placeholder_copies(held)

    def __del__(self) -> None:
        """Close an engine the collector takes unclosed, with a ResourceWarning.

        [Note: An engine dropped without close()]
        An engine no longer referenced (`del engine`, a notebook cell run again) is closed when the
        collector takes it, with a ResourceWarning, as an unclosed file is: its worker threads end,
        its swap files go, its arenas are unpinned. Before, its threads (8 IO workers, the update
        thread, two copy workers) ran on and held it, its memory and swap files, until the process
        ended. None of the engine's threads may hold it while idle for this (OptimizerPipeline's
        worker holds the pipeline only while it runs a pass). The model's hooks hold the engine
        while the model lives, so a model kept keeps its engine: close() it. At interpreter exit
        every engine still open is closed before finalization ([Note: Engines still open at exit]),
        so none is left to the collector then."""
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return
        try:
            if threading.current_thread() is threading.main_thread():
                self.close()
            else:
                # The collector may run on any thread, one of the engine's own workers (which close()
                # joins) among them: close from a thread of its own.
                threading.Thread(target=self.close, name="offload-engine-close", daemon=True).start()
        finally:  # after: a warning made an error must not leave it open
            warnings.warn(
                "an offload_trainer Engine was dropped without close(); closed now: call engine.close() "
                "(or use `with ot.initialize(...) as engine:`) to free its threads, memory and swap files when "
                "you choose",
                ResourceWarning,
                source=self,
            )

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type: object, exc: Optional[BaseException], tb: object) -> None:
        if exc is not None and not self._closed:  # the loss, say, raised on this rank alone
            self.collectives.left("the engine's `with` block", exc)
        try:
            self.close()
        except BaseException as error:  # noqa: B902
            if error is not exc:  # the error leaving the block (a failed swap write, raised again by close) once
                raise
