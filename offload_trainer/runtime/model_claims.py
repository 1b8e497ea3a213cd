"""Which models an engine may take.

- Not one another engine has taken: initialize() takes ownership of a model's parameters (their
  values move to the engine's homes; the model keeps empty placeholders, for good once the engine
  is closed), so a second initialize() of the same model, or of one of its modules, would
  partition placeholders and train on nothing. The engine claims every module of its model here
  (weakly keyed: a model that is dropped leaves no entry behind), and a claimed module is refused
  with what to do instead. A claimed module also refuses copy.deepcopy and pickling (torch.save of
  the module, an EMA's AveragedModel): either copied the empty placeholders, silently
  ([Note: A held model is not copied]); so do the parameters a closed engine left as placeholders
  (refuse_placeholder_copies).
- Not a torch.compile'd one (refuse_compiled).
- None the engine cannot train (refuse_unsupported_features): complex parameters (its homes are
  real); integer and bool parameters (frozen index tables: buffers hold them); modules that make sparse gradients (nn.Embedding(sparse=True)), which torch.optim.AdamW
  refuses too; parameters a Lazy module has not made yet; embeddings that renormalise their weight
  in place (nn.Embedding(max_norm=...)), a change the engine would lose; TorchScript modules,
  which take no Python hooks; a buffer, a tensor kept as a module's attribute or another parameter
  sharing memory with a parameter (`self.frozen = self.emb.weight.detach()`), which in plain
  PyTorch follows every update of it and here would keep the initial values (refuse_aliases).
  Said up front, naming the module or parameter and the fix, before the model's parameters are
  taken, instead of an error deep in a backward or half-way through initialize(), or silently.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn


class Claim(NamedTuple):
    """A module an engine took."""

    closed: Callable[[], bool]
    """Whether the engine that took it is closed (or gone); one function per engine."""
    name: str
    """Its qualified name in that engine's model ("" for the model itself)."""


_claims: "weakref.WeakKeyDictionary[nn.Module, Claim]" = weakref.WeakKeyDictionary()


def claim_of(module: nn.Module) -> Optional[Claim]:
    """The claim on `module`, if an engine took it."""
    return _claims.get(module)


def claim(model: nn.Module, closed: Callable[[], bool]) -> None:
    """Mark every module of `model` as taken by an engine; `closed()` tells whether it still runs.

    [Note: A held model is not copied]
    copy.deepcopy of a module the engine holds (an EMA's torch.optim.swa_utils.AveragedModel, a
    "best model" kept aside) copied its empty placeholders: a model of size-0 tensors, without a
    word; pickling it (torch.save(model)) failed on a hook's local function, naming neither the
    cause nor the fix. Both look the method up on the instance (copy: `__deepcopy__`; pickle:
    `__reduce_ex__`), so each claimed module gets instance attributes that raise TypeError saying
    what to do: the values are the engine's (engine.full_state_dict(), export_safetensors), or
    copy before initialize. A module without parameters (an activation) gave the engine nothing: a copy
    of it is whole, and it may be in other models too (HF XLM's and OpenAI GPT's `gelu` is one instance
    of the library's, in every such model a process builds), so it keeps its copies."""
    for name, module in model.named_modules():
        _claims[module] = Claim(closed, name)
        if _holds_parameters(module):
            module.__dict__["__deepcopy__"] = _CopyRefusal(type(module).__name__, closed, "copy.deepcopy")
            module.__dict__["__reduce_ex__"] = _CopyRefusal(type(module).__name__, closed, "pickling (torch.save)")


def _holds_parameters(module: nn.Module) -> bool:
    """Whether `module` or a module under it has a parameter, which an engine that took it holds."""
    return any(True for _ in module.parameters())


class _CopyRefusal:
    """An instance's __deepcopy__ or __reduce_ex__ that refuses (see [Note: A held model is not copied])."""

    def __init__(self, what: str, closed: Callable[[], bool], how: str) -> None:
        self.what, self.closed, self.how = what, closed, how

    def __call__(self, *args: object) -> None:
        state = (
            "an engine that is closed took its parameters' values; it holds empty placeholders, for good"
            if self.closed()
            else "its parameters' values are held by an offload_trainer engine; the module holds empty placeholders"
        )
        raise TypeError(
            f"{self.how} of this {self.what}: {state}, so the copy would have no weights. Take the values "
            "from the engine (engine.full_state_dict(), engine.export_safetensors(path)) into a model built "
            "anew, or copy the model before initialize"
        )


def refuse_placeholder_copies(params: Sequence[Tuple[str, nn.Parameter]]) -> None:
    """After the engine closed: copy.deepcopy and pickling (torch.save(p), of a list of them) of each
    of `params` (by name, the parameters it left as empty placeholders) raise TypeError naming it.

    [Note: A closed engine's parameter is not copied]
    While the engine is open a parameter between steps refuses both (hooks.UnresidentParameter); close()
    gives it its own class back (model_changes.let_go), and from then on `torch.save(p)` wrote the
    0-element placeholder without a word, and `copy.deepcopy(p)` made one, while the model itself
    refused both ([Note: A held model is not copied]). Each parameter now gets the module's kind of
    refusal, as instance attributes: it holds its placeholder for good (README). One given values again
    (`p.data = t`, as a forward over it is then allowed: Hooks.refuse_forward) drops its refusal at
    the next copy, which copies those values as any parameter's."""
    for name, param in params:
        for how, attr in (("copy.deepcopy", "__deepcopy__"), ("pickling (torch.save)", "__reduce_ex__")):
            param.__dict__[attr] = _PlaceholderCopyRefusal(name, weakref.ref(param), how, attr)


class _PlaceholderCopyRefusal:
    """A closed engine's parameter's __deepcopy__ or __reduce_ex__ ([Note: A closed engine's parameter is
    not copied]); weak, so that the parameter holds no cycle through its own attribute."""

    def __init__(self, name: str, param: "weakref.ref[nn.Parameter]", how: str, attr: str) -> None:
        self.name, self.param, self.how, self.attr = name, param, how, attr

    def __call__(self, arg: Any) -> Any:
        param = self.param()
        if param is None:  # pragma: no cover - the instance's own attribute outlives it not
            raise ReferenceError(self.name)
        if param.numel() == 0:
            raise TypeError(
                f"{self.how} of parameter {self.name!r}: the offload_trainer engine that held its values is closed, "
                "and it holds an empty placeholder for good, so the copy would have no values; take them before "
                "engine.close() with engine.full_state_dict() (CPU tensors) or engine.export_safetensors(path)"
            )
        for attr in ("__deepcopy__", "__reduce_ex__"):  # given values again: copied as any parameter
            param.__dict__.pop(attr, None)
        return getattr(param, self.attr)(arg)


def refuse_claimed(model: nn.Module) -> None:
    """Raise ValueError if `model` or one of its modules with parameters was given to an engine before (one
    without parameters gave it nothing: a library's shared activation instance is in every model it builds)."""
    for name, module in model.named_modules():
        taken = _claims.get(module)
        if taken is None or not _holds_parameters(module):
            continue
        what = "the model" if not name else f"its module {name!r}"
        if taken.closed():
            raise ValueError(
                f"{what} was given to an engine that is closed: the engine took its parameters' values "
                "and left empty placeholders, so it cannot be trained again; build the model again (load "
                "the weights from engine.export_safetensors or a checkpoint), or keep that engine open"
            )
        raise ValueError(
            f"{what} is held by an engine that is still open: its parameters are that engine's, so a second "
            "engine would train empty placeholders; use the open engine, or close it and build the model again"
        )


def refuse_unsupported_features(model: nn.Module) -> None:
    """Raise ValueError, naming the parameter or module and the fix, for what the engine cannot train:
    a parameter not made yet (lazy), a complex, integer or bool parameter, a module built to make sparse gradients or to
    renormalise its weight in place (max_norm), a TorchScript module, a tensor sharing a parameter's memory."""
    lazy = [name for name, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"parameters {lazy[:3]} are not initialized yet (a Lazy module, nn.LazyLinear say, makes them at its first "
            "forward), and the engine lays out every parameter at initialize: run one forward of the model on a batch "
            "before offload_trainer.initialize"
        )
    complex_names = [name for name, p in model.named_parameters() if p.is_complex()]
    if complex_names:
        raise ValueError(
            f"parameters {complex_names[:3]} are complex, and the engine keeps real (fp32) parameters: keep the real "
            "and imaginary parts as two real parameters and combine them in forward (torch.complex(re, im))"
        )
    # Checked before the model's dtypes (the engine's "pass an fp32 model (model.float())"), which
    # model.float() would not change: it converts floating point parameters only.
    integral = [(name, p.dtype) for name, p in model.named_parameters() if not p.is_floating_point() and not p.is_complex()]
    if integral:
        raise ValueError(
            f"parameters {[n for n, _ in integral[:3]]} are {integral[0][1]}, not floating point: such a parameter "
            "never trains (torch gives gradients to floating point tensors only), and the engine keeps fp32 "
            "parameters: register it as a buffer (module.register_buffer(name, tensor)), which the engine leaves on "
            "the model"
        )
    for name, module in model.named_modules():
        what = repr(name) if name else f"the model ({type(module).__name__})"
        if isinstance(module, torch.jit.ScriptModule):
            raise ValueError(
                f"module {what} is a TorchScript module (torch.jit.script or torch.jit.trace), which runs no Python "
                "hooks, and the engine fetches a module's parameters in its hooks: pass the eager module"
            )
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise ValueError(
                f"module {what} ({type(module).__name__}) is built with max_norm={module.max_norm}, so its forward "
                "renormalises the rows it looks up in place, a change to the weight the engine would lose (its copy of "
                "a parameter is dropped after use): build it with max_norm=None (renormalise out of place in forward: "
                "F.embedding(ids, w) * scale)"
            )
        if getattr(module, "sparse", False) is True and any(p.requires_grad for p in module.parameters(recurse=False)):
            raise ValueError(
                f"module {what} ({type(module).__name__}) is built with sparse=True, so its gradients are sparse; "
                "the engine's optimizer (fused AdamW/SGD over dense shards, as torch.optim.AdamW) takes dense "
                "gradients only: build it with sparse=False"
            )
    refuse_aliases(model)


def refuse_aliases(model: nn.Module) -> None:
    """Raise ValueError for a tensor that shares memory with a parameter of `model` without being it: a
    buffer, a tensor kept as a module attribute (in a plain list, tuple or dict too), or another parameter
    (`nn.Parameter(w.data)`), made from it by `.detach()`, `.data` or a view. In plain PyTorch it follows
    each update of the parameter (the optimizer writes in place); the engine moves the parameter's values
    into its homes and leaves it a placeholder, so the alias would keep the initial values, silently (a
    model reading one trained differently from the first step). The Parameter object itself, kept
    anywhere, is no alias: the engine rebinds it; nor are parameters that are disjoint views of one
    buffer (an LSTM's flattened weights under cuDNN), nor an attribute that a forward pre-hook of its
    module sets anew before every forward and that names it (`hook.name`: torch.nn.utils.spectral_norm
    keeps `weight` as `weight_orig.data` until its hook's first run; weight_norm and pruning do likewise)."""
    spans: "dict[int, list[tuple[int, int, str, torch.Tensor]]]" = {}

    def check(what: str, t: object) -> None:
        span = _span(t) if isinstance(t, torch.Tensor) else None
        if span is None:
            return
        for start, end, name, p in spans.get(span[0], ()):
            if p is not t and start < span[2] and span[1] < end:
                raise ValueError(
                    f"{what} shares memory with parameter {name!r} (a .detach(), .data or a view of it made before "
                    "initialize): plain PyTorch's follows every update of the parameter, but the engine moves the "
                    "parameter into its own memory, so this one would keep the initial values; read the parameter "
                    f"where it is needed (model.{name}, .detach() of it in forward) instead of keeping a second tensor of it"
                )

    for name, p in model.named_parameters():  # each against those before it: the later one names the alias
        check(f"parameter {name!r}", p)
        span = _span(p)
        if span is not None:
            spans.setdefault(span[0], []).append((span[1], span[2], name, p))
    if not spans:
        return
    for name, b in model.named_buffers():
        check(f"buffer {name!r}", b)
    for name, module in model.named_modules():
        rewritten = {getattr(hook, "name", None) for hook in module._forward_pre_hooks.values()}
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules") or attr in rewritten:
                continue
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, torch.Tensor) and not isinstance(item, nn.Parameter):  # a parameter kept is itself
                    check(f"attribute {(name + '.' if name else '') + attr!r}", item)


def _span(t: torch.Tensor) -> "Optional[tuple[int, int, int]]":
    """(storage address, first byte, past the last byte) of the memory `t` covers; None for a tensor
    with no memory of its own to compare (empty, on meta, sparse, a subclass without storage)."""
    if t.device.type == "meta" or not t.numel() or t.is_sparse or t.layout != torch.strided:
        return None
    try:
        base = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (FakeTensor, a functorch wrapper) has none
        return None
    if not base:
        return None
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    first = t.storage_offset() * t.element_size()
    return base, first, first + extent * t.element_size()


def compiled_since(model: nn.Module, hooked: "list[nn.Module]") -> bool:
    """Whether `model` or one of the modules the engine hooks was compiled after initialize
    (`module.compile()`): a check of those modules only, cheap enough for every forward; refuse_compiled
    then names it."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in (model, *hooked))


def refuse_called_compiled() -> None:
    """Raise ValueError when this call comes from code torch.compile compiles (a `torch.compile(model)`
    or `torch.compile(engine)` made after initialize, which the engine cannot see on the model): a
    frame of the wrapper torch.compile puts around a function on the stack (in dynamo's eval_frame.py,
    the one with `cleanups`: `compile_wrapper` in torch 2.11 and 2.13, `_fn` in 2.6, whose
    torch._dynamo.disable wrapper is also `_fn`, without them). Dynamo traced the engine's hooks with
    the parameters' empty placeholders and failed inside inductor ("wrong number of dimensions1 for
    op: input"); the check runs eagerly (dynamo falls back to Python for it), once per call of the
    model and only once dynamo is imported."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == eval_frame.__file__ and "cleanups" in code.co_varnames:
            raise ValueError(
                "the model is called through torch.compile (torch.compile(model) or torch.compile(engine)), which the "
                "engine does not support: its parameters are bound to their resident copies by hooks while each module "
                "runs; call the engine (or the model) uncompiled"
            )
        frame = frame.f_back


def refuse_compiled(model: nn.Module) -> None:
    """torch.compile'd modules are refused: the engine binds each parameter to its group's resident
    copy only while a module that uses it runs, and a compiled graph neither follows that rebinding
    nor runs the hooks that do it as eager code (it failed inside dynamo's guards)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return  # nothing was compiled in this process (and importing dynamo costs seconds)
    OptimizedModule = eval_frame.OptimizedModule
    compiled = "the model" if isinstance(model, OptimizedModule) else next(
        (repr(name or type(model).__name__) for name, m in model.named_modules()
         if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None),
        None,
    )
    if compiled is not None:
        raise ValueError(
            f"{compiled} is compiled with torch.compile, which the engine does not support: its parameters "
            "are bound to their resident copies by hooks while each module runs; pass the model uncompiled "
            "(the module torch.compile was given: model._orig_mod), and do not compile it after initialize"
        )


__all__ = [
    "Claim", "claim", "claim_of", "compiled_since", "refuse_called_compiled", "refuse_claimed", "refuse_compiled",
    "refuse_aliases", "refuse_unsupported_features",
]
