"""A Hugging Face decoder-only causal LM as a block stack, for the layer-major schedule.

    from offload_trainer.models import hf_block_stack
    stack = hf_block_stack(model)          # e.g. LlamaForCausalLM, GPT2LMHeadModel, Qwen2, Gemma2, GPT-J
    engine.forward_backward_layer_major(micro_batches, loss_fn, stack=stack)

It asks the model for as little as possible (the protocol is runtime/layer_major.BlockStack), and
takes the rest from the model's own code, so that a step computes what `model(input_ids)` does:
- the blocks: the decoder's `ModuleList` (`base_model.layers`, or `.h` as in GPT-2);
- the begin: the base model's own forward, run with stand-ins for the blocks (each notes its
  arguments and returns its hidden state unchanged; the first begin checks that the base model runs
  its blocks back to back, each on the previous one's output, and ends with its final norm); whatever
  the model computes before its blocks
  (embeddings, positions, rotary tables, the causal masks) is done by the model itself, and each
  block is later called with the arguments the base model gave its stand-in: per block, since
  they differ where layers differ (a sliding window's mask, local and global rotary tables);
- the end: the model's own forward again, the base model's output standing for the base model:
  its final norm of the last block's output, then whatever the model does with it (the head, and
  after it a logit soft-cap or scale), so the output is the model's logits.
The base model runs with the config's use_cache, as `model(input_ids)` does: a key/value cache
changes the layout of the keys attention reads (GPT-J's, a contiguous copy), so the last bits of
its gradients. Each block call gets a cache of its own, empty as the plain forward's layer is
when the block runs. Imports nothing (it reads the model's attributes), so transformers stays an
optional extra.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn


_Call = Tuple[int, Tuple[Any, ...], Dict[str, Any]]
"""A block stand-in's call: its block's index, the positional and the keyword arguments."""


class _Reached(Exception):
    """Raised by the last block's stand-in: the base model's forward has given every block its arguments."""


class _Borrowing(nn.Module):
    """A module standing in for `lender` during one forward: it registers none of the lender's modules
    or parameters, and an attribute it lacks is the lender's (a block's `attention_type`, a base
    model's `config`)."""

    def __init__(self, lender: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_lender", lender)  # not registered: the real module keeps its own

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_lender"), name)


class _StandIn(_Borrowing):
    """Block `index` while the begin runs the base model's forward: notes the arguments it is called with and
    returns its hidden state unchanged, in the form the base model takes from its blocks (a tensor, or a
    tuple whose first item it is). Owns no parameters; other attributes are the block's (`attention_type`)."""

    def __init__(self, index: int, block: nn.Module, calls: List[_Call], as_tuple: bool, last: bool) -> None:
        super().__init__(block)
        self._index, self._calls, self._as_tuple, self._last = index, calls, as_tuple, last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._calls.append((self._index, args, kwargs))
        if self._last:
            raise _Reached
        h = args[0] if args else kwargs["hidden_states"]
        return (h,) if self._as_tuple else h


class _BaseOutput(_Borrowing):
    """The base model in the end: its final norm of the last block's output, as the base model's own output."""

    def __init__(self, base: nn.Module, norm: nn.Module, output_type: type, h: torch.Tensor) -> None:
        super().__init__(base)
        object.__setattr__(self, "_norm", norm)  # not registered either: the base keeps it
        self._output_type, self._h = output_type, h

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._output_type(last_hidden_state=self._norm(self._h))


def _is_cache(value: Any) -> bool:
    """A Hugging Face key/value cache (the Cache API, read off its methods: nothing is imported)."""
    return not isinstance(value, torch.Tensor) and hasattr(value, "update") and hasattr(value, "get_seq_length")


class _Context(NamedTuple):
    """One micro-batch's: its input ids (for the end) and each block's arguments besides the hidden state. A
    NamedTuple, so the schedule sees the tensors inside (it refuses any that requires grad)."""

    input_ids: torch.Tensor
    per_block: List[Tuple[Tuple[Any, ...], Dict[str, Any]]]


class HFBlockStack:
    """The begin, blocks and end of a Hugging Face decoder-only causal LM."""

    def __init__(self, model: nn.Module) -> None:
        name = type(model).__name__
        base = getattr(model, "base_model", None)
        prefix = getattr(model, "base_model_prefix", None)
        layers = None if base is None else getattr(base, "layers", getattr(base, "h", None))
        norm = None if base is None else getattr(base, "norm", getattr(base, "ln_f", None))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if (
            not isinstance(layers, nn.ModuleList) or len(layers) == 0 or norm is None or head is None
            or not prefix or model._modules.get(prefix) is not base
        ):
            raise ValueError(
                f"{name} is not a decoder-only causal LM this adapter knows (base_model.layers or .h as a ModuleList, "
                "base_model.norm or .ln_f, get_output_embeddings()): train it micro-batch-major, or pass a "
                "BlockStack of your own to forward_backward_layer_major"
            )
        self.model = model
        self.base = base
        self.prefix = prefix
        self.layers = layers
        self.norm = norm
        self.head = head
        self._index = {id(block): k for k, block in enumerate(layers)}
        self._as_tuple: Optional[bool] = None
        """Whether the base model takes a tuple from its blocks (GPT-J's `outputs[0]`); None until the first begin."""
        self._output_type: Optional[type] = None
        """The class of the base model's output, learned at the first begin."""

    def _run_base(self, input_ids: torch.Tensor, as_tuple: bool, whole: bool) -> Tuple[List[Any], Any]:
        """The base model's forward with stand-ins for its blocks: the calls they noted, and (`whole`: the
        last stand-in returns too, and the final norm runs) the base model's output and the norm's
        (input, output) pairs."""
        calls: List[_Call] = []
        last = len(self.layers) - 1
        stand_ins = nn.ModuleList(
            [_StandIn(k, block, calls, as_tuple, k == last and not whole) for k, block in enumerate(self.layers)]
        )
        normed: List[Tuple[Any, torch.Tensor]] = []
        handle = None
        if whole:
            handle = self.norm.register_forward_hook(lambda m, a, out: normed.append((a[0] if a else None, out)))
        holder = self.base._modules
        key = next(k for k, v in holder.items() if v is self.layers)
        holder[key] = stand_ins  # the dict itself: no registration (a module without parameters, put back below)
        out = None
        try:
            out = self.base(input_ids=input_ids)
        except _Reached:
            pass
        finally:
            holder[key] = self.layers
            if handle is not None:
                handle.remove()
        return calls, (out, normed)

    def _check_calls(self, calls: List[Any]) -> Optional[str]:
        """Why the noted calls are not each block once, in order, on the previous block's output (None if they are)."""
        order = [k for k, _, _ in calls]
        if order != list(range(len(self.layers))):
            return f"it calls its blocks in the order {order[:8]}, not each once in turn"
        for k in range(1, len(calls)):
            _, args, kwargs = calls[k]
            h = args[0] if args else kwargs.get("hidden_states")
            prev_args, prev_kwargs = calls[k - 1][1], calls[k - 1][2]
            prev = prev_args[0] if prev_args else prev_kwargs.get("hidden_states")
            if h is not prev:
                return f"it passes block {k} something other than block {k - 1}'s output"
        return None

    def _learn(self, input_ids: torch.Tensor) -> None:
        """The first begin: how the base model takes its blocks' outputs, and that its output is its final
        norm of the last block's output (what the end computes); ValueError naming what differs."""
        reasons: List[str] = []
        raised: Optional[Exception] = None
        for as_tuple in (False, True):
            try:
                calls, (out, normed) = self._run_base(input_ids, as_tuple, whole=True)
            except Exception as e:  # a tuple where the base model takes a tensor, say: the other form next
                raised = e
                continue
            why = self._check_calls(calls)
            if why is None:
                last = calls[-1][1][0] if calls[-1][1] else calls[-1][2].get("hidden_states")
                hidden = getattr(out, "last_hidden_state", None)
                # The norm's last call (NanoChat's also normalises the embeddings, before the blocks).
                if not normed or normed[-1][0] is not last:
                    why = "its final norm is not applied to the last block's output"
                elif hidden is None or not (
                    hidden is normed[-1][1]
                    or (hidden._base is normed[-1][1] and hidden.shape == normed[-1][1].shape
                        and hidden.stride() == normed[-1][1].stride())  # GPT-J's .view(output_shape)
                ):
                    why = "its output's last_hidden_state is not its final norm's output"
            if why is None:
                self._as_tuple, self._output_type = as_tuple, type(out)
                return
            reasons.append(why)
        if not reasons and raised is not None:
            raise raised  # in either form: the model's own error
        raise ValueError(
            f"{type(self.model).__name__}'s base model does not run its blocks back to back ({reasons[0]}): the "
            "layer-major schedule runs each block on the previous one's output with the arguments the model gives "
            "it; train it micro-batch-major, or pass a BlockStack of your own to forward_backward_layer_major"
        )

    def stack_begin(self, input_ids: torch.Tensor) -> Tuple[torch.Tensor, _Context]:
        if self._as_tuple is None:
            self._learn(input_ids)
        assert self._as_tuple is not None
        calls, _ = self._run_base(input_ids, self._as_tuple, whole=False)
        why = self._check_calls(calls)
        if why is not None:
            raise ValueError(f"{type(self.model).__name__}'s base model no longer runs its blocks back to back: {why}")
        per_block: List[Tuple[Tuple[Any, ...], Dict[str, Any]]] = []
        for _, args, kwargs in calls:
            kwargs = dict(kwargs)
            rest = args[1:] if args else args
            if not args:
                kwargs.pop("hidden_states")
            per_block.append((rest, kwargs))
        first_args, first_kwargs = calls[0][1], calls[0][2]
        h = first_args[0] if first_args else first_kwargs["hidden_states"]
        return h, _Context(input_ids, per_block)

    def stack_blocks(self) -> nn.ModuleList:
        return self.layers

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: _Context) -> torch.Tensor:
        args, kwargs = context.per_block[self._index[id(block)]]
        # A cache of its own per call: the plain forward's layer of it is empty when the block runs, and the
        # block runs again in backward.
        args = tuple(copy.deepcopy(v) if _is_cache(v) else v for v in args)
        kwargs = {key: copy.deepcopy(v) if _is_cache(v) else v for key, v in kwargs.items()}
        out = block(h, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def stack_end(self, h: torch.Tensor, context: _Context) -> torch.Tensor:
        """The logits: the model's own forward over the base model's output (its final norm of `h`)."""
        assert self._output_type is not None, "stack_end before stack_begin"
        holder = self.model._modules
        holder[self.prefix] = _BaseOutput(self.base, self.norm, self._output_type, h)  # put back below
        try:
            out = self.model.forward(input_ids=context.input_ids)
        finally:
            holder[self.prefix] = self.base
        if isinstance(out, torch.Tensor):
            return out
        logits = getattr(out, "logits", None)
        return out[0] if logits is None else logits  # return_dict=False: (logits, ...)


def hf_block_stack(model: nn.Module) -> HFBlockStack:
    """The block stack of a Hugging Face decoder-only causal LM (ValueError if it has none this adapter knows)."""
    return HFBlockStack(model)


__all__ = ["HFBlockStack", "hf_block_stack"]
