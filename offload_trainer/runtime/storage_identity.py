"""Which storage a tensor views: how the saved-tensor hooks tell a tensor of a group's device copy.

    key = storage_key(t)    # one int for every tensor that shares t's storage, while that storage lives

The key is the address of the tensor's StorageImpl (what `t.untyped_storage()._cdata` reads too), not
the address of its bytes (`t.untyped_storage().data_ptr()`, the key before):

- every tensor autograd saves in a forward goes through it ([Note: Saved-tensor hooks on the hot
  path] in hooks.py): one C call, where the data pointer was two and a Python storage object
  allocated per saved tensor;
- a tensor subclass that wraps others (`torch.Tensor._make_wrapper_subclass`: DTensor, torchao's
  quantized tensors, torch's TwoTensor) has a storage without bytes, whose `data_ptr()` raises
  "Attempted to access the data pointer on an invalid python storage": a model that computed with
  one inside the engine's forward failed there, where plain PyTorch trains it. Its StorageImpl has
  an address like any other, which is no group's device copy.

A device copy's storage lives while its group is READY (the group holds the copy), so no other live
storage can have its key meanwhile; the scheduler enters the key when the group becomes READY and
removes it at the eviction.
"""

from __future__ import annotations

from typing import Callable

import torch

storage_key: Callable[[torch.Tensor], int] = getattr(
    torch._C, "_storage_address", lambda t: t.untyped_storage()._cdata
)
"""The address of `t`'s StorageImpl (torch._C._storage_address, "Gets the memory address of the Tensor's
StorageImpl"; the same value through `untyped_storage()._cdata` where a torch build lacks it)."""

__all__ = ["storage_key"]
