"""The hooks of hooks.py: saved tensors in a group's device copy are rebuilt from the copy the
engine gives at unpack; a graph dropped without backward is freed (no cycle through a saved
output); a module's backward acquires its groups before it runs, in nesting order,
whatever the model does to the module's output afterwards (bitwise equal to plain PyTorch)."""

from __future__ import annotations

import gc
import weakref
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch import nn

from offload_trainer.runtime.hooks import HookCallbacks, Hooks
from offload_trainer.runtime.storage_identity import storage_key
from tests.offload_trainer.runtime.test_module_structures import VOCAB, config, train_and_compare


class _SavedOnly(HookCallbacks):
    """Callbacks for the saved-tensor hooks alone: one group (index 3) whose device copy is `copy`."""

    def __init__(self, copy: torch.Tensor) -> None:
        self.copy = copy
        self.unpacked: List[int] = []
        self.resident: Dict[int, int] = {storage_key(copy): 3}

    def saved_tensor_sources(self) -> Tuple[Dict[int, int], Callable[[int], torch.Tensor]]:
        def copy_for_unpack(group: int) -> torch.Tensor:
            self.unpacked.append(group)
            return self.copy

        return self.resident, copy_for_unpack


def test_a_saved_tensor_in_a_device_copy_is_rebuilt_from_the_copy_given_at_unpack() -> None:
    slot = torch.arange(10, dtype=torch.float32)
    weight = nn.Parameter(torch.empty(0))
    weight.data = slot[2:6].view(2, 2)  # bound into the group's device copy, as ShardGroup binds
    x = torch.randn(2, 2, requires_grad=True)
    callbacks = _SavedOnly(slot)
    with Hooks(nn.Module(), {}, [], callbacks).saved_tensors():
        y = (x * weight).sum()
    # The group moved (evicted, loaded again elsewhere): backward must read the new copy, and the
    # activation x (not in any device copy) must come back as it was.
    moved = torch.arange(10, dtype=torch.float32) * 10
    callbacks.copy = moved
    slot.zero_()
    y.backward()
    assert callbacks.unpacked == [3]  # only the weight was stored by position
    assert torch.equal(x.grad, moved[2:6].view(2, 2))
    assert torch.equal(weight.grad, x.detach())


def test_a_tensor_outside_every_device_copy_is_saved_as_it_is() -> None:
    callbacks = _SavedOnly(torch.zeros(4))
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with Hooks(nn.Module(), {}, [], callbacks).saved_tensors():
        y = (a * b).sum()
    y.backward()
    assert callbacks.unpacked == []
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())



class _Wrapped(torch.Tensor):
    """A wrapper tensor subclass, made as DTensor and torchao's tensors are
    (`_make_wrapper_subclass`): its storage has no bytes. Every op on it runs on the tensor inside."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "_Wrapped":
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        def unwrap(t):  # type: ignore[no-untyped-def]
            return t.inner if isinstance(t, _Wrapped) else t

        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class _SavesAWrapperTensor(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h * _Wrapped(h.detach() + 1)).sum()  # the product saves the wrapper for h's gradient


def test_a_saved_wrapper_tensor_subclass_trains_bitwise() -> None:
    """A tensor subclass that wraps another has a storage without bytes: the pack hook read its
    data pointer ("Attempted to access the data pointer on an invalid python storage") and the
    forward failed, where plain PyTorch trains the model. The hooks key storages by their
    StorageImpl (storage_identity.py), which such a storage has too."""
    import copy

    import offload_trainer as ot

    torch.manual_seed(0)
    model = _SavesAWrapperTensor(8)
    ref = copy.deepcopy(model)
    opt_cfg = ot.OptimizerConfig(lr=1e-2, weight_decay=0.0, grad_clip_norm=None)
    opt = torch.optim.AdamW(ref.parameters(), lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps,
                            weight_decay=0.0, fused=True)
    cfg = ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host"}, optimizer=opt_cfg)
    xs = [torch.randn(4, 8) for _ in range(2)]
    with ot.initialize(model, cfg) as engine:
        for x in xs:
            ref(x).backward()
            opt.step()
            opt.zero_grad()
            engine.backward(engine(x))
            engine.step()
        state = engine.full_state_dict()
    assert all(torch.equal(p.detach(), state[n]) for n, p in ref.named_parameters())


class _ChangesSavedActivation(nn.Module):
    """sigmoid saves its output, which the forward then changes in place: plain PyTorch refuses the
    backward ("modified by an inplace operation") rather than compute gradients from the new values."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).sigmoid()
        h.mul_(2)
        return self.b(h).sum()


def test_a_saved_tensor_changed_in_place_is_refused_as_plain_pytorch_refuses_it(tmp_path) -> None:
    """[Note: Saved tensors changed in place]: autograd makes its version check only for tensors it
    keeps itself, none under saved-tensor hooks, so the engine's hooks make it; before, the engine
    trained on the changed values with no error."""
    import offload_trainer as ot

    torch.manual_seed(0)
    model = _ChangesSavedActivation(8)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        model(x).backward()
    cfg = ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host"})
    with ot.initialize(model, cfg) as engine:
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as held:
            engine.backward(engine(x))
    assert "is at version 1; expected version 0 instead" in str(plain.value)
    assert "is at version 1; expected version 0 instead" in str(held.value)
    assert "[torch.FloatTensor [4, 8]]" in str(held.value)

def test_a_graph_dropped_without_backward_is_freed() -> None:
    """tanh saves its output; kept as the pack hook got it, that tensor held tanh's own node, a
    cycle Python's collector cannot see: a forward whose graph was dropped without backward kept it
    (and everything it saved) for good. Saved tensors that require grad are kept detached; backward
    still gets the values and the gradient of a saved output (twice through tanh, and exp)."""
    callbacks = _SavedOnly(torch.zeros(4))
    x = torch.randn(1000, requires_grad=True)
    with Hooks(nn.Module(), {}, [], callbacks).saved_tensors():
        h = torch.tanh(x)
        y = torch.tanh(h).exp().sum()
    freed = weakref.ref(h)
    del h, y
    gc.collect()
    assert freed() is None, "the graph of a forward without backward is still alive"
    with Hooks(nn.Module(), {}, [], callbacks).saved_tensors():
        y = torch.tanh(torch.tanh(x)).exp().sum()
    y.backward()
    expected = x.detach().clone().requires_grad_(True)
    torch.tanh(torch.tanh(expected)).exp().sum().backward()
    assert torch.equal(x.grad, expected.grad)


class Inner(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Outer(nn.Module):
    """Has a parameter of its own and returns its child's output as it is (the same tensor)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.inner = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.scale)


class NestedLM(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Inner(dim), Inner(dim)])
        self.outer = Outer(dim)  # outside the blocks: a group for it and one for its child
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.outer(h))


def test_an_enclosing_module_acquires_before_the_child_whose_output_it_returns() -> None:
    torch.manual_seed(0)
    engine = train_and_compare(NestedLM(), config(lookahead=1))
    names = [g.plan.name for g in engine.groups]
    trace = [names[g] for g in engine.order.trace]
    backward = trace[trace.index("head") + 1 :]
    # Outer's backward starts first (its output is the last thing its child computed): its groups
    # are acquired before its child's, as for any module and the modules inside it.
    assert backward.index("outer") < backward.index("outer.inner"), trace


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)  # the last op saves nothing, so its output may be changed in place


class InPlaceLM(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Residual(dim) for _ in range(3)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
            h.mul_(0.5)  # the module's output, changed in place after its forward hook ran
        return self.head(h)


def test_a_module_output_changed_in_place_afterwards_trains_bitwise() -> None:
    torch.manual_seed(0)
    engine = train_and_compare(InPlaceLM(), config(lookahead=2))
    assert engine.stats().unpack_refetches == 0  # each block's backward found its group acquired


def test_an_engine_whose_forward_had_no_backward_is_freed_after_close() -> None:
    """An evaluation loss computed with grad enabled: its graph, and the engine once closed, go."""
    import offload_trainer as ot

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), Inner(8), Inner(8), nn.Linear(8, VOCAB))
    with ot.initialize(model, config()) as engine:
        for _ in range(2):
            engine(torch.randint(0, VOCAB, (2, 5))).sum()
    freed = weakref.ref(engine)
    del engine
    gc.collect()
    assert freed() is None, "the engine is still alive after close()"


class _Recorded(HookCallbacks):
    """Callbacks that record acquisitions and releases, and hold nothing."""

    def __init__(self) -> None:
        self.events: List[str] = []

    def on_forward_start(self, groups: Tuple[int, ...]) -> None:
        self.events.append(f"acquire {groups}")

    def on_forward_end(self, groups: Tuple[int, ...]) -> None:
        self.events.append(f"release {groups}")

    def in_backward(self) -> bool:
        return False


class ReadsItsHooks(nn.Module):
    """Computes another way when hooks are registered, as torch's TransformerEncoderLayer does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.saw_hooks: List[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.saw_hooks.append(any(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in self.modules()))
        return self.fc(x)


def test_a_module_reading_its_own_hook_dicts_sees_none_of_the_engines() -> None:
    """[Note: Modules that read their own hooks]: its engine hooks (and those of modules inside it) go
    around its call, the pre-hook before the user's pre-hooks, the post-hook after the user's hooks;
    remove() gives the module its own call back."""
    model = nn.Sequential(ReadsItsHooks(), nn.Linear(2, 2))
    callbacks = _Recorded()
    hooks = Hooks(model, {"0": (0,), "1": (1,)}, [], callbacks, entry_uses={"0.fc": (0,)})
    assert "_call_impl" in vars(model[0]) and "_call_impl" in vars(model[0].fc)
    assert "_call_impl" not in vars(model[1]) and len(model[1]._forward_pre_hooks) == 1  # hooked as before
    model(torch.randn(3, 2))
    assert model[0].saw_hooks == [False]
    assert callbacks.events[:2] == ["acquire (0,)", "acquire (0,)"]  # the module, then its entry (holds: None)
    model[0].register_forward_pre_hook(lambda m, args: callbacks.events.append("user pre-hook"))
    model[0].register_forward_hook(lambda m, args, out: callbacks.events.append("user hook"))
    callbacks.events.clear()
    model[0](torch.randn(3, 2))
    assert callbacks.events[0] == "acquire (0,)" and callbacks.events[1] == "user pre-hook"
    assert callbacks.events[-2:] == ["user hook", "release (0,)"]
    hooks.remove()
    assert "_call_impl" not in vars(model[0]) and "_call_impl" not in vars(model[0].fc)
    assert not model[1]._forward_pre_hooks


class _ModelCalls(_SavedOnly):
    """A forward begins at the model's own call only where none runs (as the engine's call begins one)."""

    def __init__(self, copy: torch.Tensor) -> None:
        super().__init__(copy)
        self.running = False
        self.calls: List[str] = []

    def begin_model_call(self) -> bool:
        if self.running:
            return False
        self.running = True
        self.calls.append("begin")
        return True

    def end_model_call(self) -> None:
        self.running = False
        self.calls.append("end")

    def on_forward_start(self, groups: Tuple[int, ...]) -> None: ...

    def on_forward_end(self, groups: Tuple[int, ...]) -> None: ...

    def in_backward(self) -> bool:
        return False


class Scaled(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0))
        self.weight.data = weight  # bound into the group's device copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.isnan().any():
            raise ValueError("a bad batch")
        return x * self.weight


def test_the_model_called_itself_saves_tensors_as_the_engines_call_does() -> None:
    """[Note: The model called itself]: a forward begins and ends around the model's own call, with the
    saved-tensor hooks, ended also when the forward raised; inside a forward already begun, nothing."""
    slot = torch.arange(4, dtype=torch.float32)
    callbacks = _ModelCalls(slot)
    model = Scaled(slot[:2])
    Hooks(model, {"": (3,)}, [], callbacks)
    x = torch.ones(2, requires_grad=True)
    model(x).sum().backward()
    assert callbacks.calls == ["begin", "end"] and callbacks.unpacked == [3]  # the weight was saved by position
    with pytest.raises(ValueError, match="a bad batch"):
        model(torch.full((2,), float("nan")))
    assert callbacks.calls == ["begin", "end"] * 2 and not callbacks.running
    callbacks.running = True  # the engine's call began the forward
    model(x)
    assert callbacks.calls == ["begin", "end"] * 2


def test_a_global_forward_pre_hook_sees_the_values(tmp_path) -> None:
    """[Note: Reads of unbound parameters]: torch runs global forward pre-hooks before the engine's
    pre-hook; a read of a group module's parameter there makes its group resident (it read the empty
    placeholder, and the engine warned). A global forward hook and a module's own pre-hook registered
    after initialize see the values too."""
    import offload_trainer as ot
    from tests.offload_trainer.runtime.test_engine_parity import TinyLM

    torch.manual_seed(0)
    model = TinyLM(dim=16, n_layers=2)
    block = model.layers[0]  # a group's module: its own call makes the group resident
    seen: Dict[str, List[int]] = {"global pre": [], "global post": [], "own pre": []}

    def note(where: str) -> Callable[..., None]:
        def hook(module: nn.Module, *rest: object) -> None:
            if module is block:
                seen[where].append(module.fc1.weight.numel())
        return hook

    x = torch.randint(0, VOCAB, (2, 8))
    with ot.initialize(model, ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host"})) as engine:
        block.register_forward_pre_hook(note("own pre"))
        handles = [
            nn.modules.module.register_module_forward_pre_hook(note("global pre")),
            nn.modules.module.register_module_forward_hook(note("global post")),
        ]
        try:
            for _ in range(2):
                engine(x)
        finally:
            for handle in handles:
                handle.remove()
    assert seen == {"global pre": [16 * 64] * 2, "global post": [16 * 64] * 2, "own pre": [16 * 64] * 2}
