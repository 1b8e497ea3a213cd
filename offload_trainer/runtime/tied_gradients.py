"""TiedGradients: a parameter used in several places (tied weights) gets its gradient summed in place.

    tied = TiedGradients(model)        # the parameters reachable under more than one name
    tied.sum_in_place(loss)            # before loss.backward(): hooks on this graph's nodes only

[Note: Summing a tied parameter's gradient in place]
Autograd adds the gradients that reach one leaf along several edges (a tied embedding: the head's
and the lookup's) in the leaf's input buffer: in place into the first to arrive when nothing else
refers to its memory, else into a new tensor. The head's contribution arrives first and is a view
(TBackward0's transpose of the matmul's result, whose base keeps the storage referenced), so the
sum is a third tensor of the weight's size, and all three are alive at once at the end of
backward: on gpt2-124m three 147 MiB tensors, at the engine's peak RSS. So before backward a hook
goes on every node of the graph that feeds such a leaf, and returns the gradients it made that are
views detached: the same memory without the base's reference, so the first to arrive is the
buffer's alone, the second is added into it, and AccumulateGrad takes the sum as it is (plain
PyTorch keeps the same three tensors). The values are the same bits: one fp32 add of the same two
tensors, in place instead of into a new one; a gradient that requires grad (a double backward's)
keeps its graph and is left as it is. The walk that finds the nodes runs only for a model with
tied parameters, once per backward: on gpt2-124m's graph (904 nodes, 2 of them feeding the
embedding) 1.2 ms in the quietest of three runs on the shared 2-core machine (22 and 53 ms in the
others, a load of about 7 per core). Layer-major's backward puts them on its begin's piece, the one
backward call where both uses of the weight meet ([Note: Tied weights] in layer_major.py).
"""

from __future__ import annotations

from typing import Any, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn

_ACCUMULATE_GRAD = "AccumulateGrad"


def _detach_views(grad_inputs: Sequence[Optional[torch.Tensor]], grad_outputs: Any) -> Optional[Tuple[Any, ...]]:
    """A node's hook: its gradients that are views, detached (the same memory, no base); None (no
    change) when none is."""
    if not any(g is not None and g._is_view() and not g.requires_grad for g in grad_inputs):
        return None
    return tuple(g.detach() if g is not None and g._is_view() and not g.requires_grad else g for g in grad_inputs)


class TiedGradients:
    """The trainable parameters of a model that several modules (or names) share, and the hooks that
    let autograd sum their gradients in place ([Note: Summing a tied parameter's gradient in place])."""

    def __init__(self, model: nn.Module) -> None:
        seen: set = set()
        tied: set = set()
        for _, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen and p.requires_grad:
                tied.add(id(p))
            seen.add(id(p))
        self._tied_ids: FrozenSet[int] = frozenset(tied)
        """id() of each tied parameter (the engine holds the parameters for its whole life)."""

    @property
    def any(self) -> bool:
        return bool(self._tied_ids)

    def sum_in_place(self, *outputs: torch.Tensor) -> int:
        """Put the hook on every node of the graph of `outputs` (what one backward call starts from: a
        loss; layer-major's begin piece, the loss and the begin's output) that feeds a tied parameter's
        AccumulateGrad; returns how many. Nothing to do (no walk) for a model without tied parameters."""
        roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
        if not self._tied_ids or not roots:
            return 0
        tied = self._tied_ids
        feeders: List[Any] = []
        seen = set(roots)
        stack = list(seen)
        while stack:
            node = stack.pop()
            feeds_tied = False
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                if type(nxt).__name__ == _ACCUMULATE_GRAD:
                    feeds_tied = feeds_tied or id(nxt.variable) in tied
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
            if feeds_tied:
                feeders.append(node)
        for node in feeders:
            node.register_hook(_detach_views)
        return len(feeders)


__all__ = ["TiedGradients"]
