"""Whole training scripts on the simulated accelerator with lazy copies, against plain PyTorch.

Each case trains a small decoder through a script that mixes what a user's loop does between and
inside steps: gradient accumulation, an evaluation forward under no_grad between micro-batches and
between steps, an export between micro-batches and its weights loaded back between the last step's
micro-batches, a step whose gradients are not finite, a checkpoint saved after a step and loaded
back both between micro-batches and between steps. The engine runs on
the simulated accelerator with lazy copies ([Note: Lazy copies] in device/copy_worker.py: a copy lands
only once something waits for it, its destination NaN until then) and, per case, one copy kind made
later still: host->device, device->host, an NVMe read's or an NVMe write's completion. Every loss,
every evaluation output, every exported tensor and the final parameters must be those of plain
PyTorch (fp32: bitwise), or, under bf16/fp16, those of the same script on the CPU engine (bitwise).
A copy used before it landed, or an NVMe extent read before its write, shows as a wrong number.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM, MoEConfig, MoEDecoderLM
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.optimizer import torch_param_groups
from tests.offload_trainer.runtime.device.test_cuda_host_waits import twin_ranks  # noqa: F401 - a fixture

VOCAB = 64
TIERS = ("device", "host", "nvme")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@dataclass(frozen=True)
class Case:
    params: str = "host"
    grads: str = "host"
    optimizer: str = "host"
    accum: int = 2
    clip: Optional[float] = 0.5
    layer_major: bool = False
    precision: str = "fp32"
    """fp32, bf16, or fp16 (its first step overflows: a loss scale of 2**20)."""
    events: bool = True
    """Evaluation forwards, an export, a checkpoint saved and loaded twice, a non-finite step."""
    late: str = "none"
    """The copy kind made later still: none, h2d, d2h, nvme-read, nvme-write."""
    spill: str = ""
    """Layer-major: device room for one block's boundaries, the rest in host memory ("host") or on NVMe
    ("nvme"; the host budget holds the NVMe path's staging buffers but no boundary)."""
    release: bool = False
    """tiers.release_idle_memory: gradient homes and idle staging buffers discarded between uses."""

    def __str__(self) -> str:
        lm = "-lm" if self.layer_major else ""
        clip = "" if self.clip else "-noclip"
        ev = "" if self.events else "-plain"
        spill = f"-spill-{self.spill}" if self.spill else ""
        release = "-release" if self.release else ""
        return (
            f"{self.params[0]}{self.grads[0]}{self.optimizer[0]}-a{self.accum}{lm}{clip}-{self.precision}{ev}-{self.late}"
            f"{spill}{release}"
        )


def decoder() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64))


def tied_decoder() -> DecoderLM:
    """The decoder with its head tied to the embedding (one parameter, two modules' weight)."""
    torch.manual_seed(0)
    return DecoderLM(
        DecoderConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, tie_embeddings=True)
    )


def moe_decoder() -> nn.Module:
    """A mixture of experts: the experts that run change with the data (orders recorded again, loads
    cancelled, experts without a gradient in a step)."""
    torch.manual_seed(0)
    return MoEDecoderLM(MoEConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32))


def frozen_decoder() -> nn.Module:
    """The decoder with its attention and embedding frozen."""
    model = decoder()
    for name, p in model.named_parameters():
        if "self_attn" in name or "embed" in name:
            p.requires_grad_(False)
    return model


def lora_decoder() -> nn.Module:
    """The decoder with PEFT LoRA adapters on q and v (the base weights frozen)."""
    import peft

    return peft.get_peft_model(decoder(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def ce(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), targets.flatten())


def script_batches(accum: int, num_steps: int = 5) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)) for _ in range(accum)]
        for _ in range(num_steps)
    ]


EVAL_X = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
NONFINITE_STEP = 2


class Trainer:
    """What the script does, as the engine does it or as plain PyTorch does it."""

    def micro_batch(self, x: torch.Tensor, y: torch.Tensor, accum: int, poison: bool) -> torch.Tensor: ...
    def layer_major(self, step: List[Tuple[torch.Tensor, torch.Tensor]], poison: bool) -> torch.Tensor: ...
    def step(self, skip: bool) -> torch.Tensor: ...
    def evaluate(self) -> torch.Tensor: ...
    def export(self, path: Path) -> dict: ...
    def save(self, path: Path) -> None: ...
    def load_weights(self, path: Path) -> None: ...
    def load(self, path: Path) -> None: ...
    def state(self) -> dict: ...


class EngineTrainer(Trainer):
    def __init__(self, engine: ot.Engine) -> None:
        self.engine = engine

    def micro_batch(self, x, y, accum, poison):
        loss = ce(self.engine(x), y) / accum
        if poison:
            loss = loss * float("nan")
        self.engine.backward(loss)
        return loss.detach().float()

    def layer_major(self, step, poison):
        last = len(step) - 1

        def loss_fn(out, m):
            loss = ce(out, step[m][1])
            return loss * float("nan") if poison and m == last else loss

        return torch.stack(self.engine.forward_backward_layer_major([x for x, _ in step], loss_fn)).float()

    def step(self, skip):
        assert self.engine.step()
        return torch.tensor(self.engine.stats().skipped)

    def evaluate(self):
        self.engine.eval()
        with torch.no_grad():
            out = self.engine(EVAL_X).float()
        self.engine.train()
        return out

    def export(self, path):
        return load_file(str(self.engine.export_safetensors(path)))

    def save(self, path):
        self.engine.save_checkpoint(path)

    def load_weights(self, path):
        self.engine.load_safetensors([path])

    def load(self, path):
        self.engine.load_checkpoint(path)

    def state(self):
        return self.engine.full_state_dict()


class TorchTrainer(Trainer):
    """Plain PyTorch, fp32: fused AdamW, clip_grad_norm_, a skipped step updates nothing."""

    def __init__(self, model: nn.Module, opt_cfg: ot.OptimizerConfig) -> None:
        self.model = model
        self.cfg = opt_cfg
        self.opt = torch.optim.AdamW(torch_param_groups(model, opt_cfg), lr=opt_cfg.lr, betas=opt_cfg.betas, fused=True)
        self.saved: dict = {}
        self.exported: dict = {}

    def micro_batch(self, x, y, accum, poison):
        loss = ce(self.model(x), y) / accum
        if poison:
            return loss.detach() * float("nan")
        loss.backward()
        return loss.detach()

    def layer_major(self, step, poison):
        losses = []
        for m, (x, y) in enumerate(step):
            loss = ce(self.model(x), y)
            if poison and m == len(step) - 1:
                loss = loss.detach() * float("nan")
            else:
                (loss / len(step)).backward()
            losses.append(loss.detach())
        return torch.stack(losses)

    def step(self, skip):
        skipped = torch.tensor(skip)
        if not skip:
            if self.cfg.grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm)
            self.opt.step()
        self.opt.zero_grad()
        return skipped

    def evaluate(self):
        self.model.eval()
        with torch.no_grad():
            out = self.model(EVAL_X)
        self.model.train()
        return out

    def export(self, path):
        self.exported[path] = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        return self.exported[path]

    def load_weights(self, path):
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.exported[path][n])

    def save(self, path):
        self.saved[path] = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))

    def load(self, path):
        model_state, opt_state = self.saved[path]
        self.model.load_state_dict(model_state)
        self.opt.load_state_dict(copy.deepcopy(opt_state))
        self.opt.zero_grad()

    def state(self):  # a tied parameter under each of its names, as the engine's full_state_dict
        return {n: p.detach().clone() for n, p in self.model.named_parameters(remove_duplicate=False)}


def run_script(trainer: Trainer, case: Case, tmp: Path) -> List[Tuple[str, Any]]:
    """The script; returns what it saw, by name, in order."""
    seen: List[Tuple[str, Any]] = []
    steps = script_batches(case.accum)
    # fp16's first steps overflow at its loss scale of 2**20; fp32/bf16 get a NaN loss in step 2.
    poisoned = NONFINITE_STEP if case.events and case.precision != "fp16" else None
    for s, step in enumerate(steps):
        skip = s == poisoned
        if case.events and s == 3:  # checkpoint loaded between micro-batches: the step starts over
            if not case.layer_major:
                seen.append(("dropped loss", trainer.micro_batch(*step[0], case.accum, False)))
            trainer.load(tmp / "ckpt-1")
        if case.layer_major:
            seen.append((f"losses {s}", trainer.layer_major(step, s == poisoned)))
        else:
            for m, (x, y) in enumerate(step):
                seen.append((f"loss {s}.{m}", trainer.micro_batch(x, y, case.accum, s == poisoned and m == case.accum - 1)))
                if case.events and m == 0 and case.accum > 1:
                    seen.append((f"eval {s}.{m}", trainer.evaluate()))
                    if s == 1:
                        seen.append(("export 1.0", trainer.export(tmp / "mid.safetensors")))
                    if s == len(steps) - 1:  # weights loaded between micro-batches, loads in flight
                        trainer.load_weights(tmp / "mid.safetensors")
        seen.append((f"skipped {s}", trainer.step(skip)))
        if case.events:
            seen.append((f"eval {s}", trainer.evaluate()))
            if s == 1:
                trainer.save(tmp / "ckpt-1")
            if s == 3:  # and between steps
                trainer.load(tmp / "ckpt-1")
    seen.append(("state", trainer.state()))
    return seen


BOUNDARY_BYTES = 2 * 8 * 32 * 4
"""One micro-batch's block input: [2, 8, 32] fp32."""


def config(case: Case, nvme_dir: Path, budgets: Optional[dict] = None) -> ot.OffloadConfig:
    precision: dict = {"compute_dtype": case.precision}
    if case.precision == "fp16":
        precision.update(initial_loss_scale=2.0**20, loss_scale_window=1000)
    return ot.OffloadConfig(
        tiers={
            "params": case.params, "grads": case.grads, "optimizer": case.optimizer, "nvme_dir": str(nvme_dir),
            "release_idle_memory": case.release, **(budgets or {}),
        },
        prefetch={"lookahead_groups": 1},
        optimizer=ot.OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip_norm=case.clip),
        grad_accum_steps=case.accum,
        precision=precision,
    )


def simulated(case: Case) -> SimulatedAccelerator:
    h2d = 0.004 if case.late == "h2d" else 0.0005
    d2h = 0.004 if case.late == "d2h" else 0.0005
    return SimulatedAccelerator(h2d_delay_s=h2d, d2h_delay_s=d2h, lazy_s=0.05)


def late_nvme(monkeypatch: pytest.MonkeyPatch, late: str) -> None:
    """An NVMe read's or write's completion comes 3 ms late (the data lands only then)."""
    import io_engine.transfer as transfer

    name = {"nvme-read": "preadv", "nvme-write": "pwritev"}.get(late)
    if name is None:
        return
    real = getattr(transfer.os, name)

    def slow(*args: Any) -> int:
        time.sleep(0.003)
        return real(*args)

    monkeypatch.setattr(transfer.os, name, slow)


def spill_budgets(case: Case, device: object, tmp: Path, model: Callable[[], nn.Module] = decoder) -> dict:
    """Room on the device for one block's boundaries (all micro-batches); in host memory for two more
    ("host") or only for the two staging buffers of the NVMe path on an accelerator ("nvme")."""
    with ot.initialize(model(), config(case, tmp / "probe-swap"), device=device) as engine:
        used = {t: engine.tiers.accounts[t].resident_bytes for t in (ot.Tier.DEVICE, ot.Tier.HOST)}
        is_host = engine.accelerator.is_host
    block = case.accum * BOUNDARY_BYTES
    staging = 0 if is_host else 2 * BOUNDARY_BYTES
    return {
        "device_budget_bytes": used[ot.Tier.DEVICE] + block + 100,
        "host_budget_bytes": used[ot.Tier.HOST] + (2 * block if case.spill == "host" else block) + staging + 100,
    }


def run_engine(
    case: Case, device: Callable[[], object], tmp: Path, model: Callable[[], nn.Module] = decoder
) -> List[Tuple[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    budgets = spill_budgets(case, device(), tmp, model) if case.spill else None
    with ot.initialize(model(), config(case, tmp / "swap", budgets), device=device()) as engine:
        seen = run_script(EngineTrainer(engine), case, tmp)
        if case.spill:
            spilled = engine.layer_major.boundary_bytes
            assert spilled[ot.Tier.DEVICE] and spilled[ot.Tier.HOST if case.spill == "host" else ot.Tier.NVME], spilled
        return seen


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise alike, NaN where the other has NaN (a poisoned micro-batch's loss)."""
    b = b.to(a.dtype)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def assert_same(expected: List[Tuple[str, Any]], got: List[Tuple[str, Any]]) -> None:
    assert [n for n, _ in expected] == [n for n, _ in got]
    for (name, a), (_, b) in zip(expected, got):
        if isinstance(a, dict):
            assert sorted(a) == sorted(b), name
            bad = [k for k in a if not same(a[k], b[k])]
            assert not bad, f"{name}: differ: {bad}"
        elif name.startswith("dropped") and not torch.isfinite(a).all():
            continue
        else:
            assert same(a, b), f"{name}: {a} != {b}"


def check(case: Case, tmp: Path, monkeypatch: pytest.MonkeyPatch, model: Callable[[], nn.Module] = decoder) -> None:
    """`case` on the lazy simulated accelerator against plain PyTorch (fp32) or the CPU engine."""
    late_nvme(monkeypatch, case.late)
    got = run_engine(case, lambda: simulated(case), tmp / "sim", model)
    monkeypatch.undo()
    if case.precision == "fp32":
        expected = run_script(TorchTrainer(model(), config(case, tmp).optimizer), case, tmp / "ref")
    else:
        expected = run_engine(case, lambda: "cpu", tmp / "cpu", model)
    assert_same(expected, got)
    skipped = [bool(t) for n, t in got if n.startswith("skipped")]
    if case.events or case.precision == "fp16":
        assert any(skipped) and not all(skipped), skipped


PLACEMENTS = ["".join(p) for p in itertools.product("dhn", repeat=3)]
FULL = {"d": "device", "h": "host", "n": "nvme"}


def placed(code: str, **kw: Any) -> Case:
    return Case(params=FULL[code[0]], grads=FULL[code[1]], optimizer=FULL[code[2]], **kw)


def slow_but(default: Any, values: List[Any]) -> List[Any]:
    """The cases, all but `default` marked slow (1 to 4 s each): the default suite runs one of them."""
    def param(v: Any) -> Any:
        args = v if isinstance(v, tuple) else (v,)
        return pytest.param(*args, marks=() if v == default else pytest.mark.slow)

    return [param(v) for v in values]


@pytest.mark.parametrize("code", slow_but("dhn", PLACEMENTS))
def test_every_placement_through_the_whole_script(tmp_path, monkeypatch, code: str) -> None:
    check(placed(code), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("late", ["h2d", "d2h", "nvme-read", "nvme-write"])
@pytest.mark.parametrize("code", ["nnn", "hnh", "dnd", "ndh"])
def test_each_copy_kind_late(tmp_path, monkeypatch, code: str, late: str) -> None:
    check(placed(code, late=late), tmp_path, monkeypatch)


@pytest.mark.parametrize("code,clip", slow_but(("dnh", 0.5), list(itertools.product(["hhh", "nnn", "dnh", "dhd"], [0.5, None]))))
def test_layer_major_through_the_whole_script(tmp_path, monkeypatch, code: str, clip) -> None:
    check(placed(code, layer_major=True, accum=3, clip=clip), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("late", ["none", "h2d", "d2h", "nvme-read", "nvme-write"])
@pytest.mark.parametrize("spill", ["host", "nvme"])
@pytest.mark.parametrize("code", ["hnh", "dnd"])
def test_layer_major_boundaries_spilled_to_host_or_nvme(tmp_path, monkeypatch, code: str, spill: str, late: str) -> None:
    check(placed(code, layer_major=True, accum=3, spill=spill, late=late), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("layer_major", [False, True])
@pytest.mark.parametrize("code", ["nnn", "dhn", "hdd"])
def test_low_precision_through_the_whole_script(tmp_path, monkeypatch, code: str, precision: str, layer_major: bool) -> None:
    check(placed(code, precision=precision, layer_major=layer_major), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("code", ["nnn", "ddd", "hnd"])
def test_without_clipping_and_one_micro_batch(tmp_path, monkeypatch, code: str) -> None:
    check(placed(code, clip=None, accum=1), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("code", ["hhh", "nnn", "dnd", "ndh"])
@pytest.mark.parametrize("model", ["tied", "moe", "frozen", "lora"])
def test_other_models_through_the_whole_script(tmp_path, monkeypatch, model: str, code: str) -> None:
    """A tied head, experts that run in turn, frozen parameters and LoRA adapters, against plain PyTorch."""
    if model == "lora":
        pytest.importorskip("peft")
    check(placed(code), tmp_path, monkeypatch, {"tied": tied_decoder, "moe": moe_decoder, "frozen": frozen_decoder, "lora": lora_decoder}[model])


@pytest.mark.slow
@pytest.mark.parametrize("layer_major", [False, True])
@pytest.mark.parametrize("code", ["hhh", "nnn", "dnd", "dhn", "ndh"])
def test_idle_memory_released_through_the_whole_script(tmp_path, monkeypatch, code: str, layer_major: bool) -> None:
    """tiers.release_idle_memory: a gradient home given back before its group's load, idle staging
    buffers before a step's first backward, with copies and NVMe transfers in flight."""
    check(placed(code, release=True, layer_major=layer_major, accum=3 if layer_major else 2), tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize(
    "code,precision,layer_major",
    [("hhh", "fp32", False), ("nnn", "bf16", False), ("dnd", "fp16", False), ("hdd", "fp32", True),
     ("ndh", "fp16", True), ("dhn", "bf16", True)],
)
def test_two_ranks_through_the_script(tmp_path, twin_ranks: None, code: str, precision: str, layer_major: bool) -> None:
    """Rank 0 of two (test_cuda_host_waits' twin: collectives as local stand-ins) on the lazy simulated
    accelerator, bitwise as on the CPU: the multi-rank paths of the copy path (a shard copied on and
    all-gathered, a reduced shard copied off before its merge) under accumulation, layer-major units
    and loss scaling. Without the script's events: a checkpoint needs a process group."""
    case = placed(code, precision=precision, layer_major=layer_major, accum=3 if layer_major else 2, events=False)
    assert_same(run_engine(case, lambda: "cpu", tmp_path / "cpu"), run_engine(case, lambda: simulated(case), tmp_path / "sim"))
