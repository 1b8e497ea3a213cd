"""The only place module and autograd hooks are registered.

- forward pre-hook of each hooked module: acquire the groups it needs;
- forward hook: release them, and route the outputs through `_PreBackward`, whose backward
  acquires the same groups before the module's backward runs;
- saved-tensor hooks around the forward: a tensor autograd saves that points into a group's
  device copy is stored as (group, offset, size, stride) and rebuilt on unpack after re-acquiring
  the group, so backward never reads a slot that was reused (see [Note: Binding parameters]);
- post-accumulate-grad hook of each trainable parameter: hand the finished gradient to the
  engine and drop `.grad`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


class _GroupRef:
    """A saved tensor that lives in a group's device copy, stored by position instead of memory.
    (A class with slots rather than a frozen dataclass: one is made per saved parameter view.)"""

    __slots__ = ("group", "offset", "size", "stride")

    def __init__(self, group: int, offset: int, size: Tuple[int, ...], stride: Tuple[int, ...]) -> None:
        self.group = group
        self.offset = offset
        self.size = size
        self.stride = stride


class HookCallbacks:
    """What the hooks call into (implemented by the engine's scheduler and gradient accumulator)."""

    def on_forward_start(self, groups: Sequence[int]) -> None: ...

    def on_forward_end(self, groups: Sequence[int]) -> None: ...

    def on_backward_start(self, groups: Sequence[int]) -> None: ...

    def in_backward(self) -> bool: ...

    def resident_group_of_storage(self, storage_ptr: int) -> Optional[int]:
        """The READY group whose device copy is the storage at `storage_ptr`, if any (called for
        every tensor autograd saves: a dict lookup, nothing more)."""

    def device_copy_for_unpack(self, group: int) -> torch.Tensor: ...

    def on_grad(self, param: nn.Parameter) -> None: ...


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward acquires the module's groups first."""

    @staticmethod
    def forward(ctx: Any, callbacks: HookCallbacks, groups: Tuple[int, ...], *tensors: torch.Tensor) -> Any:
        ctx.callbacks = callbacks
        ctx.groups = groups
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callbacks.on_backward_start(ctx.groups)
        return (None, None) + grads


def _route_outputs(callbacks: HookCallbacks, groups: Tuple[int, ...], output: Any) -> Any:
    if isinstance(output, torch.Tensor):  # the common case, without flattening a tree
        return _PreBackward.apply(callbacks, groups, output)[0] if output.requires_grad else output
    flat, spec = tree_flatten(output)
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return output
    routed = _PreBackward.apply(callbacks, groups, *[flat[i] for i in positions])
    for i, t in zip(positions, routed):
        flat[i] = t
    return tree_unflatten(flat, spec)


class Hooks:
    """Registers every hook of one engine and removes them all on remove()."""

    def __init__(self, model: nn.Module, module_uses: Dict[str, Tuple[int, ...]], params: List[nn.Parameter], callbacks: HookCallbacks):
        self.callbacks = callbacks
        self._handles: List[Any] = []
        modules = dict(model.named_modules())
        for name, groups in module_uses.items():
            module = modules[name]
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(groups)))
            self._handles.append(module.register_forward_hook(self._post_forward(groups)))
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(callbacks.on_grad))

    def _pre_forward(self, groups: Tuple[int, ...]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.callbacks.on_forward_start(groups)

        return hook

    def _post_forward(self, groups: Tuple[int, ...]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            self.callbacks.on_forward_end(groups)
            if torch.is_grad_enabled() and not self.callbacks.in_backward():
                return _route_outputs(self.callbacks, groups, output)
            return None

        return hook

    def saved_tensors(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context to run a forward in, so that saved tensors survive eviction of their group."""
        group_of_storage = self.callbacks.resident_group_of_storage
        device_copy_for_unpack = self.callbacks.device_copy_for_unpack
        strided = torch.strided

        def pack(t: torch.Tensor) -> Any:
            if t.layout is not strided:  # sparse and other layouts have no storage to compare
                return t
            group = group_of_storage(t.untyped_storage().data_ptr())
            if group is None:
                return t
            return _GroupRef(group, t.storage_offset(), t.size(), t.stride())

        def unpack(packed: Any) -> torch.Tensor:
            if type(packed) is not _GroupRef:
                return packed
            return device_copy_for_unpack(packed.group).as_strided(packed.size, packed.stride, packed.offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
