"""The runtime's generic layout hooks, without transformers: a WeightSource that builds one parameter
from several stored tensors loads bitwise, with every misfit refused before anything is written;
an export `stored_as` hook stores a parameter as several tensors, header first, group by group."""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import pytest
import torch
from safetensors.torch import load_file

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.runtime.persist.safetensors_load import WeightSource, WeightUnit

TIERS = {"params": {"host": 0.5, "nvme": 0.5}, "grads": "host", "optimizer": "nvme"}
SPLIT = "lm_head.weight"
"""Stored as two halves of its rows, `lm_head.top` and `lm_head.bottom`."""


def engine(tmp_path) -> ot.Engine:
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(tiers=dict(TIERS, nvme_dir=str(tmp_path / "swap")))
    return ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg)


class HalvesSource:
    """Every parameter under its own name, except SPLIT, which is built from two stored halves."""

    def __init__(self, stored: Dict[str, torch.Tensor], extra_units: Sequence[WeightUnit] = (), problems: Sequence[str] = ()):
        self.stored = stored
        self.reads: List[WeightUnit] = []
        names = [n for n in stored if not n.startswith("lm_head.")]
        top, bottom = stored["lm_head.top"], stored["lm_head.bottom"]
        self._units = [WeightUnit(((n, tuple(stored[n].shape)),), f"stored {n!r}") for n in names]
        self._units.append(WeightUnit(((SPLIT, (top.shape[0] + bottom.shape[0], top.shape[1])),), "stored halves"))
        self._units += list(extra_units)
        self._problems = list(problems)

    def units(self) -> Sequence[WeightUnit]:
        return self._units

    def problems(self) -> Sequence[str]:
        return self._problems

    def read(self, unit: WeightUnit) -> Mapping[str, torch.Tensor]:
        self.reads.append(unit)
        (name, _), = unit.shapes
        if name == SPLIT:
            return {SPLIT: torch.cat([self.stored["lm_head.top"], self.stored["lm_head.bottom"]])}
        return {name: self.stored[name]}


def halves(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The export hook: SPLIT as its two halves, everything else as it is."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name == SPLIT:
            out["lm_head.top"], out["lm_head.bottom"] = t.chunk(2)
        else:
            out[name] = t
    return out


def reference() -> Dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return {n: p.detach().clone() for n, p in DecoderLM(DecoderConfig.preset("tiny")).named_parameters()}


def test_a_source_that_fuses_stored_tensors_loads_bitwise_and_exports_back(tmp_path) -> None:
    params = reference()
    source = HalvesSource(halves(params))
    assert isinstance(source, WeightSource)
    with engine(tmp_path) as e:
        e.load_safetensors(source)
        state = e.full_state_dict()
        path = e.export_safetensors(tmp_path / "out.safetensors", stored_as=halves)
        plain = e.export_safetensors(tmp_path / "plain.safetensors")  # the old call: the model's names
    assert len(source.reads) == len(source.units())  # one read per unit
    assert all(torch.equal(state[n], params[n]) for n in params)
    written = load_file(str(path))
    assert set(written) == set(halves(params))
    assert all(torch.equal(written[n], t) for n, t in halves(params).items())
    assert set(load_file(str(plain))) == set(params)


def test_every_misfit_of_a_source_is_refused_before_anything_is_written(tmp_path) -> None:
    params = reference()
    stored = halves(params)
    del stored["norm.weight"]
    stored["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    extra = [WeightUnit((("nonsense.weight", (2,)),), "stored 'nonsense'")]
    source = HalvesSource(stored, extra, problems=["a.safetensors: 'x' cannot be converted"])
    with engine(tmp_path) as e:
        before = e.full_state_dict()
        with pytest.raises(ValueError) as info:
            e.load_safetensors(source)
        after = e.full_state_dict()
    message = str(info.value)
    assert "\n" not in message and not source.reads
    for part in ("'x' cannot be converted", "'nonsense.weight'", "'layers.0.mlp.up_proj.weight'", "[3, 3]", "'norm.weight'"):
        assert part in message, part
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_an_export_hook_that_stores_two_parameters_under_one_name_writes_nothing(tmp_path) -> None:
    def collide(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {"same" if name.endswith("input_layernorm.weight") else name: t for name, t in params.items()}

    with engine(tmp_path) as e:
        with pytest.raises(ValueError, match="'same'"):
            e.export_safetensors(tmp_path / "out.safetensors", stored_as=collide)
    assert not (tmp_path / "out.safetensors").exists()
    assert not list(tmp_path.glob("*.tmp-*"))


def test_an_export_hook_must_give_the_values_the_shapes_it_gave_the_header(tmp_path) -> None:
    def shape_dependent(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {name: (t if t.is_meta else t.reshape(-1)) for name, t in params.items()}

    with engine(tmp_path) as e:
        with pytest.raises(RuntimeError, match="stored_as gave"):
            e.export_safetensors(tmp_path / "out.safetensors", stored_as=shape_dependent)
    assert not (tmp_path / "out.safetensors").exists()
    assert not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(tmp_path, monkeypatch, bad: float) -> None:
    """A damaged weights file (a NaN or an infinity in a parameter) loaded without a word, and the run
    stopped at its first step with a message about the learning rate. It is refused at the load now,
    naming the tensor, its file and how many values; checked in pieces, so a large tensor's damage
    past the first piece is found too."""
    from safetensors.torch import save_file

    import offload_trainer.runtime.persist.safetensors_load as loader

    monkeypatch.setattr(loader, "_FINITE_CHECK_NUMEL", 1000)  # several pieces per tensor
    weights = reference()
    weights["layers.1.mlp.down_proj.weight"].view(-1)[-3:] = bad
    path = tmp_path / "model.safetensors"
    save_file(weights, str(path))
    with engine(tmp_path) as e:
        with pytest.raises(ValueError, match=r"'layers\.1\.mlp\.down_proj\.weight' \(from .*model\.safetensors.*\) holds 3 NaN or infinite"):
            e.load_safetensors([path])
