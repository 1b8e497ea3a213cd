"""The layer-major schedule (runtime/layer_major.py): bitwise plain PyTorch, each group fetched once.

fp32 on one rank: training through engine.forward_backward_layer_major must leave every parameter
torch.equal to plain PyTorch's micro-batch-major accumulation (`(loss / M).backward()` per
micro-batch, fused AdamW with clipping); with 4 micro-batches it must read at most a third of the
parameter bytes that micro-batch-major reads (the engine's byte counters).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload_trainer as ot
from offload_trainer.config import Tier
from offload_trainer.errors import PlanError
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.optimizer import torch_param_groups

OPT = ot.OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip_norm=0.5)
VOCAB = 64
REPO = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def decoder(**overrides: Any) -> DecoderLM:
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64)
    return DecoderLM(DecoderConfig(**{**shape, **overrides}))


def batches(num_steps: int, accum: int, batch: int = 2, seq: int = 8) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g))
            for _ in range(accum)
        ]
        for _ in range(num_steps)
    ]


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def ce(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(out).float().flatten(0, 1), targets.flatten())


def train_reference(model: nn.Module, steps: List[List[Tuple[torch.Tensor, torch.Tensor]]]) -> nn.Module:
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    for step in steps:
        for x, y in step:
            (ce(ref(x), y) / len(step)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
        opt.step()
        opt.zero_grad()
    return ref


def train_layer_major(
    engine: ot.Engine, steps: List[List[Tuple[torch.Tensor, torch.Tensor]]], stack: Any = None
) -> List[float]:
    losses = []
    for step in steps:
        out = engine.forward_backward_layer_major(
            [x for x, _ in step], lambda out, m, step=step: ce(out, step[m][1]), stack=stack
        )
        losses.append(float(sum(out)) / len(out))
        engine.step()
    return losses


def assert_params_equal(ref: nn.Module, state: dict) -> None:
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    assert not bad, f"parameters differ from plain PyTorch: {bad}"


TIERS = {
    "all-host": dict(params="host", grads="host", optimizer="host"),
    "all-nvme": dict(params="nvme", grads="nvme", optimizer="nvme"),
}


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("placement", sorted(TIERS))
@pytest.mark.parametrize("accum", [1, 4])
def test_layer_major_matches_plain_pytorch_bitwise(tmp_path, accum: int, placement: str, device: str) -> None:
    model = decoder()
    steps = batches(3, accum)
    ref = train_reference(model, steps)
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS[placement], nvme_dir=str(tmp_path)), prefetch={"lookahead_groups": 1}, optimizer=OPT,
        grad_accum_steps=accum,
    )
    accel = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001) if device == "sim" else device
    with ot.initialize(model, cfg, device=accel) as engine:
        train_layer_major(engine, steps)
        assert_params_equal(ref, engine.full_state_dict())


def test_boundaries_in_host_memory_when_the_device_has_no_room(tmp_path) -> None:
    """The device budget leaves no room for the boundaries: they go to host memory, off the device
    on the (late) copy path, and the result is still bitwise plain PyTorch's."""
    model = decoder()
    steps = batches(2, 4, batch=4, seq=16)
    ref = train_reference(model, steps)
    probe = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=4)
    with ot.initialize(decoder(), probe, device=SimulatedAccelerator()) as engine:
        device_bytes = engine.tiers.accounts[Tier.DEVICE].resident_bytes
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS["all-host"], device_budget_bytes=device_bytes + 4096), optimizer=OPT, grad_accum_steps=4
    )
    with ot.initialize(model, cfg, device=SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001)) as engine:
        train_layer_major(engine, steps)
        # blocks x micro-batches x [4, 16, 32] fp32
        assert engine.layer_major.boundary_bytes == {Tier.DEVICE: 0, Tier.HOST: 3 * 4 * (4 * 16 * 32 * 4), Tier.NVME: 0}
        assert engine.tiers.accounts[Tier.HOST].peak_bytes >= engine.layer_major.boundary_bytes[Tier.HOST]
        assert_params_equal(ref, engine.full_state_dict())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_boundaries_spill_to_host_then_nvme_when_both_budgets_are_tight(tmp_path, device: str, tied: bool) -> None:
    """Room on the device for one block's boundaries (all micro-batches) and in host memory for one
    more (plus, on the simulated accelerator, the two staging buffers of the NVMe path): the last
    block's stay on the device, the one before in host memory, the rest go to NVMe (with tied
    weights the last block's outputs too, taken last) and come back on the (late) copy path; the
    result is still bitwise plain PyTorch's."""
    model = decoder(tie_embeddings=tied)
    steps = batches(2, 4, batch=4, seq=16)
    ref = train_reference(model, steps)
    host_tiers = dict(params="host", grads="nvme", optimizer="host", nvme_dir=str(tmp_path))
    probe = ot.OffloadConfig(tiers=host_tiers, optimizer=OPT, grad_accum_steps=4)
    with ot.initialize(decoder(tie_embeddings=tied), probe, device=SimulatedAccelerator()) as engine:
        used = {t: engine.tiers.accounts[t].resident_bytes for t in (Tier.DEVICE, Tier.HOST)}
    boundary = 4 * 16 * 32 * 4  # one micro-batch's [4, 16, 32] fp32
    block = 4 * boundary
    staging = 0 if device == "cpu" else 2 * boundary
    cfg = ot.OffloadConfig(
        tiers=dict(
            host_tiers, device_budget_bytes=used[Tier.DEVICE] + block + 100,
            host_budget_bytes=used[Tier.HOST] + block + staging + 100,
        ),
        optimizer=OPT, grad_accum_steps=4,
    )
    accel = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001) if device == "sim" else device
    with ot.initialize(model, cfg, device=accel) as engine:
        train_layer_major(engine, steps)
        on_nvme = (2 if tied else 1) * block  # block 0 (and the last block's outputs)
        assert engine.layer_major.boundary_bytes == {Tier.DEVICE: block, Tier.HOST: block, Tier.NVME: on_nvme}
        assert engine.layer_major.spill.extent_bytes == on_nvme  # one extent, reused by the second step
        assert engine.tiers.accounts[Tier.HOST].peak_bytes <= cfg.tiers.host_budget_bytes
        assert engine.tiers.accounts[Tier.DEVICE].peak_bytes <= cfg.tiers.device_budget_bytes
        assert_params_equal(ref, engine.full_state_dict())


def test_boundaries_that_fit_nowhere_are_refused_with_the_numbers() -> None:
    probe = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=4)
    with ot.initialize(decoder(), probe) as engine:
        used = {t: engine.tiers.accounts[t].resident_bytes for t in (Tier.DEVICE, Tier.HOST)}
    cfg = ot.OffloadConfig(
        tiers=dict(
            TIERS["all-host"], device_budget_bytes=used[Tier.DEVICE] + 4096, host_budget_bytes=used[Tier.HOST] + 4096
        ),
        optimizer=OPT, grad_accum_steps=4,
    )
    with ot.initialize(decoder(), cfg) as engine:
        with pytest.raises(PlanError, match="layer-major schedule keeps every block's input.*host_budget_bytes"):
            train_layer_major(engine, batches(1, 4, batch=4, seq=16))
        # Nothing is left held or counted: the same engine trains on smaller micro-batches.
        train_layer_major(engine, batches(1, 4, batch=1, seq=2))


def test_wrong_number_of_micro_batches_and_weights_shared_by_blocks_are_refused() -> None:
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(decoder(), cfg) as engine:
        with pytest.raises(ValueError, match="got 3 micro-batches but grad_accum_steps=2"):
            train_layer_major(engine, batches(1, 3))
    shared = decoder()
    shared.layers[2].mlp.up_proj.weight = shared.layers[0].mlp.up_proj.weight
    with ot.initialize(shared, cfg) as engine:
        with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight is also layers\.2\.mlp\.up_proj\.weight"):
            train_layer_major(engine, batches(1, 2))


class _LayerStack(nn.Module):
    """A block stack over `self.layers` (stack_begin, stack_block and stack_end its subclass's), whose forward
    runs them in turn, as plain PyTorch trains it."""

    layers: nn.ModuleList

    def stack_blocks(self) -> nn.ModuleList:
        return self.layers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, context = self.stack_begin(ids)  # type: ignore[attr-defined]
        for block in self.layers:
            h = self.stack_block(block, h, context)  # type: ignore[attr-defined]
        return self.stack_end(h, context)  # type: ignore[attr-defined]


class GatedStack(_LayerStack):
    """A stack whose context is a gate computed from a parameter of the begin's: every block needs its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.gate = nn.Parameter(torch.ones(16))
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, VOCAB)

    def stack_begin(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return self.emb(ids), {"gate": torch.sigmoid(self.gate)}

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: Any) -> torch.Tensor:
        return h + torch.tanh(block(h) * context["gate"])

    def stack_end(self, h: torch.Tensor, context: Any) -> torch.Tensor:
        return self.head(h)


def test_a_context_that_requires_grad_is_refused() -> None:
    """Each block backpropagates into its hidden state alone: before, the second block's backward failed inside
    autograd ("Trying to backward through the graph a second time"), after the first had run."""
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(GatedStack(), cfg) as engine:
        with pytest.raises(ValueError, match=r"context of micro-batch 0 .* shape \(16,\) that requires grad"):
            train_layer_major(engine, batches(1, 2))


class DrawingStack(_LayerStack):
    """A stack drawing random numbers in one unit, by a function rather than an nn.Dropout module."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.where = where
        self.emb = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, VOCAB)

    def drop(self, h: torch.Tensor, where: str) -> torch.Tensor:
        return F.dropout(h, 0.2, training=self.training) if where == self.where else h

    def stack_begin(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return self.drop(self.emb(ids), "begin"), None

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: Any) -> torch.Tensor:
        return h + self.drop(torch.tanh(block(h)), "block")

    def stack_end(self, h: torch.Tensor, context: Any) -> torch.Tensor:
        return self.head(self.drop(h, "end"))


@pytest.mark.parametrize(
    "where, unit", [("begin", "the begin"), ("block", r"block 0 \(layers\.0\)"), ("end", "the end")]
)
def test_a_unit_drawing_random_numbers_is_refused(where: str, unit: str) -> None:
    """Plain PyTorch draws micro-batch by micro-batch, this schedule unit by unit, recomputing in backward. Before,
    only nn.Dropout modules were refused: F.dropout in a block (and HF Mixtral's router jitter,
    test_hf_block_stack.py) trained other values than plain PyTorch, silently. Refused now, and the loop goes
    on micro-batch-major, bitwise plain PyTorch's."""
    steps = batches(1, 2)
    plain = DrawingStack(where)
    torch.manual_seed(5)
    ref = train_reference(plain, steps)
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(DrawingStack(where), cfg) as engine:
        with pytest.raises(ValueError, match=f"^{unit} .*drew random numbers in its forward"):
            train_layer_major(engine, steps)
        torch.manual_seed(5)
        for x, y in steps[0]:
            engine.backward(ce(engine(x), y) / 2)
        assert engine.step()
        assert_params_equal(ref, engine.full_state_dict())


def test_a_stack_that_draws_only_in_training_trains_layer_major_in_eval_mode() -> None:
    """No draw, no refusal: dropout off (model.eval()) trains bitwise."""
    steps = batches(2, 2)
    ref = train_reference(DrawingStack("block").eval(), steps)
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(DrawingStack("block").eval(), cfg) as engine:
        train_layer_major(engine, steps)
        assert_params_equal(ref, engine.full_state_dict())


class NormedBlock(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.norm(self.fc(h).transpose(1, 2)).transpose(1, 2))


class BufferStack(_LayerStack):
    """A stack with a BatchNorm (in training: it updates its running statistics) in its begin, its blocks or
    its end, whose begin also registers a table again with the same values (HF's dynamic rotary embedding)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.where = where
        self.emb = nn.Embedding(VOCAB, 16)
        self.norm = nn.BatchNorm1d(16) if where in ("begin", "end") else nn.Identity()
        self.layers = nn.ModuleList([NormedBlock(where == "block") for _ in range(2)])
        self.head = nn.Linear(16, VOCAB)
        self.register_buffer("table", torch.arange(16.0))

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.transpose(1, 2)).transpose(1, 2)

    def stack_begin(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        self.register_buffer("table", torch.arange(16.0))
        h = self.emb(ids) + self.table
        return (self.normed(h) if self.where == "begin" else h), None

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: Any) -> torch.Tensor:
        return block(h)

    def stack_end(self, h: torch.Tensor, context: Any) -> torch.Tensor:
        return self.head(self.normed(h) if self.where == "end" else h)


@pytest.mark.parametrize(
    "where, unit, name",
    [("begin", "the begin", "norm"), ("block", r"block 0 \(layers\.0\)", r"layers\.0\.norm"), ("end", "the end", "norm")],
)
def test_a_unit_changing_a_buffer_is_refused(where: str, unit: str, name: str) -> None:
    """BatchNorm's running statistics were updated again by the recomputation in backward (twice per
    micro-batch, num_batches_tracked too), silently; refused now, naming the buffer, and the loop goes on
    micro-batch-major. In eval mode it trains layer-major, bitwise."""
    steps = batches(2, 2)
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(BufferStack(where), cfg) as engine:
        with pytest.raises(ValueError, match=f"^{unit} .*changed buffer {name}.num_batches_tracked in its forward"):
            train_layer_major(engine, steps)
    ref = train_reference(BufferStack(where).eval(), steps)
    model = BufferStack(where).eval()
    with ot.initialize(model, cfg) as engine:
        train_layer_major(engine, steps)
        assert_params_equal(ref, engine.full_state_dict())
    assert all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in ref.named_buffers())


class SharedNormStack(_LayerStack):
    """A norm of the model's root applied in every block by stack_block: a parameter of two units that no block
    registers, so tie_candidates does not see it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, VOCAB)

    def stack_begin(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return self.emb(ids), None

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: Any) -> torch.Tensor:
        return h + torch.tanh(block(self.norm(h)))

    def stack_end(self, h: torch.Tensor, context: Any) -> torch.Tensor:
        return self.head(h)


def test_a_parameter_of_two_units_is_refused() -> None:
    """Before, the norm's gradient was summed unit by unit (block 1's micro-batches, then block 0's), plain
    PyTorch's micro-batch by micro-batch: other last bits in every parameter, silently. Refused now at the
    second unit's end, naming it, and the loop goes on micro-batch-major, bitwise plain PyTorch's."""
    steps = batches(1, 2)
    ref = train_reference(SharedNormStack(), steps)
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(SharedNormStack(), cfg) as engine:
        with pytest.raises(ValueError, match=r"^parameter norm\.(weight|bias) got gradients in two units"):
            train_layer_major(engine, steps)
        for x, y in steps[0]:
            engine.backward(ce(engine(x), y) / 2)
        assert engine.step()
        assert_params_equal(ref, engine.full_state_dict())


class MemoryStack(SharedNormStack):
    """Each block reads a memory vector of the context and adds its output's mean to it, in place."""

    def stack_begin(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return self.emb(ids), {"memory": torch.zeros(16)}

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: Any) -> torch.Tensor:
        out = h + torch.tanh(block(h + context["memory"]))
        context["memory"].add_(out.detach().mean((0, 1)))
        return out


def test_a_block_changing_the_context_is_refused() -> None:
    """Before, backward recomputed block 0 with the memory as block 1 had left it: every parameter differed from
    plain PyTorch's by up to 0.04 after two steps, silently."""
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(MemoryStack(), cfg) as engine:
        with pytest.raises(ValueError, match=r"^block 0 \(layers\.0\) changed a tensor of the context of micro-batch 0"):
            train_layer_major(engine, batches(1, 2))


class ViTLikeStack(_LayerStack):
    """`transposed`: the begin hands the blocks a hidden state that is not row-major (a ViT's patch embedding,
    `proj(x).flatten(2).transpose(1, 2)`), which the residual additions keep so, and each block normalises it
    (a mean over its last dimension, summed in its memory order). `reads`: stack_block reads the block's
    weights (`F.linear(n, block.weight, block.bias)`) instead of calling the block."""

    def __init__(self, transposed: bool = True, reads: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transposed, self.reads = transposed, reads
        self.emb = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, VOCAB)

    def stack_begin(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        h = self.emb(ids)
        return (h.transpose(1, 2).contiguous().transpose(1, 2) if self.transposed else h), None

    def stack_block(self, block: nn.Module, h: torch.Tensor, context: Any) -> torch.Tensor:
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h + torch.tanh(F.linear(n, block.weight, block.bias) if self.reads else block(n))

    def stack_end(self, h: torch.Tensor, context: Any) -> torch.Tensor:
        return self.head(h)


@pytest.mark.parametrize("device, kept", [("cpu", Tier.DEVICE), ("sim", Tier.DEVICE), ("sim", Tier.HOST), ("sim", Tier.NVME)])
def test_a_hidden_state_that_is_not_row_major(tmp_path, device: str, kept: Tier) -> None:
    """Before, the gradient handed to the block before was its input's `.grad`, which AccumulateGrad gives the
    input's strides, where plain PyTorch hands on autograd's own layout: the blocks' bias gradients summed in
    another order (other last bits, every boundary tier); and host and NVMe boundaries came back row-major, so
    the recomputation's norms summed in another order than the forward's. [Note: Boundary gradients keep
    autograd's layout] in layer_major.py, [Note: Boundaries keep their memory order] in boundary_store.py."""
    steps = batches(2, 2, batch=4, seq=16)
    ref = train_reference(ViTLikeStack(), steps)
    tiers = dict(TIERS["all-host"], nvme_dir=str(tmp_path))
    accel = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001) if device == "sim" else device
    if kept is not Tier.DEVICE:
        probe = ot.OffloadConfig(tiers=tiers, optimizer=OPT, grad_accum_steps=2)
        with ot.initialize(ViTLikeStack(), probe, device=SimulatedAccelerator()) as engine:
            used = {t: engine.tiers.accounts[t].resident_bytes for t in (Tier.DEVICE, Tier.HOST)}
        room = 3 * 2 * (4 * 16 * 16 * 4) if kept is Tier.HOST else 2 * (4 * 16 * 16 * 4)  # all, or NVMe's staging
        tiers.update(device_budget_bytes=used[Tier.DEVICE] + 100, host_budget_bytes=used[Tier.HOST] + room + 100)
    cfg = ot.OffloadConfig(tiers=tiers, optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(ViTLikeStack(), cfg, device=accel) as engine:
        train_layer_major(engine, steps)
        assert engine.layer_major.boundary_bytes[kept] > 0
        assert_params_equal(ref, engine.full_state_dict())


def test_a_stack_reading_its_blocks_weights_without_calling_them() -> None:
    """stack_block reads `block.weight` itself: from the second step the scheduler had the blocks' groups
    prefetched, so no unit acquired them, and their gradients stayed in `.grad` (the unit handed over those of
    the groups it held): the blocks trained in the first step only, silently (every one off by about the
    learning rate after two)."""
    steps = batches(3, 2)
    ref = train_reference(ViTLikeStack(transposed=False, reads=True), steps)
    cfg = ot.OffloadConfig(tiers=dict(TIERS["all-host"]), optimizer=OPT, grad_accum_steps=2)
    with ot.initialize(ViTLikeStack(transposed=False, reads=True), cfg) as engine:
        train_layer_major(engine, steps)
        assert_params_equal(ref, engine.full_state_dict())


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("accum", [1, 4])
def test_tied_embeddings_match_plain_pytorch_bitwise(tmp_path, accum: int, device: str) -> None:
    """[Note: Tied weights]: the head's share of the tied gradient is taken again in the begin's
    backward, so autograd sums both uses of each micro-batch before accumulating it, as plain does."""
    model = decoder(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    steps = batches(3, accum)
    ref = train_reference(model, steps)
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS["all-nvme"], nvme_dir=str(tmp_path)), prefetch={"lookahead_groups": 1}, optimizer=OPT,
        grad_accum_steps=accum,
    )
    accel = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001) if device == "sim" else device
    with ot.initialize(model, cfg, device=accel) as engine:
        train_layer_major(engine, steps)
        # the last block's outputs are kept too, for the head's second pass
        assert sum(engine.layer_major.boundary_bytes.values()) == 4 * accum * (2 * 8 * 32 * 4)
        assert_params_equal(ref, engine.full_state_dict())


def tiny_hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":  # tied by default; its dropouts off (the schedule recomputes blocks)
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        )
        model = transformers.LlamaForCausalLM(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model.float().train()


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tied_hugging_face_models_match_plain_pytorch_bitwise(tmp_path, kind: str, accum: int, device: str) -> None:
    from offload_trainer.models import hf_block_stack

    model = tiny_hf(kind)
    steps = batches(2, accum)
    ref = train_reference(model, steps)
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS["all-host"]), prefetch={"lookahead_groups": 1}, optimizer=OPT, grad_accum_steps=accum,
    )
    accel = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001) if device == "sim" else device
    with ot.initialize(model, cfg, device=accel) as engine:
        train_layer_major(engine, steps, stack=hf_block_stack(model))
        assert_params_equal(ref, engine.full_state_dict())


def test_layer_major_reads_at_most_a_third_of_the_parameter_bytes(tmp_path) -> None:
    """Parameters on NVMe, gradients and optimizer states in host memory, 4 micro-batches, on the
    simulated accelerator, where every parameter fetch is counted as it is copied to the device
    (stats().h2d_bytes; the optimizer's own read of the fp32 parameters, once per step in both
    schedules, is an NVMe read that is never copied there): one replayed step of each schedule."""
    steps = batches(3, 4)
    cfg = ot.OffloadConfig(
        tiers=dict(params="nvme", grads="host", optimizer="host", nvme_dir=str(tmp_path)),
        prefetch={"lookahead_groups": 1}, optimizer=OPT, grad_accum_steps=4,
    )
    with ot.initialize(decoder(), cfg, device=SimulatedAccelerator()) as engine:
        for step in steps:
            for x, y in step:
                engine.backward(ce(engine(x), y) / 4)
            engine.step()
        micro_batch_major = engine.stats()
        one_pass = sum(g.param_home.nbytes for g in engine.groups)
    with ot.initialize(decoder(), cfg, device=SimulatedAccelerator()) as engine:
        train_layer_major(engine, steps)
        layer_major = engine.stats()
    assert layer_major.re_records == 0  # the order recorded on the first step held
    nvme = Tier.NVME
    # A load the update pass filled ([Note: The next forward's load from the update]) is copied to the
    # device without an NVMe read: param_bytes_from_update.
    for stats in (micro_batch_major, layer_major):
        assert stats.bytes_read[nvme] + stats.param_bytes_from_update - stats.h2d_bytes == one_pass  # the optimizer's read
    assert micro_batch_major.h2d_bytes >= 4 * one_pass  # each micro-batch fetched every group at least once
    assert layer_major.h2d_bytes <= 2 * one_pass  # once in forward, once in backward (less what stays)
    assert 3 * layer_major.h2d_bytes <= micro_batch_major.h2d_bytes


@pytest.mark.parametrize("accum", [1, 4])
def test_hugging_face_llama_matches_plain_pytorch_bitwise(tmp_path, accum: int) -> None:
    transformers = pytest.importorskip("transformers")
    from offload_trainer.models import hf_block_stack

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().train()
    steps = batches(2, accum)
    ref = train_reference(model, steps)
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS["all-nvme"], nvme_dir=str(tmp_path)), prefetch={"lookahead_groups": 1}, optimizer=OPT,
        grad_accum_steps=accum,
    )
    with ot.initialize(model, cfg) as engine:
        train_layer_major(engine, steps, stack=hf_block_stack(model))
        assert_params_equal(ref, engine.full_state_dict())


TWO_RANK_WORKER = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, {repo!r})
    import offload_trainer as ot
    from offload_trainer.models import DecoderConfig, DecoderLM

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", tie_embeddings={tied!r}))
    cfg = ot.OffloadConfig(
        tiers={{
            "params": "nvme", "grads": "host", "optimizer": "host", "nvme_dir": os.path.join({out!r}, f"nvme-{{rank}}")
        }},
        prefetch={{"lookahead_groups": 1}},
        optimizer={{"kind": "sgd", "lr": 1e-1, "momentum": 0.9, "weight_decay": 0.1, "grad_clip_norm": 0.5}},
        grad_accum_steps=2,
    )
    engine = ot.initialize(model, cfg)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        rows = [x.chunk(world)[rank] for x in (torch.randint(0, 256, (4, 16), generator=g) for _ in range(2))]
        if world == 1:
            for x in rows:
                engine.backward(engine(x, x.roll(-1, 1))[1] / 2)
        else:
            engine.forward_backward_layer_major(
                rows, lambda out, m: torch.nn.functional.cross_entropy(out.flatten(0, 1), rows[m].roll(-1, 1).flatten())
            )
        engine.step()
    state = engine.full_state_dict()
    if rank == 0:
        torch.save(state, os.path.join({out!r}, f"state-{{world}}.pt"))
    engine.close()
    if world > 1:
        dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_two_ranks_layer_major_match_one_rank_micro_batch_major(tmp_path, tied: bool) -> None:
    """Several ranks take the same schedule, so their collectives pair up; SGD within 1e-6, as
    test_engine_two_ranks.py holds micro-batch-major to."""
    script = tmp_path / "worker.py"
    script.write_text(TWO_RANK_WORKER.format(repo=str(REPO), out=str(tmp_path), tied=tied))
    for world in (1, 2):
        cmd = [sys.executable, str(script)]
        if world == 2:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    one, two = torch.load(tmp_path / "state-1.pt"), torch.load(tmp_path / "state-2.pt")
    rel = {n: float((one[n] - two[n]).norm() / one[n].norm().clamp_min(1e-12)) for n in one}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= 1e-6, f"{worst}: {rel[worst]:.2e}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradients_reach_their_nvme_homes_once_per_step(tmp_path, dtype: str) -> None:
    """[Note: Gradients once per unit]: with gradients on NVMe (everything else in host memory),
    micro-batch-major writes each gradient home once per micro-batch, layer-major once per step, in
    low precision too (its micro-batches summed in fp32 beside `.grad`; before, handed over piece by
    piece, each micro-batch's were written)."""
    steps = batches(2, 4)
    cfg = ot.OffloadConfig(
        tiers=dict(params="host", grads="nvme", optimizer="host", nvme_dir=str(tmp_path)), optimizer=OPT,
        grad_accum_steps=4, precision={"compute_dtype": dtype},
    )
    ref = train_reference(decoder(), steps)
    with ot.initialize(decoder(), cfg) as engine:
        for step in steps:
            for x, y in step:
                engine.backward(ce(engine(x), y) / 4)
            engine.step()
        micro_batch_major = engine.stats().bytes_written[Tier.NVME]
        grad_bytes = sum(g.grad_home.nbytes for g in engine.groups if g.grad_home is not None)
    with ot.initialize(decoder(), cfg) as engine:
        train_layer_major(engine, steps)
        assert engine.stats().bytes_written[Tier.NVME] == grad_bytes
        if dtype == "fp32":
            assert_params_equal(ref, engine.full_state_dict())
    assert micro_batch_major == 4 * grad_bytes


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_layer_major_matches_the_engines_micro_batch_major(tmp_path, dtype: str, tied: bool) -> None:
    """bf16/fp16 compute sums each unit's micro-batches in fp32 beside `.grad`, in micro-batch order, as
    the homes accumulate them ([Note: Gradients once per unit]), so layer-major equals the engine's own
    micro-batch-major run bit for bit (tied: the begin's piece carries both uses of the tied weight, as
    one micro-batch-major backward does)."""
    steps = batches(2, 4)
    precision = {"compute_dtype": dtype}
    if dtype == "fp16":
        precision.update(initial_loss_scale=2.0**10, loss_scale_window=1000)
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS["all-nvme"], nvme_dir=str(tmp_path)), optimizer=OPT, grad_accum_steps=4, precision=precision
    )
    with ot.initialize(decoder(tie_embeddings=tied), cfg) as engine:
        for step in steps:
            for x, y in step:
                engine.backward(ce(engine(x), y) / 4)
            engine.step()
        expected = engine.full_state_dict()
    with ot.initialize(decoder(tie_embeddings=tied), cfg) as engine:
        train_layer_major(engine, steps)
        got = engine.full_state_dict()
    bad = [n for n in expected if not torch.equal(expected[n], got[n])]
    assert not bad, f"layer-major differs from micro-batch-major under {dtype}: {bad}"


def test_only_the_running_units_groups_are_pinned(tmp_path, monkeypatch) -> None:
    """Unpacking a saved tensor pins its group until the backward acquisition after it; a layer-major
    unit has none after it, so it drops its pins when done: with more blocks than device slots, no
    group of an earlier unit stays pinned (which would block eviction and prefetch)."""
    cfg = ot.OffloadConfig(
        tiers=dict(TIERS["all-nvme"], nvme_dir=str(tmp_path)), prefetch={"lookahead_groups": 1}, optimizer=OPT,
        grad_accum_steps=2,
    )
    with ot.initialize(decoder(n_layers=5), cfg) as engine:
        assert engine.memory_plan.num_device_slots < len(engine.groups)
        schedule = engine.layer_major
        seen = []
        hold = schedule.hold

        def checked_hold(groups):
            seen.append(set(engine.scheduler.pinned) - set(schedule._held or ()) - set(groups))
            hold(groups)

        monkeypatch.setattr(schedule, "hold", checked_hold)
        train_layer_major(engine, batches(2, 2))
        assert engine.stats().slots_added == 0
    assert seen and not any(seen), [s for s in seen if s]


class _Raised(Exception):
    """What a block's backward raises at the chosen step (a bug, out of memory)."""


@pytest.mark.parametrize("grads", ["host", "nvme"])
def test_a_layer_major_step_that_raised_in_backward_keeps_no_gradient(tmp_path, grads: str) -> None:
    """A layer-major step whose backward raised in the first block, caught, then the loop goes on: the
    blocks after it had handed their gradients to the homes and counted the step's micro-batches, so
    the retry was refused ("a layer-major step after 2 micro-batch-major backward() calls") and step()
    updated from the head's and the later blocks' gradients alone. Now the step's gradients are dropped,
    as engine.backward() drops them: training goes on bitwise as plain PyTorch's loop that skipped it."""
    model = decoder()
    steps = batches(4, 2)
    cfg = ot.OffloadConfig(
        tiers=dict(params="nvme", grads=grads, optimizer="nvme", nvme_dir=str(tmp_path)), optimizer=OPT, grad_accum_steps=2,
    )
    ref = train_reference(model, steps[:1] + steps[2:])
    with ot.initialize(model, cfg, device="cpu") as engine:
        train_layer_major(engine, steps[:1])
        handle = model.layers[0].register_full_backward_hook(lambda *args: (_ for _ in ()).throw(_Raised()))
        with pytest.raises(_Raised):
            train_layer_major(engine, steps[1:2])
        handle.remove()
        train_layer_major(engine, steps[2:])
        assert_params_equal(ref, engine.full_state_dict())
