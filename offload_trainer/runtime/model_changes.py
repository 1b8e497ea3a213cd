"""Changes a user makes to a model after an engine took it: refused at the change, by name.

The engine lays out the model's parameters once, at initialize (groups, homes, hooks, dtype, device
and memory order), and from then on the values are its own: a parameter holds an empty placeholder
outside its module's use ([Note: Binding parameters] in groups/shard_group.py). Three kinds of
change would otherwise be lost or ignored without a word, where plain PyTorch applies them:

- Conversions: `model.half()`, `.double()`, `.bfloat16()`, `.to(dtype)`, `.to(other device)`,
  `.to(memory_format=...)` converted the placeholders, and the next binding put the engine's fp32
  (compute dtype) values back: the model trained in fp32 on the engine's device as before. They all
  go through `Module._apply`, which each held module gets as an instance attribute here
  (`ConversionCheck`): it applies the conversion to a tiny tensor shaped like each parameter of the
  module's subtree (dtype, device, number of dimensions and memory order as the engine computes
  it), and refuses before anything changes if one would come out different. A conversion that
  changes no parameter (`model.to(engine_device)`, `model.float()` of an fp32 engine) goes on, so
  the model's buffers move as they do in plain PyTorch.
- Registrations: a parameter registered or replaced (`module.weight = nn.Parameter(...)`,
  `register_parameter`, `weight_norm` added), or a submodule holding parameters the engine does
  not hold (a new head): the new tensors were trained by nothing (their gradients stayed in
  `.grad`), silently, and `full_state_dict()` then failed with a KeyError. A parameter the engine
  holds registered on a module it does not (the ParametrizationList of a parametrization added
  after initialize, a new module given a held weight) would be fetched for none of that module's
  uses. torch's global registration hooks see every such registration (`_refuse_parameter`,
  `_refuse_module`); a parametrization with a right_inverse (weight_norm's) is refused as torch
  begins to build it, before right_inverse fails inside torch on the placeholder
  (`_refuse_parametrization`). `orthogonal()` checks the placeholder's shape before it builds
  anything, so it still fails with torch's own "Expected a matrix".
- Writes to a placeholder (`model.apply(init_fn)`, a `no_grad` `p.mul_()`, `p.data = t`): seen
  afterwards by each parameter's version counter and data (`ShardGroup.changed_outside`), checked
  by the engine at each forward, backward, step and save; writes to a bound parameter at its
  eviction (`ShardGroup.changed_in_place`).

[Note: In-place ops on p.data]
`p.data` is a new tensor over p's memory with a version counter of its own, so an in-place op on it
(WGAN's `p.data.clamp_(-c, c)` and DINO's momentum teacher `p_t.data.mul_(m).add_(...)` in the
loop, a codebook's `w.data[i] = ...` in forward) moved nothing the engine compares: outside use it
changed the empty placeholder (nothing), in use the device copy the eviction drops, and the
weights went on as if it never ran, where plain PyTorch's follow it. A held parameter's class is
HeldParameter while its engine is open: its `.data` is `p.detach()`, the same memory and metadata
with p's version counter, so such an op moves p's `_version` and is refused by name as any in-place
write is. A parameter of a subclass of the user's (`class QuantParam(nn.Parameter)`, as quantization
and adapter libraries have) takes a class derived from both, made once per class (`held_class`):
the user's class first, so its own methods and `__torch_function__` run as before, and `isinstance`
answers as before. The class goes back at close (`let_go`).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from offload_trainer.errors import GradientReadError
from offload_trainer.runtime import model_claims


class ParamForm(NamedTuple):
    """How the engine computes with one parameter: what a conversion must leave as it is."""

    name: str
    dtype: torch.dtype
    device: torch.device
    dims: int
    order: Tuple[int, ...]
    """Its dimensions from the outermost to the innermost in memory (row-major: 0, 1, ...)."""


def memory_order(stride: Tuple[int, ...]) -> Tuple[int, ...]:
    """The dimensions sorted by stride, largest first (ties in dimension order)."""
    return tuple(sorted(range(len(stride)), key=lambda d: -stride[d]))


def _probe(form: ParamForm) -> torch.Tensor:
    """A tensor of 2 elements per dimension with the parameter's dtype, device and memory order."""
    shape = (2,) * form.dims
    stride = [0] * form.dims
    step = 1
    for d in reversed(form.order):
        stride[d] = step
        step *= 2
    return torch.empty_strided(shape, stride, dtype=form.dtype, device=form.device)


def _changes(form: ParamForm, fn: Callable[[torch.Tensor], torch.Tensor]) -> Optional[str]:
    """What `fn` (the function Module._apply is given) would change of a parameter, or None."""
    probe = _probe(form)
    with torch.no_grad():
        out = fn(probe)
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
        return "its shape"
    if out.dtype != form.dtype:
        return f"its dtype from {form.dtype} to {out.dtype}"
    if out.device != form.device:
        return f"its device from {form.device} to {out.device}"
    if form.dims >= 2 and memory_order(out.stride()) != form.order:
        return "its memory format"
    return None


class Holding:
    """The parameters one engine holds, as it computes with them, and what to tell it."""

    def __init__(
        self, forms: Dict[int, ParamForm], closed: Callable[[], bool], forget: Callable[[nn.Parameter], None],
        grads_held: Callable[[], bool] = lambda: False,
    ) -> None:
        self.forms = forms
        """By id of each parameter (the engine keeps them alive while open)."""
        self.closed = closed
        self.forget = forget
        """forget(p): p's values are the engine's again, whatever was written to its placeholder (torch's
        parametrize `set_`s the parameter before it registers it)."""
        self.grads_held = grads_held
        """Whether the engine holds gradients of a step not yet taken, outside a backward: between
        `engine.backward()` and `engine.step()` ([Note: Reads of .grad])."""


_holdings: "weakref.WeakSet[Holding]" = weakref.WeakSet()
"""Every engine's Holding, while its model lives (its modules' ConversionChecks keep it)."""


class ConversionCheck:
    """A held module's `_apply`: refuses a conversion that would change how one of its parameters is
    computed with, else runs the module's own `_apply` (see the module docstring)."""

    def __init__(self, module: nn.Module, holding: Holding) -> None:
        self.module = weakref.ref(module)
        self.holding = holding

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        module = self.module()
        assert module is not None, "a module's own _apply outlives it"
        if not self.holding.closed():
            for p in module.parameters(recurse=recurse):
                form = self.holding.forms.get(id(p))
                what = _changes(form, fn) if form is not None else None
                if what is not None:
                    raise ValueError(
                        f"a conversion of {type(module).__name__} (model.half(), .double(), .to(dtype, device or "
                        f"memory_format), ...) after offload_trainer.initialize would change {what} for parameter "
                        f"{form.name!r}, which the engine laid out at initialize (it would keep computing as before, "
                        "silently): choose the compute dtype with precision.compute_dtype and the device with "
                        "initialize(..., device=...), and convert the model before initialize"
                    )
        return type(module)._apply(module, fn, recurse)


class HeldParameter(nn.Parameter):
    """The class of a parameter an open engine holds: its `.data` shares its version counter ([Note:
    In-place ops on p.data]). Everything else is nn.Parameter's (or the user's class's, held_class)."""

    _plain_class: type = nn.Parameter
    """The class the parameter had before the engine held it, and has again at close (let_go)."""

    # Both halves are torch's own C functions: the engine sets `.data` of every parameter of a group
    # at each acquisition, and a setter written in Python took about three times as long.
    data = property(torch.Tensor.detach, torch._C.TensorBase.data.__set__)  # type: ignore[assignment,attr-defined]

    @property  # type: ignore[override]
    def grad(self) -> Optional[torch.Tensor]:
        """`.grad` as torch's, but refused where the engine holds this parameter's gradient of the step in
        progress ([Note: Reads of .grad])."""
        grad = torch._C.TensorBase.grad.__get__(self)  # type: ignore[attr-defined]
        if grad is None and self.requires_grad:
            _refuse_grad_read(self)
        return grad

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        torch._C.TensorBase.grad.__set__(self, value)  # type: ignore[attr-defined]

    @grad.deleter
    def grad(self) -> None:
        torch._C.TensorBase.grad.__delete__(self)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return "Parameter containing:\n" + repr(torch.Tensor.detach(self).requires_grad_(self.requires_grad))

    def __reduce_ex__(self, proto: Any) -> Any:
        """Pickled (torch.save) as nn.Parameter pickles, its values alone: bound, a parameter views its
        group's device copy, and pickling saves a view's whole storage (every parameter of the group)."""
        rebuild, args = nn.Parameter.__reduce_ex__(self, proto)
        data = args[0]
        if data.untyped_storage().nbytes() != data.numel() * data.element_size():
            args = (data.clone(),) + tuple(args[1:])
        return rebuild, args

    def __deepcopy__(self, memo: Dict[int, Any]) -> nn.Parameter:
        """A copy no engine holds: an nn.Parameter, as plain PyTorch's copy is (nn.Parameter's keeps the class)."""
        copied = nn.Parameter.__deepcopy__(self, memo)
        copied.__class__ = type(self)._plain_class
        return copied


def _refuse_grad_read(param: nn.Parameter) -> None:
    """GradientReadError where the engine holds `param`'s gradient of the step in progress.

    [Note: Reads of .grad]
    The engine hands each gradient to its home as autograd finishes it, so `.grad` of a parameter it
    holds is None between `engine.backward()` and `engine.step()`, where plain PyTorch's holds the
    gradient. What reads it there computed from nothing, silently: `torch.nn.utils.clip_grad_norm_(
    model.parameters(), max_norm)` returned 0 and clipped nothing (a loop that logs that norm, or that
    left `optimizer.grad_clip_norm` unset to clip itself, trained unclipped), and `model.zero_grad()`
    dropped nothing. Such a read raises here instead, naming the parameter and the engine's ways:
    `optimizer.grad_clip_norm` (step() clips by the total norm clip_grad_norm_ computes, bitwise on one
    rank), `engine.stats().grad_norm` after step(), `engine.lr_optimizer.zero_grad()`. Only a None read
    looks further (the engine's own reads in its gradient hooks find the gradient autograd just wrote),
    and only of a parameter that trains, outside a backward, with a step's gradient held: a frozen
    parameter's reads None, as in plain PyTorch, and so does every one after step(), as after plain
    PyTorch's `zero_grad()`."""
    for holding in list(_holdings):
        form = holding.forms.get(id(param))
        if form is not None and not holding.closed() and holding.grads_held():
            raise GradientReadError(
                f"parameter {form.name!r} has no .grad between engine.backward() and engine.step(): the offload "
                "engine keeps the step's gradients in their homes (sharded, maybe on NVMe), so "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) would return 0 and clip nothing, and "
                "model.zero_grad() would drop nothing. Clip with optimizer.grad_clip_norm (engine.step() clips "
                "by the same total norm) and read that norm in engine.stats().grad_norm after step(); drop the "
                "step's gradients with engine.lr_optimizer.zero_grad()"
            )


@functools.lru_cache(maxsize=None)
def held_class(cls: type) -> type:
    """The class a parameter of class `cls` (nn.Parameter or a subclass) takes while an engine holds it:
    HeldParameter, or for a subclass of the user's one derived from both, made once ([Note: In-place ops
    on p.data])."""
    if cls is nn.Parameter:
        return HeldParameter
    return type(cls.__name__, (cls, HeldParameter), {"_plain_class": cls, "__module__": cls.__module__})


def hold(
    model: nn.Module, forms: Dict[int, ParamForm], closed: Callable[[], bool], forget: Callable[[nn.Parameter], None],
    params: Sequence[nn.Parameter], grads_held: Callable[[], bool] = lambda: False,
) -> None:
    """Give every module of `model` (claimed by model_claims.claim) the conversion check, and start
    refusing registrations on held modules and of held parameters (torch's global hooks, put on once
    per process); `params` (the engine's) become HeldParameters ([Note: In-place ops on p.data])."""
    holding = Holding(forms, closed, forget, grads_held)
    _holdings.add(holding)
    for module in model.modules():
        module.__dict__["_apply"] = ConversionCheck(module, holding)
    _register_hooks_once()
    for p in params:
        if issubclass(type(p), nn.Parameter) and not isinstance(p, HeldParameter):
            p.__class__ = held_class(type(p))


def let_go(params: Sequence[nn.Parameter]) -> None:
    """The engine closed: `params` have the classes they had before hold() again."""
    for p in params:
        if isinstance(p, HeldParameter):  # hooks.UnresidentParameter too, a subclass
            p.__class__ = type(p)._plain_class


def _open_claim(module: nn.Module) -> Optional[str]:
    """The name of `module` in a model an open engine holds, or None."""
    claim = model_claims.claim_of(module)
    if claim is None or claim.closed():
        return None
    return claim.name


def _refuse_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
    where = _open_claim(module)
    if where is None:
        _refuse_held_elsewhere(module, param)
        return
    if name in module._parameters and module._parameters[name] is param:
        return  # the parameter it has
    qualified = f"{where}.{name}" if where else name
    raise ValueError(
        f"parameter {qualified!r} registered after offload_trainer.initialize (module.{name} = nn.Parameter(...), "
        "register_parameter, a parametrization or weight_norm added): the engine laid out the model's parameters "
        "at initialize and would neither fetch nor train it (nor keep the one it replaces); build the model "
        "complete before initialize, or set values with engine.load_safetensors"
    )


def _refuse_held_elsewhere(module: nn.Module, param: Optional[nn.Parameter]) -> None:
    """Refuse a parameter an open engine holds registered on `module`, which no open engine holds."""
    if param is None:
        return
    for holding in list(_holdings):
        form = holding.forms.get(id(param))
        if form is not None and not holding.closed():
            holding.forget(param)
            raise ValueError(
                f"parameter {form.name!r}, which an offload_trainer engine holds, registered on a "
                f"{type(module).__name__} after initialize (a parametrization added, or the weight given to a new "
                "module): the engine fetches it only for the modules it laid out at initialize; add parametrizations "
                "and build modules before initialize"
            )


def _refuse_parametrization(module: nn.Module) -> None:
    """Refuse a parametrization of a parameter an open engine holds, as torch begins to build it.

    torch's ParametrizationList registers the parametrization modules first, then calls their
    right_inverse on the parameter (weight_norm's, spectral_norm's): on the empty placeholder that
    fails inside torch ("cannot reshape tensor of 0 elements"), before the held parameter's own
    registration (_refuse_held_elsewhere) could name it. So the registration of the first module
    looks at the parameter the list is being built for: its __init__'s `original`, in the caller's
    frame."""
    if not isinstance(module, parametrize.ParametrizationList) or "original" in module._parameters:
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code is _PARAMETRIZATION_INIT and frame.f_locals.get("self") is module):
        frame = frame.f_back
    original = frame.f_locals.get("original") if frame is not None else None
    for holding in list(_holdings):
        form = holding.forms.get(id(original))
        if form is not None and not holding.closed():
            raise ValueError(
                f"a parametrization added to parameter {form.name!r} after offload_trainer.initialize "
                "(register_parametrization, weight_norm, spectral_norm): the engine laid out the "
                "model's parameters at initialize and holds their values in its homes; add parametrizations "
                "before initialize"
            )


def _refuse_module(module: nn.Module, name: str, submodule: Optional[nn.Module]) -> None:
    _refuse_parametrization(module)
    where = _open_claim(module)
    if where is None or submodule is None or module._modules.get(name) is submodule:
        return
    claim = model_claims.claim_of(module)
    assert claim is not None
    foreign = [
        n for n, m in submodule.named_modules()
        if m._parameters and (model_claims.claim_of(m) is None or model_claims.claim_of(m).closed is not claim.closed)
    ]
    if not foreign:
        return  # no parameters, or only this engine's (a module of the model wrapped, moved)
    qualified = f"{where}.{name}" if where else name
    raise ValueError(
        f"module {qualified!r} ({type(submodule).__name__}) added after offload_trainer.initialize holds parameters "
        "the engine does not (a new head, say): they would be trained by nothing; add it to the model before "
        "initialize (freeze it there if it is not to be trained)"
    )


_PARAMETRIZATION_INIT = parametrize.ParametrizationList.__init__.__code__
_hooks_registered = False


def _register_hooks_once() -> None:
    global _hooks_registered
    if _hooks_registered:
        return
    from torch.nn.modules import module as torch_module

    torch_module.register_module_parameter_registration_hook(_refuse_parameter)
    torch_module.register_module_module_registration_hook(_refuse_module)
    _hooks_registered = True


__all__ = ["ConversionCheck", "HeldParameter", "Holding", "ParamForm", "held_class", "hold", "let_go", "memory_order"]
