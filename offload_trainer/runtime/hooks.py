"""The only place module and autograd hooks are registered.

- forward pre-hook of each hooked module, ahead of the module's own pre-hooks: acquire the
  groups it needs;
- forward hook: release them, and make the module's backward acquire the same groups before
  it runs (a tensor hook on a single output, else `_PreBackward` around the outputs);
  where a module's code looks at hook dicts (torch's TransformerEncoderLayer takes its fast path
  only without hooks), the same two around its call instead: [Note: Modules that read their own hooks];
- the same two, guarded, on each module inside a block that code outside the block calls
  (PartitionPlan.entry_uses: `self.layers[2].norm(x)` in the model's forward): they acquire only
  when no enclosing acquisition holds the module's groups (`holds`), so a call from inside its
  block costs one check;
- the model's own pre-hook and hook (always called): a call of the model, not through the engine,
  begins and ends a forward with the saved-tensor hooks: [Note: The model called itself];
- inside a torch.func transform (grad, vmap over functional_call(model, ...)), the forward hooks
  work on the engine's buffers outside it and route nothing to backward; every hook does its work
  outside the user's TorchDispatchModes too (selective activation checkpointing): [Note: The
  engine's own tensor work];
- saved-tensor hooks around the forward: a tensor autograd saves that points into a group's
  device copy is stored as (group, offset, size, stride) and rebuilt on unpack after re-acquiring
  the group, so backward never reads a slot that was reused (see [Note: Binding parameters]).
  They run for every tensor autograd saves (about 37 per decoder block), so each is a few
  attribute reads and one dict lookup: [Note: Saved-tensor hooks on the hot path];
- post-accumulate-grad hook of each trainable parameter: hand the finished gradient to the
  engine and drop `.grad`;
- a tensor hook (run before the gradient is accumulated) on each trainable parameter of a group
  whose module encloses other hooked modules: make the group resident again if it was evicted,
  [Note: Gradients after the acquisition moved on];
- `__torch_function__` of the class a parameter has while its group is not resident
  (UnresidentParameter): a read of it during a forward or a backward outside every module's use (a
  checkpointed closure recomputed, a hook, a custom Function's backward) makes the group resident
  first, [Note: Reads of unbound parameters];
- state-dict and load-state-dict pre-hooks of each module holding parameters (the engine's,
  refuse_state_dict; kept after remove()): its parameters are placeholders, so
  `model.state_dict()` and `model.load_state_dict()` raise, naming what to use instead;
- once the engine closed, a forward pre-hook of each module holding its placeholders
  (refuse_forward): a forward over them raises, naming the module and the fix.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from offload_trainer.runtime import unresident_read
from offload_trainer.runtime.model_changes import HeldParameter
from offload_trainer.runtime.storage_identity import storage_key


class HookCallbacks:
    """What the hooks call into (implemented by the engine's scheduler and gradient accumulator)."""

    def on_forward_start(self, groups: Sequence[int]) -> None: ...

    def on_forward_end(self, groups: Sequence[int]) -> None: ...

    def on_backward_start(self, groups: Sequence[int]) -> None: ...

    def begin_model_call(self) -> bool:
        """The model is called, maybe not through the engine: begin a forward if none runs; True if
        this call began one (end_model_call ends it)."""
        ...

    def end_model_call(self) -> None: ...

    def in_backward(self) -> bool: ...

    def holds(self, groups: Sequence[int]) -> bool:
        """Whether an acquisition running now (a forward's, a backward's, a layer-major unit's) holds
        all of `groups` resident already."""
        ...

    def saved_tensor_sources(self) -> Tuple[Dict[int, int], Callable[[int], torch.Tensor]]:
        """What the saved-tensor hooks read: the storage key (storage_identity.py) of each READY
        group's device copy -> that group's index (one dict, the same object for the engine's life,
        kept up to date by its owner: read by every pack), and the function that gives group i's
        device copy, READY and pinned, for a saved tensor being unpacked."""
        ...

    def on_grad(self, param: nn.Parameter) -> None: ...

    def before_accumulate(self, group: int) -> None:
        """A gradient of a parameter of `group` is about to be accumulated into it: it must be bound."""
        ...

    def read_unresident(self, param: nn.Parameter) -> None:
        """Code reads `param` while its group is not resident (an UnresidentParameter): during a forward or
        a backward, make the group resident ([Note: Reads of unbound parameters]); between them nothing."""
        ...

    def param_name(self, param: nn.Parameter) -> str:
        """`param`'s name in the model, for an error."""
        ...

    def param_meta(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """A meta tensor of `param`'s shape, strides and dtype as the model sees it (None: a tensor of the
        class this engine does not hold): what its size reads answer while it is unbound."""
        ...


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward acquires the module's groups first."""

    @staticmethod
    def forward(ctx: Any, callbacks: HookCallbacks, groups: Tuple[int, ...], *tensors: torch.Tensor) -> Any:
        ctx.callbacks = callbacks
        ctx.groups = groups
        # An output the loss does not use gets no gradient, not zeros: a parameter that only such an
        # output depends on (a pooler beside an MLM head) then gets none, as in plain PyTorch, and
        # the optimizer skips it; with zeros AdamW decayed it and moved its moments.
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:
        _outside_user_code(ctx.callbacks.on_backward_start, ctx.groups)
        return (None, None) + grads


def _route_outputs(callbacks: HookCallbacks, groups: Tuple[int, ...], output: Any, before_backward: Callable[[Any], None]) -> Any:
    """Make the module's backward acquire `groups` first. A single output made by an autograd op
    and without tensor hooks yet gets one (`before_backward`), which runs before that op's
    backward, for about half of what an autograd.Function's apply and backward cost; anything
    else goes through _PreBackward, which runs once before the backward of any of its outputs: a
    tree of outputs, a leaf, and an output that already has hooks (an enclosing module returning
    its child's output as it is: hooks on one tensor run in registration order, child first, so
    the enclosing module's acquisition would replace the child's pins before the child's backward;
    a new node keeps the enclosing module's acquisition first, as with any other module).
    A parameter returned as it is (frozen, or under no_grad) becomes its values (_parameter_values)."""
    if isinstance(output, torch.Tensor):  # the common case, without flattening a tree
        if not output.requires_grad:
            return _values(output)
        if output.grad_fn is not None and output._backward_hooks is None:
            # Registered on output.grad_fn as it is now: an in-place op on the output later does not
            # move it, as it would not move _PreBackward's node.
            output.register_hook(before_backward)
            return output
        return _PreBackward.apply(callbacks, groups, output)[0]
    flat, spec = tree_flatten(output)
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return _parameter_values(output)
    routed = _PreBackward.apply(callbacks, groups, *[flat[i] for i in positions])
    for i, t in zip(positions, routed):
        flat[i] = t
    return tree_unflatten([_values(t) for t in flat], spec)  # the Parameters left are frozen ones


def _values(t: Any) -> Any:
    """A Parameter as a tensor on its values (see _parameter_values); anything else as it is."""
    return t.detach() if isinstance(t, nn.Parameter) else t


def _changed_in_place(t: torch.Tensor, version: int) -> RuntimeError:
    """Autograd's own error for a saved tensor changed in place ([Note: Saved tensors changed in place])."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead. Hint: "
        "a tensor the forward saved for backward was changed in place after it was saved: make that "
        "operation out of place (h = h * 2 rather than h.mul_(2)), or clone the tensor before changing it"
    )


def _parameter_values(output: Any) -> Any:
    """A module's output with every Parameter in it (a module returning its soft prompt or its
    position table as it is) replaced by a tensor on its values: the module's release unbinds the
    Parameter itself from them (an empty placeholder from then on), while a tensor viewing the
    device copy keeps its slot from being lent again ([Note: Binding parameters])."""
    if isinstance(output, torch.Tensor):
        return _values(output)
    flat, spec = tree_flatten(output)
    if not any(isinstance(t, nn.Parameter) for t in flat):
        return output
    return tree_unflatten([_values(t) for t in flat], spec)


_functorch_level: Callable[[], Optional[int]] = torch._C._functorch.maybe_current_level
"""The innermost torch.func transform's level (grad, vjp, vmap, ...), None outside every one."""
_DisableFuncTorch = torch._C._DisableFuncTorch
"""Inside a torch.func transform, what the engine does to its own buffers (slot views, copies) is
done outside it: a view of a plain tensor made inside grad() is a wrapper with no storage, whose
data_ptr() failed ("Cannot access data pointer of Tensor that doesn't have storage")."""
_dispatch_modes: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""How many TorchDispatchModes the running code is under (0 nearly always)."""


def _outside_user_code(callback: Callable[[Any], None], arg: Any) -> None:
    """callback(arg), one of the engine's own callbacks, outside whatever the user's code runs under.

    [Note: The engine's own tensor work]
    The engine's hooks work on its own buffers (slot views, copies, gradients into their homes) in
    the middle of the user's forward and backward, so they would run under what the user's code
    runs under:
    - a torch.func transform (grad, vmap over functional_call): a view of a plain tensor made inside
      grad() is a wrapper without storage ("Cannot access data pointer of Tensor that doesn't have
      storage");
    - a TorchDispatchMode, which sees every op: selective activation checkpointing
      (torch.utils.checkpoint's context_fn=create_selective_checkpoint_contexts) records the ops of
      a checkpointed block's forward and expects the same ops again when backward recomputes it,
      but there the engine's pre-hook pins groups already resident and makes other views
      ("aten.slice.Tensor encountered during backward but not found in storage"); a FlopCounterMode
      would count the engine's copies.
    So each runs outside both; where neither is active (nearly always) that costs two C calls."""
    if _functorch_level() is not None:
        with _DisableFuncTorch():  # the transform's level stays: no recursion to leave it
            _outside_dispatch_modes(callback, arg)
    else:
        _outside_dispatch_modes(callback, arg)


def _outside_dispatch_modes(callback: Callable[[Any], None], arg: Any) -> None:
    if _dispatch_modes():
        with _disable_current_modes():
            callback(arg)
    else:
        callback(arg)


_SAME_ON_PLACEHOLDER = frozenset(
    getattr(torch._C.TensorBase, name).__get__
    for name in (
        "grad", "requires_grad", "_version", "dtype", "device", "is_leaf", "grad_fn", "layout", "is_cuda",
        "is_meta", "is_sparse", "is_quantized", "_backward_hooks", "_post_accumulate_grad_hooks", "name",
    )
    if hasattr(torch._C.TensorBase, name)
)
"""Attribute reads a parameter's empty placeholder answers as its values would: they fetch nothing (the
engine's own bookkeeping reads them of every parameter)."""

_SIZE_READS = frozenset(
    [getattr(torch._C.TensorBase, name) for name in ("numel", "size", "dim", "stride", "is_contiguous")]
    + [getattr(torch._C.TensorBase, name).__get__ for name in ("shape", "ndim", "nbytes")]
    + [torch.numel, torch.Tensor.__len__]
)
"""Reads of a parameter's size that the parameter's layout answers, without its values ([Note: Sizes of
unbound parameters])."""


class UnresidentParameter(HeldParameter):
    """The class of an engine's parameter while its group is not resident and it holds the group's empty
    placeholder (ShardGroup binds it back to HeldParameter, or to the held class of a subclass of the
    user's: model_changes.held_class). Each engine has a subclass of its own per held class, whose
    `_fetch` is its callbacks' read_unresident (unresident_classes).

    [Note: Reads of unbound parameters]
    Code reads parameters where no module's hook made their group resident. In backward: a
    non-reentrant activation checkpoint of a closure recomputes it (`checkpoint(lambda x: torch.tanh(x
    + self.pos), h, use_reentrant=False)` at the model's root), a user's backward hook or a custom
    autograd.Function's backward reads a weight it did not save. Saved tensors re-acquire their group
    on unpack, but such a read takes the Parameter itself, and by then backward's acquisitions may have
    moved on from its group (the root's pins are the blocks' once their backward runs) and evicted it.
    In a forward: torch runs the global forward pre-hooks (register_module_forward_pre_hook), and a
    pre-hook registered after initialize with prepend=True, before the engine's pre-hook acquires the
    module's groups. Each computed on the empty placeholder: "The size of tensor a (16) must match the
    size of tensor b (0)", or silently a norm of 0 and other weights from the first step.
    torch hands every operation on a tensor whose class defines `__torch_function__` (attribute reads
    and writes included) to it, so a parameter takes this class while unbound, and only then: a bound
    one costs nothing more. During the engine's forward or backward a read makes the parameter's group
    resident (scheduler.ensure_resident: pinned until the next acquisition, counted as an unpack
    refetch; its saved tensors are then the group's, as any module's) and then runs as it would have;
    a write (`p.data = t`, `p.grad = None`) and the attributes the placeholder answers alike
    (_SAME_ON_PLACEHOLDER) fetch nothing, nor does anything between a forward and its backward (a term
    over model.parameters() in the training loop stays refused at backward, unresident_read.py: autograd
    would keep its group's device copy until then). Copying and pickling a parameter (`copy.deepcopy`,
    `torch.save(p)`), which read `.data` with `__torch_function__` off, fetch too, and are refused by
    name where nothing can be fetched (between steps): they wrote the empty placeholder, silently."""

    _fetch: Callable[[nn.Parameter], None]
    _name: Callable[[nn.Parameter], str]
    _meta: Callable[[nn.Parameter], Optional[torch.Tensor]]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SIZE_READS and args and isinstance(args[0], UnresidentParameter):
            # [Note: Sizes of unbound parameters]
            # `sum(p.numel() for p in model.parameters())`, transformers' num_parameters(), an MFU
            # estimate: read between steps they gave the placeholder's 0 and (0,), silently. The size
            # is the layout's, whatever is bound: asked of a meta tensor of the parameter's shape and
            # strides, with nothing fetched (in a forward too, where it would have fetched the group).
            meta = type(args[0])._meta(args[0])
            if meta is not None:
                return func(meta, *args[1:], **kwargs)
        if func not in _SAME_ON_PLACEHOLDER and getattr(func, "__name__", None) != "__set__":
            unresident = [t for t in tree_leaves((args, kwargs)) if isinstance(t, UnresidentParameter)]
            for t in unresident:
                if isinstance(t, UnresidentParameter):  # not bound by an earlier one's fetch of their group
                    type(t)._fetch(t)
            if not any(isinstance(t, UnresidentParameter) for t in unresident):
                return func(*args, **kwargs)  # every one bound now: as it runs on any bound parameter
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: Dict[int, Any]) -> nn.Parameter:
        """nn.Parameter's copy reads `.data` with `__torch_function__` off (the placeholder) and keeps the
        class: the group is made resident first, and the copy, which no engine holds, has the class the
        parameter had before the engine (HeldParameter.__deepcopy__, or the user's class's own)."""
        return type(_bound_or_refused(self, "copy.deepcopy")).__deepcopy__(self, memo)

    def __reduce_ex__(self, proto: Any) -> Any:
        """Pickling (torch.save of a parameter, of a list of them): bound first, as __deepcopy__; between
        steps refused, where it wrote the empty placeholder without a word."""
        return type(_bound_or_refused(self, "pickling (torch.save)")).__reduce_ex__(self, proto)


def _bound_or_refused(param: UnresidentParameter, how: str) -> nn.Parameter:
    """`param`, bound now (during a forward or a backward its group is made resident, and its class is a
    held one); else (between steps, or between a forward and its backward) TypeError naming it and the fix."""
    type(param)._fetch(param)
    if isinstance(param, UnresidentParameter):
        raise TypeError(
            f"{how} of parameter {type(param)._name(param)!r} outside the engine's forward and backward: an "
            "offload_trainer engine holds its values and it holds an empty placeholder there, so the copy would "
            "have no values; take the values "
            "with engine.full_state_dict() (CPU tensors) or engine.export_safetensors(path), or copy it inside "
            "the forward or backward (where it is fetched)"
        )
    return param


def unresident_classes(callbacks: HookCallbacks) -> Callable[[type], type]:
    """The UnresidentParameter subclasses of one engine, one per held class (model_changes.held_class),
    made on first asking: their reads call `callbacks.read_unresident`, held weakly (a parameter's class
    must not keep the engine alive), outside the user's transforms and modes. A subclass of the user's
    keeps its own methods while unbound, after UnresidentParameter's (`__torch_function__`, `__deepcopy__`)."""
    callbacks_ref = weakref.ref(callbacks)
    read_of, name_of, meta_of = type(callbacks).read_unresident, type(callbacks).param_name, type(callbacks).param_meta

    def fetch(param: nn.Parameter) -> None:
        owner = callbacks_ref()
        if owner is not None:
            _outside_user_code(functools.partial(read_of, owner), param)

    def name(param: nn.Parameter) -> str:
        owner = callbacks_ref()
        return "?" if owner is None else name_of(owner, param)

    def meta(param: nn.Parameter) -> Optional[torch.Tensor]:
        owner = callbacks_ref()
        return None if owner is None else meta_of(owner, param)

    engines = type(
        "UnresidentParameter", (UnresidentParameter,),
        {"_fetch": staticmethod(fetch), "_name": staticmethod(name), "_meta": staticmethod(meta)},
    )

    @functools.lru_cache(maxsize=None)
    def unbound_of(held: type) -> type:
        if held is HeldParameter:
            return engines
        return type(held.__name__, (engines, held), {"__module__": held.__module__})

    return unbound_of


@functools.lru_cache(maxsize=None)
def _reads_hook_dicts(cls: type) -> bool:
    """Whether `cls.forward`'s source looks at modules' forward hook dicts."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source (a C extension, a class made at run time): assume not
        return False
    return "_forward_pre_hooks" in source or "_forward_hooks" in source


def _modules_called_without_hooks(model: nn.Module) -> "set[int]":
    """The ids of the modules whose engine hooks go around their call instead of into their hook
    dicts: every module inside (or being) one whose forward reads hook dicts."""
    out: "set[int]" = set()
    for module in model.modules():
        if id(module) not in out and _reads_hook_dicts(type(module)):
            out.update(id(m) for m in module.modules())
    return out


class _AroundCall:
    """The engine's pre- and post-forward hook of one module, run around the module's call (an
    instance attribute `_call_impl`, which nn.Module.__call__ calls) rather than from its hook dicts.

    [Note: Modules that read their own hooks]
    Some modules choose their computation by whether hooks are registered: torch's
    TransformerEncoderLayer, in eval mode under no_grad, runs its fused fast path
    (torch._transformer_encoder_layer_fwd) only when no module of it has a forward hook or
    pre-hook, and that path rounds differently from the module-by-module one. With the engine's
    hooks in its dicts it always took the slow path, so an evaluation between training steps gave
    other numbers than plain PyTorch's. For such a module and its descendants the engine's hooks
    wrap the call instead: the pre-hook before every hook of the module (as a prepended pre-hook),
    the post-hook after every forward hook (as a hook appended last), none of them in the dicts.
    Which modules: those whose class's forward source names `_forward_hooks` or
    `_forward_pre_hooks`, and everything inside them."""

    def __init__(
        self, module: nn.Module, pre: Callable[..., None], post: Callable[..., Any], always_post: bool = False
    ) -> None:
        """`always_post`: post runs (with output None) also when the call raised, as a hook
        registered with always_call=True."""
        self._module = module
        self._replaced = module.__dict__.get("_call_impl")  # an earlier wrapper, else none
        inner = module._call_impl

        def call(*args: Any, **kwargs: Any) -> Any:
            pre(module, args)
            try:
                output = inner(*args, **kwargs)
            except BaseException:
                if always_post:
                    post(module, args, None)
                raise
            routed = post(module, args, output)
            return output if routed is None else routed

        module.__dict__["_call_impl"] = call

    def remove(self) -> None:
        if self._replaced is None:
            self._module.__dict__.pop("_call_impl", None)
        else:
            self._module.__dict__["_call_impl"] = self._replaced


class Hooks:
    """Registers every hook of one engine and removes them all on remove()."""

    def __init__(
        self,
        model: nn.Module,
        module_uses: Dict[str, Tuple[int, ...]],
        params: List[nn.Parameter],
        callbacks: HookCallbacks,
        entry_uses: Optional[Dict[str, Tuple[int, ...]]] = None,
        enclosing_params: Sequence[Tuple[nn.Parameter, int]] = (),
    ):
        """`enclosing_params`: (parameter, its group) of the groups PartitionPlan.enclosing_groups names."""
        self.callbacks = callbacks
        self._handles: List[Any] = []
        self._refusals: List[Any] = []
        """refuse_state_dict's hooks: they outlive remove(), and only give_back() takes them off."""
        self.modules: List[nn.Module] = []
        """The modules given hooks (or a call wrapper)."""
        modules = dict(model.named_modules())
        self._around_call = _modules_called_without_hooks(model)
        for name, groups in (entry_uses or {}).items():
            entered: List[bool] = []  # per call under way, innermost last: did its pre-hook acquire?
            self._attach(modules[name], self._entry_pre_forward(groups, entered), self._entry_post_forward(groups, entered))
        for name, groups in module_uses.items():
            self._attach(modules[name], self._pre_forward(groups), self._post_forward(groups))
        self._attach_model_call(model)  # after the root's own: its pre-hook first, its hook last
        # A parameter's post-accumulate-grad hooks are held by its C++ tensor, where the collector
        # cannot see them: a hook holding the engine would keep it (and its threads, memory and swap
        # files) alive for good once dropped without close() ([Note: An engine dropped without
        # close()] in runtime/engine.py). So the hook holds it weakly: a weakref.ref to it and its
        # class's function, called once per parameter per backward (a WeakMethod builds the bound
        # method in Python code at every call, about 1 us of this per-parameter path).
        callbacks_ref = weakref.ref(callbacks)
        on_grad_of = type(callbacks).on_grad

        def on_grad(param: nn.Parameter) -> None:
            owner = callbacks_ref()
            if owner is not None:
                if _dispatch_modes():
                    _outside_user_code(functools.partial(on_grad_of, owner), param)
                else:
                    on_grad_of(owner, param)

        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(on_grad))
        # [Note: Gradients after the acquisition moved on]
        # Autograd accumulates a parameter's gradient into it (AccumulateGrad, which reads the
        # parameter's shape and strides) when backward reaches the parameter's first use in forward.
        # A module's backward acquisition pins its groups only until the next one: where a module
        # encloses hooked modules (a ViT's root adds its cls_token and pos_embed, then calls its
        # blocks), the blocks' acquisitions come between, and an op that saved nothing of the
        # parameter (an add, expand, cat) leaves nothing to fetch it again on unpack, so its group
        # could be evicted, and AccumulateGrad met the empty placeholder ("The size of tensor a (0)
        # must match the size of tensor b (16)"). A tensor hook of a leaf runs just before its
        # AccumulateGrad, held by the tensor (it outlives the graph): for these parameters only, it
        # makes the group resident again when it is not (counted as an unpack refetch).
        for p, group in enclosing_params:
            if p.requires_grad:
                self._handles.append(p.register_hook(self._before_accumulate(callbacks_ref, group)))

    def _attach(self, module: nn.Module, pre: Callable[..., None], post: Callable[..., Any]) -> None:
        """`pre` and `post` as the module's first forward pre-hook and its forward hook: a pre-hook
        registered before the engine may read the module's parameters (torch.nn.utils.spectral_norm
        and weight_norm compute `weight` from `weight_orig`/`weight_g`, `weight_v` in one). Around its
        call where its code reads hook dicts ([Note: Modules that read their own hooks])."""
        self.modules.append(module)
        if id(module) in self._around_call:
            self._handles.append(_AroundCall(module, pre, post))
            return
        self._handles.append(module.register_forward_pre_hook(pre, prepend=True))
        self._handles.append(module.register_forward_hook(post))

    def _attach_model_call(self, model: nn.Module) -> None:
        """The model's own call begins a forward with the saved-tensor hooks where none runs.

        [Note: The model called itself]
        A loop may call the model instead of the engine (`model(x)`, `functional_call(model, ...)`,
        a library's loop that only knows the model). Its modules' hooks fetch their groups all the
        same, but without the engine's saved-tensor hooks every tensor autograd saved of a device copy
        kept that slot referenced until backward: under a device budget near the plan's minimum the
        step was refused ("needs a device slot, but all N slots hold groups that are in use"), and it
        took more device memory anyway. So the model's own call begins a forward with the saved-tensor
        hooks when none runs (the engine's call has begun one already), and ends it after its last
        hook, also when the forward raised (always_call). Under a torch.func transform (per-sample gradients:
        vmap(grad(...)) over functional_call(model, ...)), which refuses saved-tensor hooks, the call
        runs without them, as before."""
        callbacks, saved_tensors = self.callbacks, self.saved_tensors
        contexts: List[Any] = []  # per call under way, innermost last: its saved-tensor hooks, or None

        def pre(module: nn.Module, args: Any) -> None:
            # Not under a torch.func transform (grad, vjp, vmap over functional_call(model, ...)),
            # which refuses saved-tensor hooks: the call goes on as before, without them.
            context = None
            if _functorch_level() is None and callbacks.begin_model_call():
                context = saved_tensors()
                context.__enter__()
            contexts.append(context)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            context = contexts.pop() if contexts else None
            if context is not None:
                try:
                    context.__exit__(None, None, None)
                finally:
                    callbacks.end_model_call()

        if id(model) in self._around_call:
            self._handles.append(_AroundCall(model, pre, post, always_post=True))
            return
        self._handles.append(model.register_forward_pre_hook(pre, prepend=True))
        self._handles.append(model.register_forward_hook(post, always_call=True))

    def refuse_state_dict(
        self, model: nn.Module, closed: Callable[[], bool], bound: Callable[[nn.Module], bool] = lambda m: False
    ) -> None:
        """Make `state_dict()` of every module holding parameters raise (UnresidentReadError): the
        engine holds their values, the module empty placeholders, and a `torch.save` of its state
        dict, or a Hugging Face `save_pretrained`, would write a model without weights, silently.
        Except where `bound(module)`: inside a forward whose acquisition holds the module's
        parameters (a module's code reading `self.fc.state_dict()["weight"]`, which direct_reads
        counts as a read, so its group holds them), its state dict holds their values, as in plain
        PyTorch; each module's hook asks for its own, so a state dict is whole or refused.
        `load_state_dict()` always: it failed with a size mismatch against the placeholders (or,
        with strict=False, loaded nothing).
        These hooks stay after remove(): once the engine is closed (`closed()`) the placeholders are
        all the module has. give_back() takes them off with the rest."""
        def refuse(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            if not bound(module):
                raise unresident_read.state_dict_refused(prefix.rstrip(".") or type(module).__name__, closed())

        def refuse_load(module: nn.Module, state_dict: Any, prefix: str, *rest: Any) -> None:
            raise unresident_read.load_state_dict_refused(prefix.rstrip(".") or type(module).__name__, closed())

        for module in model.modules():
            if module._parameters:
                self._refusals.append(module.register_state_dict_pre_hook(refuse))
                # public from torch 2.5
                self._refusals.append(module._register_load_state_dict_pre_hook(refuse_load, with_module=True))

    def refuse_forward(self, model: nn.Module, held: Sequence[nn.Parameter]) -> None:
        """After the engine closed: a forward of a module whose own parameters include one of `held`
        (the parameters the closed engine left as empty placeholders, 0-element ones aside) raises
        UnresidentReadError naming the module. It failed deep inside torch before ("'weight' must be
        2-D" from an embedding). A parameter the module no longer holds (torch.func.functional_call's
        tensors, a new nn.Parameter assigned) or one given values again (`p.data = t`) is not refused.
        Kept with the state-dict refusals: give_back() takes them off."""
        held_ids = {id(p) for p in held}
        for name, module in model.named_modules():
            own = tuple((key, p) for key, p in module._parameters.items() if p is not None and id(p) in held_ids)
            if not own:
                continue

            def refuse(module: nn.Module, args: Any, own: Tuple[Tuple[str, nn.Parameter], ...] = own, name: str = name) -> None:
                if any(module._parameters.get(key) is p and p.numel() == 0 for key, p in own):
                    raise unresident_read.forward_after_close(name or type(module).__name__)

            self._refusals.append(module.register_forward_pre_hook(refuse, prepend=True))

    @staticmethod
    def _before_accumulate(callbacks_ref: "weakref.ref[HookCallbacks]", group: int) -> Callable[[torch.Tensor], None]:
        # The group's index, not the parameter: a hook the tensor holds must not hold the tensor (a
        # cycle through C++ the collector cannot see), nor the engine.
        before_accumulate_of = type(callbacks_ref()).before_accumulate

        def hook(grad: torch.Tensor) -> None:
            owner = callbacks_ref()
            if owner is not None:
                _outside_user_code(functools.partial(before_accumulate_of, owner), group)

        return hook

    def _pre_forward(self, groups: Tuple[int, ...]) -> Callable[..., None]:
        on_forward_start = self.callbacks.on_forward_start

        def hook(module: nn.Module, args: Any) -> None:
            if _functorch_level() is None and not _dispatch_modes():
                on_forward_start(groups)
            else:
                _outside_user_code(on_forward_start, groups)

        return hook

    def _entry_pre_forward(self, groups: Tuple[int, ...], entered: List[bool]) -> Callable[..., None]:
        holds, on_forward_start = self.callbacks.holds, self.callbacks.on_forward_start

        def hook(module: nn.Module, args: Any) -> None:
            if holds(groups):
                entered.append(False)
                return
            if _functorch_level() is None and not _dispatch_modes():
                on_forward_start(groups)
            else:
                _outside_user_code(on_forward_start, groups)
            entered.append(True)

        return hook

    def _entry_post_forward(self, groups: Tuple[int, ...], entered: List[bool]) -> Callable[..., Any]:
        # A forward that raised leaves its entry behind: calls after it pop their own, the innermost.
        post = self._post_forward(groups)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if entered and entered.pop():
                return post(module, args, output)
            return None

        return hook

    def _post_forward(self, groups: Tuple[int, ...]) -> Callable[..., Any]:
        callbacks = self.callbacks
        on_forward_end, in_backward, on_backward_start = (
            callbacks.on_forward_end, callbacks.in_backward, callbacks.on_backward_start
        )
        is_grad_enabled = torch.is_grad_enabled

        def before_backward(grad: Any) -> None:
            if _dispatch_modes():
                _outside_user_code(on_backward_start, groups)
            else:
                on_backward_start(groups)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            # The outputs first, the release after: a Parameter returned as it is (a soft prompt) is
            # still bound to its values while _PreBackward (or _parameter_values) takes them.
            if _functorch_level() is not None:
                # A torch.func transform's backward is its own, not engine.backward: nothing to
                # acquire for it (a weight it saved keeps its slot from being lent again).
                routed = _parameter_values(output)
                _outside_user_code(on_forward_end, groups)
                return routed
            if in_backward():
                routed = None
            elif is_grad_enabled():
                routed = _route_outputs(callbacks, groups, output, before_backward)
            else:
                routed = _parameter_values(output)
            if _dispatch_modes():
                _outside_user_code(on_forward_end, groups)
            else:
                on_forward_end(groups)
            return routed

        return hook

    def saved_tensors(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context to run a forward in, so that saved tensors survive eviction of their group.

        [Note: Saved-tensor hooks on the hot path]
        pack runs for every tensor autograd saves, activations included (most of them), and unpack
        for each again in backward. A tensor in a READY group's device copy is told by its storage
        alone (storage_identity.storage_key, one C call; `saved_tensor_sources`, entered and removed
        by the scheduler as groups become READY and are evicted, so no entry is stale) and packed as
        a 4-tuple (group, offset, size, stride); anything else as a pair (the tensor, its version:
        [Note: Saved tensors changed in place]). unpack rebuilds a 4-tuple from the group's device
        copy: for a group of the running backward acquisition (READY and pinned) that is one
        attribute read (PrefetchScheduler.copy_for_unpack), else a re-acquisition. The length tells
        the two apart.

        [Note: Saved outputs and reference cycles]
        Without hooks autograd keeps an op's saved output (tanh's, softmax's) without its grad_fn,
        which is the op's own node. A pack hook's result is kept as it is given, so a tensor that
        requires grad, returned as it is, holds its grad_fn: for a saved output that is the node
        holding it, a cycle through C++ that Python's collector cannot see. backward() breaks it
        (it frees what it unpacked); a forward whose graph is dropped without backward (an
        evaluation loss computed with grad enabled) kept its whole graph alive, about 15 MB a
        forward on the tiny preset at batch 8 x 128, and the engine with it after close(). So such
        a tensor is returned detached (the same storage, no copy); unpack gives it back and autograd
        puts the saved grad_fn and requires_grad back on, as for the tuples.

        [Note: Saved tensors changed in place]
        Autograd checks that a tensor it saved was not changed in place before backward reads it
        (its version counter against the version it saved at), and raises "one of the variables
        needed for gradient computation has been modified by an inplace operation". It makes that
        check only for tensors it keeps itself: under saved-tensor hooks it unpacks without it. So
        pack keeps each tensor with its version (a detached tensor shares its version counter), and
        unpack makes autograd's check and raises its error: a model that changes a saved activation
        in place (`h = x.sigmoid(); h.mul_(2)`) would otherwise train on wrong gradients, silently.
        A tensor of a group's device copy is rebuilt from the copy resident at unpack, whose version
        its loads change; writes to parameters are refused by model_changes.py instead."""
        resident, copy_for_unpack = self.callbacks.saved_tensor_sources()
        strided = torch.strided

        def pack(t: torch.Tensor) -> Any:
            if t.layout is strided:  # sparse and other layouts have no storage to compare
                group = resident.get(storage_key(t))
                if group is not None:
                    return (group, t.storage_offset(), t.size(), t.stride())
            # Detached: kept as it is, an op's saved output would hold its own node ([Note: Saved
            # outputs and reference cycles]).
            return (t.detach() if t.requires_grad else t, t._version)

        def unpack(packed: Any) -> torch.Tensor:
            if len(packed) == 2:
                t, version = packed
                if t._version != version:
                    raise _changed_in_place(t, version)
                return t
            group, offset, size, stride = packed
            return copy_for_unpack(group).as_strided(size, stride, offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def remove(self) -> None:
        for handle in reversed(self._handles):  # last first: a call wrapper restores the one before it
            handle.remove()
        self._handles = []

    def give_back(self) -> None:
        """Every hook off, the state-dict refusals too: the model holds its parameters' values again
        (a build that failed: [Note: A build that fails gives the model back] in runtime/engine.py)."""
        self.remove()
        for handle in self._refusals:
            handle.remove()
        self._refusals = []
