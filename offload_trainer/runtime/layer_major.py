"""The layer-major schedule: all of a step's micro-batches pass through block k before block k+1.

    losses = engine.forward_backward_layer_major(micro_batches, loss_fn)   # instead of the loop
    engine.step()                                                          # of engine(x) / backward

Micro-batch-major accumulation (`for x in micro_batches: engine.backward(loss(engine(x)) / M)`)
fetches every group once per micro-batch in forward and again in backward: with parameters on
NVMe or in host memory, M times the parameter traffic of one pass. Here each group is acquired
once per step in forward and once in backward, whatever M is:

    forward   begin (embedding) for every micro-batch, then block 0 for every micro-batch, ...,
              block L-1 for every micro-batch; only each block's input is kept (the boundaries)
    end       per micro-batch: norm, head and loss, and their backward at once -> d loss/d h_L
              (tied weights: [Note: Tied weights])
    backward  block L-1 for every micro-batch, recomputed from its stored input and backpropagated
              with the stored output gradient, ..., block 0; then the begin for every micro-batch

So the schedule recomputes every block once in backward, as activation checkpointing would; the
activations held at any time are one block's for one micro-batch, plus the boundaries: the input
of every block for every micro-batch (boundary_store.py): the blocks backward needs first on the
device as far as its budget has room, the next in host memory, the rest on NVMe, counted against
each tier's budget, and refused with the numbers when they fit nowhere.

[Note: Layer-major exactness]
Every parameter still receives its micro-batches' gradients in micro-batch order, each one
computed by the same kernels from the same values as in a micro-batch-major backward (the
forward runs in grad mode and the block is recomputed from the same input), summed in the same
order, in fp32 ([Note: Gradients once per unit]): so fp32 results on one rank are bitwise those of
plain PyTorch's micro-batch-major accumulation, with each loss divided by M as
`engine.backward(loss / M)` does, and bf16/fp16 results those of the engine's own micro-batch-major
steps.
A unit that draws random numbers, changes a buffer or changes its micro-batch's context in its forward
is refused ([Note: Random draws], [Note: Buffers changed in forward], ForwardEffects.note_contexts).

[Note: Random draws]
Plain PyTorch draws a step's random numbers micro-batch by micro-batch (the begin, every block, the
end of micro-batch 0, then of micro-batch 1); this schedule runs block 0 for every micro-batch
before block 1, and runs the begin and every block again in backward, so a mask or noise drawn
there would be another than plain PyTorch's, and the recomputation's another than its own forward's.
Which modules draw cannot be told from their types or configs (nn.Dropout, but also F.dropout in a
forward, SDPA's dropout_p, HF Mixtral's router jitter, stochastic depth): the schedule compares the
random generators' states (the CPU's and the device's) before and after each forward unit, and
refuses the first unit that moved them, naming it, before any of its gradients reach a home (the
step is dropped, as after any error in it, and the loop may go on micro-batch-major). Python's and
NumPy's generators are not watched: code drawing from them (LayerDrop by `random.uniform`) is not
caught.

[Note: Buffers changed in forward]
A forward that updates a buffer (BatchNorm's running statistics in training, a step counter) would
update it again when the schedule recomputes the begin or a block in backward (and the end, with
tied weights), and a recomputation would read the buffer as the later micro-batches left it: plain
PyTorch updates it once per micro-batch. The schedule notes every buffer of the model (the tensor
and its version counter) at the start of the step and refuses the first forward unit after which
one was changed in place or replaced by other values, naming both; a buffer replaced by equal values
(HF's dynamic rotary table registered again) is no change.

[Note: Tied weights]
A parameter the begin and the end both use (tied embeddings: lm_head.weight = embed_tokens.weight)
gets, in plain PyTorch, both contributions of one micro-batch summed by autograd (head + embedding,
one addition, which commutes bitwise) before that sum is accumulated into `.grad` after the
earlier micro-batches'. The end unit runs long before the begin's backward, so its share cannot
simply go into `.grad` first (that sums all heads, then all embeddings). Instead the end unit
leaves the tied parameters out of its backward (`inputs=`: only the last block's output and the
end's own parameters), the last block's output of every micro-batch is kept as one more boundary,
and the begin's backward of micro-batch m runs the end again on it and backpropagates both, the
loss and the begin's output, in one call restricted to the begin's parameters: autograd then sums
the two uses of micro-batch m exactly as plain's backward does, and accumulates them in
micro-batch order. The cost: the end's forward once more per micro-batch, and the end's groups
fetched once more per step. Which parameters are tied is read off the autograd graphs of the
first micro-batch's begin and end (graph_parameters); one shared between two blocks, or between a
block and the begin or end, is refused (tie_candidates): each block's backward is a unit of its own.

What a model declares (`BlockStack`): the built-in decoder implements it (models/decoder.py), and
models/hf_block_stack.py wraps a Hugging Face decoder-only model. While a unit of the schedule
runs (the begin, one block, the end), every group its modules acquire is held until the unit is
done for all micro-batches, so the recorded order sees one acquisition per group per unit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Set, Tuple, runtime_checkable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from offload_trainer.config import Tier
from offload_trainer.runtime.boundary_store import BoundarySpill, BoundaryStore
from offload_trainer.runtime.gradients import GradAccumulator
from offload_trainer.runtime.groups.tiers import MemoryTiers
from offload_trainer.runtime.precision import LossScaler
from offload_trainer.runtime.residency.phase import Phase
from offload_trainer.runtime.residency.scheduler import PrefetchScheduler
from offload_trainer.runtime.tied_gradients import TiedGradients


@runtime_checkable
class BlockStack(Protocol):
    """A model as begin -> blocks -> end, what the layer-major schedule needs to know of it.

    Each block must take the hidden state and the context and return the next hidden state of the
    same shape and dtype; the context holds what the blocks of one micro-batch are given besides it
    (rotary tables, masks, positions; per block where they differ), and no tensor in it may require
    grad (refused: each block backpropagates into its hidden state alone) or be changed by a block
    (refused: each block is recomputed in backward with the context as the forward left it)."""

    def stack_begin(self, *inputs: Any) -> Tuple[torch.Tensor, Any]:
        """One micro-batch's inputs -> (the first block's input, the context)."""
        ...

    def stack_blocks(self) -> Sequence[nn.Module]:
        """The blocks, in order."""
        ...

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: Any) -> torch.Tensor:
        """Run one block (no activation checkpointing: the schedule recomputes blocks itself)."""
        ...

    def stack_end(self, h: torch.Tensor, context: Any) -> Any:
        """The last block's output -> the model's output (what the loss function takes)."""
        ...


def tie_candidates(model: nn.Module, blocks: Sequence[nn.Module]) -> Set[int]:
    """The trainable parameters registered more than once outside the blocks (by id): those the begin
    and the end may share (tied embeddings). ValueError for one shared between two blocks, or between
    a block and the rest of the model: each block is a unit of its own, see [Note: Tied weights]."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            names.setdefault(id(p), []).append(name)
    units: Dict[int, Set[Any]] = {}
    inside: Dict[int, int] = {}
    for k, block in enumerate(blocks):
        for _, p in block.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                units.setdefault(id(p), set()).add(k)
                inside[id(p)] = inside.get(id(p), 0) + 1
    candidates = set()
    for pid, registered in names.items():
        outside = len(registered) - inside.get(pid, 0)
        if outside > 0:
            units.setdefault(pid, set()).add("outside")
        if outside > 1:
            candidates.add(pid)
        if len(units.get(pid, ())) > 1:
            raise ValueError(
                f"the layer-major schedule runs each block as a unit of its own, but parameter {registered[0]} is "
                f"also {', '.join(registered[1:])}: shared between blocks or between a block and the embedding or "
                "head, its gradient would be summed in another order than plain PyTorch's; untie it or train "
                "micro-batch-major"
            )
    return candidates


def graph_parameters(roots: Sequence[torch.Tensor], params: Dict[int, nn.Parameter]) -> Dict[int, nn.Parameter]:
    """The parameters among `params` (by id) that backpropagating `roots` accumulates into: the
    leaves of their autograd graph."""
    found: Dict[int, nn.Parameter] = {}
    seen: Set[Any] = set()
    todo = [t.grad_fn for t in roots if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        if leaf is not None and id(leaf) in params:
            found[id(leaf)] = params[id(leaf)]
        todo.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


def _refuse_context_gradients(contexts: Sequence[Any]) -> None:
    """ValueError for a context tensor that requires grad: each block's backward reaches its hidden-state input
    alone, so a gradient through the context (a gate computed from a parameter by stack_begin) would be lost,
    or autograd would fail on the context's graph the first block's backward freed."""
    for m, context in enumerate(contexts):
        for t in tree_leaves(context):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(
                    f"the block stack's context of micro-batch {m} (what stack_begin returns beside the hidden state) "
                    f"holds a tensor of shape {tuple(t.shape)} that requires grad: the layer-major schedule "
                    "backpropagates each block into its hidden state alone; compute the context from no parameter "
                    "(or pass it through the hidden state), or train micro-batch-major"
                )


class ForwardEffects:
    """Tells whether the forward units run so far drew random numbers ([Note: Random draws]), changed a
    buffer of the model ([Note: Buffers changed in forward]) or a tensor of a micro-batch's context."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self._states = self._now()
        self._buffers = {
            (id(mod), key): (mod, f"{prefix}.{key}" if prefix else key, buf, buf._version)
            for prefix, mod in model.named_modules() for key, buf in mod._buffers.items() if buf is not None
        }
        self._contexts: List[Tuple[Any, List[Tuple[torch.Tensor, int]]]] = []

    def note_contexts(self, contexts: Sequence[Any]) -> None:
        """The contexts stack_begin returned: each block is recomputed in backward with its micro-batch's context
        as the forward left it, so a block's forward may not change a tensor in it, in place or by putting
        another in its place (a memory the blocks add to); plain PyTorch's block reads it as the block before
        left it."""
        self._contexts = [(c, [(t, t._version) for t in _tensors(c)]) for c in contexts]

    def _now(self) -> List[torch.Tensor]:
        states = [torch.random.get_rng_state()]
        if self.device.type != "cpu":
            states.append(torch.get_device_module(self.device.type).get_rng_state(self.device))
        return states

    def refuse(self, unit: str) -> None:
        """ValueError naming `unit` if a generator moved since the last look, or a buffer changed since the
        step began, or a tensor of a context since note_contexts."""
        now = self._now()
        if any(not torch.equal(a, b) for a, b in zip(self._states, now)):
            raise ValueError(
                f"{unit} drew random numbers in its forward (dropout, SDPA's dropout_p, router jitter, stochastic "
                "depth): the layer-major schedule runs the micro-batches' units in another order than plain PyTorch "
                "and recomputes them in backward, so its draws would differ; set their probability or noise to 0, "
                "call model.eval(), or train micro-batch-major"
            )
        for (_, key), (mod, name, buf, version) in self._buffers.items():
            now = mod._buffers.get(key)
            if now is buf and buf._version == version:
                continue
            if now is not buf and now is not None and buf._version == version and _same_values(now, buf):
                continue
            raise ValueError(
                f"{unit} changed buffer {name} in its forward (BatchNorm's running statistics in training, a "
                "counter): the layer-major schedule recomputes it in backward, which would change it again and read "
                "it as later micro-batches left it; put that module in eval mode (module.eval()) or train "
                "micro-batch-major"
            )
        for m, (context, noted) in enumerate(self._contexts):
            now = _tensors(context)
            if len(now) != len(noted) or any(t is not n or n._version != v for t, (n, v) in zip(now, noted)):
                raise ValueError(
                    f"{unit} changed a tensor of the context of micro-batch {m} (what stack_begin returns beside the "
                    "hidden state) in its forward: the layer-major schedule recomputes each block in backward with "
                    "the context as the last block left it, not as this block saw it; keep the context unchanged "
                    "(pass what changes through the hidden state), or train micro-batch-major"
                )


def _tensors(tree: Any) -> List[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next((n for n, m in model.named_modules() if m is module), type(module).__name__)


def _as_args(micro_batch: Any) -> Tuple[Any, ...]:
    return tuple(micro_batch) if isinstance(micro_batch, (tuple, list)) else (micro_batch,)


class LayerMajorSchedule:
    """Runs one step's forward and backward layer-major, and holds each unit's groups while it runs."""

    def __init__(
        self,
        scheduler: PrefetchScheduler,
        grads: GradAccumulator,
        scaler: LossScaler,
        tiers: MemoryTiers,
        saved_tensors: Callable[[], Any],
        hand_over: Callable[[nn.Parameter, torch.Tensor], None],
        tied_gradients: TiedGradients,
        device: torch.device,
    ) -> None:
        """`device`: the compute device, whose random generator is watched beside the CPU's ([Note: Random
        draws]). `hand_over(param, grad)` gives a parameter's gradient of a unit's micro-batches, summed, to the
        gradient accumulator (the engine's, [Note: Gradients once per unit]). `tied_gradients`: the
        engine's, put on the begin's backward piece where a tied weight's two uses meet ([Note: Summing a
        tied parameter's gradient in place] in tied_gradients.py)."""
        self.hand_over = hand_over
        self.device = device
        self.tied_gradients = tied_gradients
        self.deferring = False
        """True while a backward unit keeps its gradients until its end (the engine's on_grad then calls
        keep()); set by _unit only. An attribute: read once per gradient."""
        self._handed: Dict[int, nn.Parameter] = {}
        """By id: the parameters whose gradients the step's backward units have handed over so far."""
        self._kept: Dict[int, nn.Parameter] = {}
        """By id: every parameter the running backward unit gave a gradient, in the order they came (keep())."""
        self._sums: Dict[int, torch.Tensor] = {}
        """By id of a parameter computed in low precision: its running unit's gradient summed so far, in
        fp32 on the device (an fp32 parameter's is its `.grad`)."""
        self._name: Callable[[nn.Parameter], str] = lambda p: "?"
        """A parameter's name in the model of the running step (for errors)."""
        self.scheduler = scheduler
        self.grads = grads
        self.scaler = scaler
        self.tiers = tiers
        self.saved_tensors = saved_tensors
        self.before_backward: Callable[[], None] = lambda: None
        """Called before the step's backward begins: waits for the previous step's optimizer updates,
        which own the gradient homes and staging buffers until they are done (optimizer_pipeline.py)."""
        self._held: Optional[List[int]] = None
        """The groups held for the running unit (None: no unit is running)."""
        self.spill = BoundarySpill(tiers)
        """The NVMe extent and host staging of boundaries that fit neither the device nor host memory."""
        self.boundary_bytes: Dict[Tier, int] = {}
        """How many bytes of boundaries the last step kept in each tier."""

    # -- holding -----------------------------------------------------------------------------------

    @property
    def holding(self) -> bool:
        """True while a unit runs: the engine's hook callbacks then call hold() instead of acquiring."""
        return self._held is not None

    def holds(self, groups: Sequence[int]) -> bool:
        """Whether the running unit holds all of `groups` already."""
        assert self._held is not None
        return all(g in self._held for g in groups)

    def hold(self, groups: Sequence[int]) -> None:
        """Acquire the groups not yet held by the running unit, and keep them until it ends."""
        assert self._held is not None
        new = [g for g in groups if g not in self._held]
        if new:
            self.scheduler.acquire(new)
            self._held.extend(new)

    @contextlib.contextmanager
    def _unit(self, backward: bool = False) -> Iterator[None]:
        """Hold every group the unit acquires until it is done; a backward unit's gradients are then
        handed over as the last micro-batch's, and the unit's gradients closed."""
        assert self._held is None, "layer-major units do not nest"
        self._held = []
        self.deferring = backward
        done = False
        try:
            yield
            done = True
        finally:
            held, self._held = self._held, None
            try:
                if self.deferring:
                    self.deferring = False
                    self._hand_over(held, done)
            finally:
                if backward:  # the unit's saved tensors are gone: what their unpacking pinned may be evicted
                    self.scheduler.unpin()
                self.scheduler.release(held)

    def keep(self, param: nn.Parameter) -> None:
        """While a backward unit runs: the gradient autograd just accumulated into `param.grad` stays for
        the unit's end, summed with the unit's other micro-batches' in fp32 ([Note: Gradients once per
        unit]): an fp32 one in `.grad` itself, where autograd adds the next; a low-precision one taken
        out into an fp32 sum of its own."""
        self._kept[id(param)] = param
        grad = param.grad
        if grad is None or grad.dtype == torch.float32:
            return
        param.grad = None
        kept = self._sums.get(id(param))
        if kept is None:
            self._sums[id(param)] = grad.float()  # a new tensor: exact, and this unit's own
        else:
            kept.add_(grad)  # fp32 + the gradient made fp32 (exact): what the home's add_ computes

    def _hand_over(self, held: List[int], done: bool) -> None:
        """Hand the unit's summed gradients over as the last micro-batch's, and close them.

        [Note: Gradients once per unit]
        A unit's M micro-batches run back to back, so their gradients may be summed on the device
        before they go anywhere (old + new, per element, in fp32, in micro-batch order: what the
        gradient homes would do), and each group's gradient reaches its home, is staged, written to
        NVMe or reduce-scattered once per step instead of once per micro-batch. fp32 gradients are
        summed by autograd in `.grad`; low-precision ones would be summed there in their own dtype,
        so keep() takes each out into an fp32 sum beside it (the device then holds a unit's gradients
        in fp32, as an fp32 unit does). Before, those were handed over piece by piece: the next
        micro-batch's gradient of each group found the previous one still staged (one rank) or its
        reduced shard not yet merged (several), and under CUDA the host waited for the GPU there,
        once per group and micro-batch (runtime/device/test_cuda_host_waits.py).

        Every parameter the unit gave a gradient is handed over, those of the groups it held first: a
        stack that reads a block's weight without calling the block (`F.linear(h, block.weight)` in
        stack_block) reads it bound where the scheduler had prefetched its group, which the unit then never
        acquired, and its gradient stayed in `.grad`, lost: the block did not train, silently."""
        kept, self._kept = self._kept, {}
        params = [p for gi in held for p in self.scheduler.groups[gi].params if p.requires_grad]
        listed = {id(p) for p in params}
        params += [p for pid, p in kept.items() if pid not in listed]
        sums, self._sums = self._sums, {}
        again = [p for pid, p in kept.items() if pid in self._handed]
        if not done or again:  # the unit failed: drop what it accumulated
            for p in params:
                p.grad = None
            if again:
                raise ValueError(
                    f"parameter {self._name(again[0])} got gradients in two units of the layer-major schedule (a "
                    "module of the model's root called in every block, or by a block and the embedding or head): "
                    "the schedule sums each unit's micro-batches before the next unit's, plain PyTorch each micro-"
                    "batch's uses first, so their sum would round otherwise; move it into each block (unshared), or "
                    "train micro-batch-major"
                )
            return
        self._handed.update(kept)
        self.grads.resume_micro_batch(self.grads.grad_accum_steps - 1)
        for p in params:
            grad = sums.pop(id(p), None)
            if grad is None:
                grad = p.grad
            if grad is not None:
                p.grad = None
                self.hand_over(p, grad)
        self.grads.end_backward(pieces_follow=True)

    # -- the step ----------------------------------------------------------------------------------

    def run(
        self,
        model: nn.Module,
        stack: BlockStack,
        micro_batches: Sequence[Any],
        loss_fn: Callable[[Any, int], torch.Tensor],
    ) -> List[torch.Tensor]:
        """Forward and backward of every micro-batch of one step; returns each micro-batch's loss (detached).

        `micro_batches[m]` is passed to stack.stack_begin (a tuple as several arguments);
        `loss_fn(output, m)` gives micro-batch m's loss, which is backpropagated divided by the
        number of micro-batches (the scaling of `engine.backward(loss / M)`)."""
        num = len(micro_batches)
        if num != self.grads.grad_accum_steps:
            raise ValueError(
                f"a layer-major step got {num} micro-batches but grad_accum_steps={self.grads.grad_accum_steps}: "
                "pass exactly grad_accum_steps micro-batches per step"
            )
        if self.grads.micro_batch != 0:
            raise ValueError(
                f"a layer-major step after {self.grads.micro_batch} micro-batch-major backward() calls: "
                "call engine.step() first (one step is either one or the other)"
            )
        blocks = list(stack.stack_blocks())
        effects = ForwardEffects(model, self.device)
        self._handed = {}
        self._name = lambda p: next((n for n, q in model.named_parameters() if q is p), "?")
        candidates = tie_candidates(model, blocks)
        params = {id(p): p for p in model.parameters() if p.requires_grad}
        last = len(blocks)
        """The boundary index of the last block's output, kept for the begin's backward when tied."""
        store: Optional[BoundaryStore] = None
        try:
            self.scheduler.begin(Phase.FORWARD)
            try:
                with torch.enable_grad():  # the kernels of a training forward (the graphs are dropped)
                    with self._unit():
                        begun = [stack.stack_begin(*_as_args(mb)) for mb in micro_batches]
                    effects.refuse("the begin (what runs before the first block)")
                    begin_params = graph_parameters([begun[0][0]], params)
                    keep_last = any(pid in candidates for pid in begin_params)
                    h = [b[0].detach() for b in begun]
                    contexts = [b[1] for b in begun]
                    del begun
                    _refuse_context_gradients(contexts)
                    effects.note_contexts(contexts)
                    take_order = list(reversed(range(last))) + ([last] if keep_last else [])
                    sizes = [x.numel() * x.element_size() for x in h]
                    store = BoundaryStore(self.tiers, sizes, take_order, self.spill)
                    self.boundary_bytes = dict(store.nbytes)
                    for k, block in enumerate(blocks):
                        with self._unit():
                            for m in range(num):
                                store.put(k, m, h[m])
                                h[m] = stack.stack_block(block, h[m], contexts[m]).detach()
                        effects.refuse(f"block {k} ({_name_of(model, block)})")
                    if keep_last:
                        for m in range(num):
                            store.put(last, m, h[m])
            finally:
                self.scheduler.end()
            self.before_backward()
            self.scheduler.begin(Phase.BACKWARD)
            try:
                losses, grad_out, tied = self._end(
                    model, stack, h, contexts, loss_fn, params, begin_params, keep_last, effects
                )
                del h
                for k in reversed(range(len(blocks))):
                    with self._unit(backward=True):
                        for m in range(num):
                            x = store.take(k, m).requires_grad_()
                            with self.saved_tensors(), torch.enable_grad():
                                y = stack.stack_block(blocks[k], x, contexts[m])
                            grad_out[m] = self._backward_piece([y], [grad_out[m]], of=x)
                with self._unit(backward=True):
                    for m, mb in enumerate(micro_batches):
                        with self.saved_tensors(), torch.enable_grad():
                            h0, _ = stack.stack_begin(*_as_args(mb))
                            if tied:  # the end again, for the tied parameters' other use: [Note: Tied weights]
                                out = stack.stack_end(store.take(last, m), contexts[m])
                                scaled = self.scaler.scale_loss(loss_fn(out, m) / num)
                                del out
                        if tied:
                            self.tied_gradients.sum_in_place(scaled, h0)
                            self._backward_piece([scaled, h0], [None, grad_out[m]], list(begin_params.values()))
                            del scaled
                        elif h0.requires_grad:
                            self._backward_piece([h0], [grad_out[m]])
                        grad_out[m] = None
                # Every unit left its merges for later ([Note: Merges left for later] in gradients.py):
                # the step reads the homes next.
                self.grads.merge_all()
                self.grads.resume_micro_batch(num)
            finally:
                self.scheduler.end()
        finally:
            if store is not None:
                store.close()
        return losses

    def _end(
        self,
        model: nn.Module,
        stack: BlockStack,
        h: List[torch.Tensor],
        contexts: List[Any],
        loss_fn: Callable[[Any, int], torch.Tensor],
        params: Dict[int, nn.Parameter],
        begin_params: Dict[int, nn.Parameter],
        kept_last: bool,
        effects: "ForwardEffects",
    ) -> Tuple[List[torch.Tensor], List[Optional[torch.Tensor]], bool]:
        """The end unit: output, loss and its backward per micro-batch. Returns the losses, the
        gradients of the last block's outputs, and whether the end shares parameters with the begin
        (whose gradients it then leaves to the begin's backward, [Note: Tied weights])."""
        num = len(h)
        losses: List[torch.Tensor] = []
        grad_out: List[Optional[torch.Tensor]] = []
        inputs: Optional[List[torch.Tensor]] = None
        tied = False
        with self._unit(backward=True):
            for m in range(num):
                x = h[m].requires_grad_()
                with self.saved_tensors(), torch.enable_grad():
                    loss = loss_fn(stack.stack_end(x, contexts[m]), m)
                    scaled = self.scaler.scale_loss(loss / num)
                effects.refuse("the end (what runs after the last block, and the loss)")
                if m == 0:
                    end_params = graph_parameters([scaled], params)
                    shared = [pid for pid in end_params if pid in begin_params]
                    if shared and not kept_last:
                        names = {id(p): n for n, p in model.named_parameters()}
                        raise ValueError(
                            f"the begin and the end of the block stack both use {[names.get(pid) for pid in shared][:3]} "
                            "without a module of each registering it: the layer-major schedule finds tied weights by "
                            "their registrations (as lm_head.weight = embed_tokens.weight does); register it so, "
                            "or train micro-batch-major"
                        )
                    tied = bool(shared)
                    if tied:
                        inputs = [x] + [p for pid, p in end_params.items() if pid not in begin_params]
                if inputs is not None:
                    inputs[0] = x
                grad_out.append(self._backward_piece([scaled], [None], inputs, of=x))
                losses.append(loss.detach())
                h[m] = None  # type: ignore[call-overload]
        return losses, grad_out, tied

    def _backward_piece(
        self,
        outputs: List[torch.Tensor],
        grads: List[Optional[torch.Tensor]],
        inputs: Optional[List[torch.Tensor]] = None,
        of: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """One unit's backward of one micro-batch; its gradients are kept for the unit's end (keep()).
        `inputs`: accumulate into these leaves only (else all). Returns the gradient of the leaf `of` (the
        unit's hidden-state input), zeros where none reaches it.

        [Note: Boundary gradients keep autograd's layout]
        The gradient handed to the block before is the one autograd made for the leaf, taken by a hook
        before AccumulateGrad, not `of.grad`: AccumulateGrad gives `.grad` the leaf's strides, and in
        plain PyTorch the block before receives the gradient in autograd's own layout. A hidden state
        that is not row-major (a ViT's `proj(x).flatten(2).transpose(1, 2)`) otherwise got a gradient of
        the other layout, whose reductions (a bias's gradient) sum in another order: other last bits."""
        assert self.deferring, "a piece of backward outside a backward unit"
        reached: List[torch.Tensor] = []
        handle = None if of is None else of.register_hook(reached.append)
        try:
            torch.autograd.backward(outputs, grads, inputs=inputs)
        finally:
            if handle is not None:
                handle.remove()
        if of is None:
            return None
        return reached[0] if reached else torch.zeros_like(of)


__all__ = ["BlockStack", "LayerMajorSchedule", "graph_parameters", "tie_candidates"]
