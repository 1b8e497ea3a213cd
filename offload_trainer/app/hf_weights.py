"""A Hugging Face checkpoint's stored tensors as the parameters of the model transformers builds, and back.

    checkpoint = HFCheckpoint(model, sorted(path.glob("*.safetensors")))   # model built on meta
    engine.load_safetensors(checkpoint)                                   # a runtime WeightSource
    engine.export_safetensors(out / "model.safetensors", dtype, stored_as=checkpoint.stored_as)

Recent transformers keep some weights on disk in another layout than the modules hold them: a
Mixtral checkpoint stores each expert's `block_sparse_moe.experts.3.w1.weight`, while the module
holds all experts' gate and up projections in one 3-D `mlp.experts.gate_up_proj`. `from_pretrained`
converts on load and `save_pretrained` converts back, with rules registered per model class or
model type (`transformers.conversion_mapping`: `WeightRenaming` for names, `WeightConverter` with
operations such as `MergeModulelist` and `Concatenate` for layouts) applied by
`transformers.core_model_loading`. This module uses the library's own pieces, not a copy of them:
the rules are found as `from_pretrained` finds them (`get_model_conversion_mapping(model)`), every
stored name is renamed by `rename_source_key`, and the rules' own `convert` builds the parameters.
A model the library has no rules for loads its stored names as they are, and so does every model
under a transformers without this machinery (4.x: its modules hold what its checkpoints store).

Loading is planned from the files' headers alone: the stored tensors that make one converted
parameter (all experts' w1 and w3 for one `gate_up_proj`) form one unit, and the conversion is run
once on meta tensors to learn the names and shapes it gives, so the engine checks every name and
shape before anything is written. Reading a unit reads its stored tensors (memory-mapped), cast to
the parameter's dtype as `from_pretrained` does, and runs the conversion for real: memory holds one
unit, never the model.

Export reverts the conversions that loading used, as `save_pretrained` does for a model from
`from_pretrained` (the library's `revert_weight_conversion`, which reads `model._weight_conversions`,
set here as `from_pretrained` sets it), one group of parameters at a time.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Mapping, Sequence, Set, Tuple

import torch
from torch import nn

from offload_trainer.config import json_text
from offload_trainer.runtime.persist.safetensors_header import check_safetensors_header
from offload_trainer.runtime.persist.safetensors_load import FLOAT_DTYPES, WeightUnit, stored_tensor_problem

_Loader = Callable[[str, str, torch.dtype, Tuple[int, ...]], Callable[[], torch.Tensor]]
"""(path, stored name, dtype, shape) -> what produces that stored tensor when called."""


@dataclass
class _Conversion:
    """The stored tensors that make one unit, and the library's transform that converts them."""

    template: Any
    """A WeightRenaming or WeightConverter with nothing collected (each conversion uses a copy)."""
    first_name: str
    """The model name the library files the unit under (its first target)."""
    dtype: torch.dtype
    """The dtype of that parameter: stored tensors are cast to it before converting, as on load."""
    stored: List[Tuple[str, str, str, str, Tuple[int, ...]]] = field(default_factory=list)
    """(target name, stored name, matched pattern, path, stored shape) of each stored tensor, in the
    library's order (the order its operations stack experts in)."""

    def convert(self, shapes_model: Any, config: Any, loader: _Loader) -> Dict[str, torch.Tensor]:
        """The library's conversion of the stored tensors `loader` gives (meta ones, or read from the files)."""
        transform = copy.deepcopy(self.template)  # convert() consumes what was collected
        for target, key, pattern, path, shape in self.stored:
            transform.add_tensor(target, key, pattern, loader(path, key, self.dtype, shape))
        out = transform.convert(self.first_name, model=shapes_model, config=config)
        return {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}


class _ParameterShapes:
    """The model as the library's operations see it while converting: `get_parameter` gives a meta
    tensor of the parameter's shape (once the engine holds the weights, a module's own parameters are
    empty placeholders); everything else is the model's."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._meta = {
            n: torch.empty(p.shape, dtype=p.dtype, device="meta")
            for n, p in model.named_parameters(remove_duplicate=False)
        }

    def get_parameter(self, name: str) -> torch.Tensor:
        if name not in self._meta:
            raise AttributeError(f"the model has no parameter {name!r}")
        return self._meta[name]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class HFCheckpoint:
    """A Hugging Face model directory's safetensors files as a runtime WeightSource for `model`.

    Build it while the model's parameters are still on the meta device (right after
    `from_config` under `parameters_on_meta()`): it reads the headers, renames and groups every stored
    name, learns each unit's names and shapes, and records on the model the conversions it used (for
    export). Stored tensors that fit nothing are problems the engine refuses before writing anything."""

    def __init__(self, model: nn.Module, paths: "Sequence[str | os.PathLike[str]]") -> None:
        from safetensors import safe_open

        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
        except ImportError:  # transformers 4.x: no conversions on load, stored names are the model's
            get_model_conversion_mapping = WeightConverter = WeightRenaming = None  # type: ignore[assignment]
            dot_natural_key, rename_source_key = _natural_key, _as_stored_key  # type: ignore[assignment]

        self.model = model
        self.paths = [str(path) for path in paths]
        """The safetensors files read, in order."""
        self._shapes_model = _ParameterShapes(model)
        # what from_pretrained uses (no key_mapping, no quantizer)
        transforms = get_model_conversion_mapping(model) if get_model_conversion_mapping is not None else []
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        expected = model.state_dict()  # names only: parameters on meta, buffers for real
        prefix = getattr(model, "base_model_prefix", None)

        where: Dict[str, str] = {}  # stored name -> path
        shapes: Dict[str, Tuple[int, ...]] = {}
        dtypes: Dict[str, str] = {}
        self._problems: List[str] = []
        for path in self.paths:
            check_safetensors_header(path)  # the library's own refusal names no file
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    stored = f.get_slice(key)
                    if key in where:  # which copy is meant? refused, never a silent pick
                        self._problems.append(stored_tensor_problem(key, path, stored.get_dtype(), where[key]) or "")
                        continue
                    where[key] = path
                    shapes[key] = tuple(stored.get_shape())
                    dtypes[key] = stored.get_dtype()
        parameter_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}

        conversions: Dict[str, _Conversion] = {}
        unexpected: Dict[str, str] = {}  # stored name -> its name after renaming
        for key in sorted(where, key=dot_natural_key):  # the library's order: experts 0, 1, ..., 10
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
            if renamed not in expected and key in expected:  # renamed away from a name the model has
                renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=expected)
            if renamed not in expected:
                unexpected[key] = renamed
                continue
            if renamed in parameter_names and dtypes[key] not in FLOAT_DTYPES:
                self._problems.append(stored_tensor_problem(key, where[key], dtypes[key], None) or "")
                continue
            if pattern is not None:
                template = copy.deepcopy(by_pattern[pattern])
            elif WeightRenaming is not None:
                template, pattern = WeightRenaming(key, renamed), key
            else:
                template, pattern = _AsStored(key), key
            conversion = conversions.setdefault(renamed, _Conversion(template, renamed, expected[renamed].dtype))
            conversion.stored.append((renamed, key, pattern, where[key], shapes[key]))
        # as from_pretrained does: what the model's conversions used is what save_pretrained reverts
        if get_model_conversion_mapping is not None:
            model._weight_conversions = [t for t in transforms if t.was_used()]  # type: ignore[assignment]

        ignored = _ignored_unexpected(model, set(unexpected.values()))
        self._problems += [
            f"{where[key]}: {key!r}{_read_as(key, renamed)} is not a parameter of the model"
            for key, renamed in unexpected.items()
            if renamed not in ignored
        ]
        self._conversions: Dict[WeightUnit, _Conversion] = {}
        self._buffers: Dict[WeightUnit, _Conversion] = {}
        for conversion in conversions.values():
            try:
                on_meta = conversion.convert(self._shapes_model, model.config, _on_meta)
            except Exception as e:  # the library's operations raise many kinds; one line names the unit
                self._problems.append(
                    f"{_origin(conversion)} cannot be converted into {conversion.first_name!r} as transformers "
                    f"converts it on load ({type(e).__name__}: {' '.join(str(e).split())})"
                )
                continue
            unit = WeightUnit(tuple((name, tuple(t.shape)) for name, t in on_meta.items()), _origin(conversion))
            is_buffer = [name in expected and name not in parameter_names for name in unit.names]
            (self._buffers if all(is_buffer) else self._conversions)[unit] = conversion
        self._problems += _tied_but_different(model, conversions, self._shapes_model)

    # -- the runtime's WeightSource ----------------------------------------------------------------

    def units(self) -> Sequence[WeightUnit]:
        """Every unit of parameters, with the names and shapes the library's conversion gives."""
        return list(self._conversions)

    def problems(self) -> Sequence[str]:
        """Stored tensors that fit no parameter (after renaming; not those from_pretrained ignores too),
        and conversions that fail on the stored shapes."""
        return list(self._problems)

    def read(self, unit: WeightUnit) -> Mapping[str, torch.Tensor]:
        """The unit's parameters: its stored tensors read, cast and converted (one unit in memory)."""
        return self._conversions[unit].convert(self._shapes_model, self.model.config, _Files().loader)

    # -- the rest of what from_pretrained loads, and export -------------------------------------

    def load_buffers(self) -> None:
        """Copy the stored persistent buffers (rarely any) into the model's buffers, as from_pretrained does;
        call it before initialize, while the buffers are the module's own CPU tensors."""
        files = _Files()
        for conversion in self._buffers.values():
            values = conversion.convert(self._shapes_model, self.model.config, files.loader)
            with torch.no_grad():
                for name, value in values.items():
                    self.model.get_buffer(name).copy_(value)

    def stored_as(self, params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """One group's parameters (model names) -> the tensors `save_pretrained` would write for them:
        the conversions loading used, reverted (a runtime export `stored_as` hook)."""
        ignored = set(getattr(self.model, "_keys_to_ignore_on_save", None) or ())
        kept = {name: t for name, t in params.items() if name not in ignored}
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # transformers 4.x: nothing was converted on load
            return kept
        return dict(revert_weight_conversion(self.model, kept))


SHARD_INDEX = "model.safetensors.index.json"
"""A sharded checkpoint's index: its weight_map names the shard file of every stored tensor."""


def hf_weight_files(path: Path, setting: str = "model.hf_path") -> List[Path]:
    """The safetensors files of a Hugging Face model directory, as from_pretrained picks them:
    `model.safetensors` alone if there is one, else the shards its index names (a shard of an older
    save left beside them is not read), else every *.safetensors file. ValueError naming the index and
    the fix if it is not JSON, names a shard that is missing or is not a file of the directory itself
    (`../x.safetensors` read outside the model), or places a tensor in a shard whose header holds none
    of that name (the index and the shards are of different saves: which tensor is meant?)."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / SHARD_INDEX
    if not os.path.lexists(index):
        return sorted(path.glob("*.safetensors"))
    fix = "it must be the index save_pretrained writes beside the shards"
    try:
        weight_map = json_text.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, OSError) as exc:
        raise ValueError(f"{setting}: {index} is not a shard index ({type(exc).__name__}); {fix}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{setting}: {index} has no weight_map of tensor names to shard files; {fix}")
    outside = sorted({name for name in weight_map.values() if Path(name).name != name or name in ("", ".", "..")})
    if outside:
        raise ValueError(
            f"{setting}: {index} names shard files that are not files of {path} itself: {outside[:4]}; a shard "
            "index names its shards by file name alone (model-00001-of-00002.safetensors): fix the index"
        )
    shards = [path / name for name in sorted(set(weight_map.values()))]
    missing = [s.name for s in shards if not os.path.lexists(s)]
    if missing:
        raise ValueError(
            f"{setting}: {index} names shards that are not in {path}: {missing[:4]}; copy them there (an "
            "interrupted download?) or fix the index"
        )
    held: Dict[str, str] = {}  # stored name -> the shard whose header holds it
    for shard in shards:
        try:
            names = check_safetensors_header(shard)
        except ValueError as exc:
            raise ValueError(f"{setting}: {exc}") from None
        for name in names:
            held.setdefault(name, shard.name)
    wrong = [
        f"{name!r} in {shard}, " + (f"but {held[name]} holds it" if name in held else "but no shard holds it")
        for name, shard in weight_map.items()
        if held.get(name) != shard
    ]
    if wrong:
        raise ValueError(
            f"{setting}: {index} does not match the shards' headers: it places {'; '.join(wrong[:3])}"
            f"{f'; and {len(wrong) - 3} more' if len(wrong) > 3 else ''}; the index and the shards are of different "
            "saves: download the model again (or write the index again from the shards)"
        )
    return shards


def _tied_but_different(model: nn.Module, conversions: Dict[str, _Conversion], shapes_model: Any) -> List[str]:
    """Tied parameters (one tensor under several names: tie_word_embeddings) that the files store under
    more than one of those names, with different values. from_pretrained unties them then (with a
    warning); the model built here shares one tensor, so which copy to train cannot be chosen: refused.
    Legit tied checkpoints store the tensor once, so nothing is read for them."""
    names_of: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    problems = []
    for names in names_of.values():
        stored = [n for n in names if n in conversions and len(conversions[n].stored) == 1]
        if len(stored) < 2:
            continue
        files = _Files()
        first = conversions[stored[0]].convert(shapes_model, model.config, files.loader)[stored[0]]
        for other in stored[1:]:
            value = conversions[other].convert(shapes_model, model.config, files.loader)[other]
            if value.shape != first.shape or not torch.equal(value.to(first.dtype), first):
                problems.append(
                    f"{_origin(conversions[other])} and {_origin(conversions[stored[0]])} differ, but the config ties "
                    f"{other!r} to {stored[0]!r} (one tensor): set tie_word_embeddings false in config.json (as "
                    "from_pretrained unties them), or remove one from the files"
                )
    return problems


def _origin(conversion: _Conversion) -> str:
    """`file: 'first stored name'` and how many more, for messages."""
    _, key, _, path, _ = conversion.stored[0]
    more = f" and {len(conversion.stored) - 1} more" if len(conversion.stored) > 1 else ""
    return f"{path}: {key!r}{more}"


def _read_as(key: str, renamed: str) -> str:
    return "" if renamed == key else f" (read as {renamed!r})"


def _on_meta(path: str, key: str, dtype: torch.dtype, shape: Tuple[int, ...]) -> Callable[[], torch.Tensor]:
    return lambda: torch.empty(shape, dtype=dtype, device="meta")


class _Files:
    """Safetensors files opened once each for one unit's reads (memory-mapped), closed with the object."""

    def __init__(self) -> None:
        self._open: Dict[str, Any] = {}

    def loader(self, path: str, key: str, dtype: torch.dtype, shape: Tuple[int, ...]) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            from safetensors import safe_open

            if path not in self._open:
                self._open[path] = safe_open(path, framework="pt")
            return self._open[path].get_tensor(key).to(dtype)

        return read


class _AsStored:
    """A stored tensor under its own name: the transform of a transformers without conversions."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._load: Callable[[], torch.Tensor] = _missing

    def add_tensor(self, target: str, key: str, pattern: str, load: Callable[[], torch.Tensor]) -> None:
        self._load = load

    def convert(self, first_name: str, **_: Any) -> Dict[str, torch.Tensor]:
        return {self.key: self._load()}


def _missing() -> torch.Tensor:
    raise RuntimeError("no stored tensor was added to convert")


def _as_stored_key(key: str, *args: Any, **kwargs: Any) -> Tuple[str, None]:
    return key, None


def _natural_key(key: str) -> Tuple[Tuple[int, Any], ...]:
    """Digits by value, the rest by text: experts 0, 1, 2, ..., 10."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in key.split("."))


def _ignored_unexpected(model: nn.Module, renamed: Set[str]) -> Set[str]:
    """The stored names (renamed) that from_pretrained drops without a word: the model's
    `_keys_to_ignore_on_load_unexpected` and the library's own exceptions (old rotary buffers, say)."""
    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if adjust is None or not renamed:
        return set()
    info = SimpleNamespace(missing_keys=set(), unexpected_keys=set(renamed))
    adjust(info)
    return renamed - info.unexpected_keys
