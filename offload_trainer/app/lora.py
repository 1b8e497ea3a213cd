"""LoRA through PEFT: the model wrapped with adapters before the engine takes it, the base frozen.

    lora = LoraModel.wrap(model, cfg.lora, seed)        # peft.get_peft_model; model built on meta
    engine = initialize(lora.model, cfg, init_fn=lora.init_fn(base_init))
    engine.load_safetensors(lora.weights(checkpoint))   # the base's weights under the wrapped names
    engine.export_safetensors(path, dtype, stored_as=lora.merged(then))   # or lora.adapter_only

PEFT freezes every base parameter (requires_grad=False), so the engine keeps no gradient or
optimizer state for them and may page them anywhere like any parameter; only `lora_A`/`lora_B`
train. An adapter's initial values do not depend on the order modules are built in: A is drawn
(PEFT's kaiming-uniform bound, 1/sqrt(fan_in)) from a generator seeded by the run's seed and the
parameter's name, B is zero, so the adapted model starts as the base model.

Export, one group of parameters at a time as the engine streams them: merged (W + B @ A * alpha/r,
computed in fp32, under the base model's names) or the adapters alone (PEFT's saved names).
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from offload_trainer.app.run_config import LoraConfig, LoraExport
from offload_trainer.runtime.persist.export import StoredAs
from offload_trainer.runtime.persist.safetensors_load import WeightSource, WeightUnit

ADAPTER = "default"
"""PEFT's adapter name."""


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ValueError(
            "[lora] is set (lora.rank > 0) but the peft package is not installed: pip install 'offload-trainer[lora]', "
            "or set lora.rank = 0"
        ) from None
    return peft


class LoraModel:
    """A model wrapped with PEFT LoRA adapters, and the names that map it back to the base model."""

    def __init__(self, model: nn.Module, base_names: Dict[str, str], layers: Dict[str, Tuple[float, bool]], seed: int):
        self.model = model
        self.base_names = base_names
        """Wrapped parameter name -> the base model's name, for every base parameter."""
        self.layers = layers
        """Adapted module's wrapped name -> (scaling alpha / r, fan_in_fan_out)."""
        self.seed = seed

    @classmethod
    def wrap(cls, model: nn.Module, config: LoraConfig, seed: int, causal_lm: bool = True) -> "LoraModel":
        peft = require_peft()
        base: Dict[int, List[str]] = {}  # a tied parameter (tie_word_embeddings) has several names
        for n, p in model.named_parameters(remove_duplicate=False):
            base.setdefault(id(p), []).append(n)
        _refuse_rank_past_full(model, config)  # before PEFT allocates r x (in + out) for each adapter
        peft_config = peft.LoraConfig(
            r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
            target_modules=list(config.target_modules) or None, task_type="CAUSAL_LM" if causal_lm else None,
        )
        try:
            with warnings.catch_warnings():  # PEFT reads a property transformers 5 deprecates: not the user's to fix
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
                wrapped = peft.get_peft_model(model, peft_config)
        except KeyError:  # PEFT looks up a default target for the config's model_type; the built-in has none
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)} - {"lm_head"})
            raise ValueError(
                f"lora.target_modules={list(config.target_modules)}: PEFT has no default adapted modules for this "
                f"model; name some of its nn.Linear modules, e.g. lora.target_modules = {json.dumps(linear[:4])}"
            ) from None
        except ValueError as e:
            raise ValueError(
                f"lora.target_modules={list(config.target_modules)} does not fit the model "
                f"({' '.join(str(e).split())[:300]}); "
                "name some of its nn.Linear modules, e.g. [\"q_proj\", \"v_proj\"]"
            ) from None
        from peft.tuners.lora.layer import Linear as LoraLinear, LoraLayer

        # PEFT keeps the modules' order, so the k-th name of a tied parameter in the wrapped model is its k-th
        # in the base: the embedding stays the embedding, the head the head (by id alone, both became one)
        base_names: Dict[str, str] = {}
        seen: Dict[int, int] = {}
        for n, p in wrapped.named_parameters(remove_duplicate=False):
            if id(p) in base:
                k = seen[id(p)] = seen.get(id(p), -1) + 1
                base_names[n] = base[id(p)][k]
        layers: Dict[str, Tuple[float, bool]] = {}
        for name, module in wrapped.named_modules():
            if isinstance(module, LoraLayer):
                if not isinstance(module, LoraLinear):
                    raise ValueError(
                        f"lora.target_modules matches {name!r}, a {type(module.get_base_layer()).__name__}: only "
                        "linear layers are supported; name linear modules only"
                    )
                layers[name] = (float(module.scaling[ADAPTER]), bool(module.fan_in_fan_out))
        if config.export is LoraExport.MERGED:
            _refuse_merging_into_tied(wrapped, layers, base_names)
        return cls(wrapped, base_names, layers, seed)

    # -- initial values ------------------------------------------------------------------------

    def initial(self, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
        """An adapter parameter's initial value (see the module docstring)."""
        if ".lora_B." in name:
            return torch.zeros(shape)
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)

    def init_fn(self, base_init: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        """The engine's init_fn: adapters as `initial` gives them, every other module as `base_init`."""
        names = {id(m): n for n, m in self.model.named_modules()}
        adapter_modules = {
            id(m) for n, m in self.model.named_modules() if n.endswith((f".lora_A.{ADAPTER}", f".lora_B.{ADAPTER}"))
        }

        def init(module: nn.Module) -> None:
            if id(module) not in adapter_modules:
                base_init(module)
                return
            with torch.no_grad():
                for local, p in module._parameters.items():
                    if p is not None:
                        p.copy_(self.initial(f"{names[id(module)]}.{local}", tuple(p.shape)))

        return init

    def weights(self, source: WeightSource) -> WeightSource:
        """A base model's weight source as one for the wrapped model (the adapters' initial values included)."""
        return _WrappedSource(self, source)

    # -- export --------------------------------------------------------------------------------

    def adapter_only(self, params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A group's adapter parameters under the names PEFT saves them with (a runtime stored_as hook)."""
        return {n.replace(f".{ADAPTER}.", "."): t for n, t in params.items() if ".lora_A." in n or ".lora_B." in n}

    def merged(self, then: Optional[StoredAs]) -> StoredAs:
        """A stored_as hook: adapters merged into their base weights, every name the base model's, then
        `then` (the base model's own layout). A merged weight is written with the group that completes
        it (its base weight, A and B may lie in different groups)."""
        pending: Dict[str, Dict[str, torch.Tensor]] = {}

        def stored_as(params: Dict[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
            out: Dict[str, torch.Tensor] = {}
            for name, t in params.items():
                layer, part = self._lora_part(name)
                if layer is None:
                    out[self.base_names[name]] = t
                    continue
                parts = pending.setdefault(layer, {})
                parts[part] = t
                if len(parts) == 3:
                    scaling, transpose = self.layers[layer]
                    delta = parts["B"].float() @ parts["A"].float() * scaling
                    weight = parts["W"]
                    merged = weight.float() + (delta.T if transpose else delta)
                    out[self.base_names[f"{layer}.base_layer.weight"]] = merged.to(weight.dtype)
                    del pending[layer]
            return then(out) if then is not None else out

        return stored_as

    def _lora_part(self, name: str) -> Tuple[Optional[str], str]:
        suffixes = ((".base_layer.weight", "W"), (f".lora_A.{ADAPTER}.weight", "A"), (f".lora_B.{ADAPTER}.weight", "B"))
        for suffix, part in suffixes:
            if name.endswith(suffix) and name[: -len(suffix)] in self.layers:
                return name[: -len(suffix)], part
        return None, ""

    def trainable_names(self) -> List[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]


def _refuse_rank_past_full(model: nn.Module, config: LoraConfig) -> None:
    """lora.rank above min(in, out) of every module it may adapt: each adapter's update B @ A has rank at most
    min(in, out) of its weight, so a larger rank changes nothing but its size, r x (in + out) numbers. PEFT
    takes any rank and allocates it (lora.rank = 10**9 ended in torch's allocator error, a traceback). The
    modules are lora.target_modules' (names or name suffixes), or every linear layer when it is empty."""
    targets = config.target_modules
    full: Tuple[int, str, Tuple[int, ...]] = (0, "", ())
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        linear = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # transformers' GPT-2 layer
        if not linear or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if targets and not any(name == t or name.endswith(f".{t}") for t in targets):
            continue
        full = max(full, (min(weight.shape), name, tuple(weight.shape)))
    bound, name, shape = full
    if bound and config.rank > bound:
        raise ValueError(
            f"lora.rank={config.rank} is above the full rank of every module it adapts (at most {bound}: {name!r} "
            f"is {shape[0]} x {shape[1]}), and an adapter's update has no more rank than its weight: set lora.rank "
            f"to at most {bound} (8 to 64 is usual), or lora.rank = 0 to train every parameter"
        )


def _refuse_merging_into_tied(wrapped: nn.Module, layers: Dict[str, Tuple[float, bool]], base_names: Dict[str, str]) -> None:
    """An adapted layer whose weight is tied to another name (an LM head under tie_word_embeddings) cannot be
    merged: the export stores the tied tensor once, so the merged head would be the embedding as it was and
    the adapter lost (and merged into both, it would change the embedding too)."""
    names_of: Dict[int, List[str]] = {}
    for n, p in wrapped.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(base_names.get(n, n))
    for layer in layers:
        tied = names_of[id(wrapped.get_parameter(f"{layer}.base_layer.weight"))]
        if len(tied) > 1:
            here = base_names[f"{layer}.base_layer.weight"]
            others = [n for n in tied if n != here]
            raise ValueError(
                f"lora.target_modules adapts {here.rsplit('.', 1)[0]!r}, whose weight is tied to {others[0]!r} (one "
                "tensor: the config's tie_word_embeddings), so the adapter cannot be merged into it for "
                "lora.export = \"merged\"; leave that module out of lora.target_modules, or set lora.export = \"adapter\""
            )


class _WrappedSource:
    """The base model's WeightSource under the wrapped model's names, plus a unit per adapter parameter."""

    def __init__(self, lora: LoraModel, source: WeightSource) -> None:
        self._source = source
        self._lora = lora
        to_wrapped = {base: wrapped for wrapped, base in lora.base_names.items()}
        self._to_wrapped = to_wrapped
        self._units: Dict[WeightUnit, Optional[WeightUnit]] = {}
        for unit in source.units():
            renamed = WeightUnit(tuple((to_wrapped.get(n, n), s) for n, s in unit.shapes), unit.origin)
            self._units[renamed] = unit
        for name, p in lora.model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                self._units[WeightUnit(((name, tuple(p.shape)),), "LoRA initial values")] = None

    def units(self) -> Sequence[WeightUnit]:
        return list(self._units)

    def problems(self) -> Sequence[str]:
        return list(self._source.problems())

    def read(self, unit: WeightUnit) -> Mapping[str, torch.Tensor]:
        original = self._units[unit]
        if original is None:
            ((name, shape),) = unit.shapes
            return {name: self._lora.initial(name, shape)}
        return {self._to_wrapped.get(n, n): t for n, t in self._source.read(original).items()}
