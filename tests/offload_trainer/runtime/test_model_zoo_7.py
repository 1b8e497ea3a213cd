"""Models and training loops plain PyTorch trains, through the engine API, round 7 (rounds 1-6:
test_model_zoo.py to test_model_zoo_6.py, whose settings and helpers this file shares): each trains
bitwise equal to plain PyTorch (fused AdamW, weight decay by torch_param_groups, clipping) in fp32 on
one rank, with every loss or output and buffer, or is refused with one line naming what and the fix.
Probed on host homes on the CPU and NVMe homes on the simulated accelerator, two micro-batches a step.

| probed                                                              | result                     |
|---------------------------------------------------------------------|----------------------------|
| `p.data = f(p.data)` outside use: WGAN's weight clipping            | fixed: refused by name     |
| (`p.data = p.data.clamp(-c, c)`), BYOL's moving average in the loop | (the next forward)         |
| `p.data = m * p.data + ...` in forward: MoCo's momentum encoder     | fixed: refused by name     |
|                                                                     | (the eviction)             |
| in-place ops on `p.data` (`p.data.clamp_(-c, c)` in the loop, DINO's| fixed: refused by name     |
| `p.data.mul_(m).add_(...)`, a codebook's `w.data[i] = ...` in       | (model_changes.            |
| forward)                                                            | HeldParameter)             |
| quantization-aware training (torch.ao prepare_qat: fake-quantized   | held (probed, not kept)    |
| weights, observers' buffers), a head called in the loop on the      |                            |
| engine's output, checkpoint(engine, ids) in the loop, user pre-hooks|                            |
| with prepend=True put on before initialize, a custom Function with  |                            |
| mark_dirty, ReLU(inplace) and `out += x` (ResNet), parametrizations |                            |
| (symmetric weight, tanh of a bias)                                  |                            |
| F.embedding(ids, w, max_norm=1.0) in forward                        | refused by name (held)     |
| an integer parameter (`nn.Parameter(torch.randperm(n),              | fixed: refused with a fix  |
| requires_grad=False)`, a frozen index table)                        | that works                 |
| a tensor hook and a post-accumulate-grad hook on a parameter,       | held (probed, not kept)    |
| register_multi_grad_hook over a block's parameters, buffers         |                            |
| reassigned in forward (`self.count = self.count + 1`), nn.Multihead-|                            |
| Attention's eval fast path between steps, vmap inside a block,      |                            |
| `.data` read in forward, weight standardisation, two losses of one  |                            |
| forward (retain_graph)                                              |                            |
| HF Hubert, WavLM, SEW-D, Wav2Vec2-Conformer (rotary), EnCodec, DAC, | held (probed, not kept)    |
| MobileNetV2, LeViT, Dinov2, BEiT (relative position bias), Segformer|                            |
| Swinv2, ViTMAE (random masking), SqueezeBERT, CANINE, BigBird (block|                            |
| sparse), Longformer, Nystromformer, MobileBERT, Gemma, Mixtral,     |                            |
| PhiMoE, JetMoE, Persimmon, BioGPT, CTRL, ImageGPT, YOSO, MRA,       |                            |
| PatchTST                                                            |                            |

The fix: `p.data = t` gives the parameter t's storage, and the engine looked only at the version
counter (which `.data =` does not move) and, outside use, at data_ptr() against the placeholder's,
which is 0 for every empty tensor, so an empty t computed from the placeholder passed. While bound
the eviction put the placeholder back over t; outside use the write changed nothing the engine
trains: either way the weights diverged from plain PyTorch's without a word. Both checks compare the
parameter's storage now, the device copy's while bound and the placeholder's (a 0-element view of a
1-element storage of its own) otherwise ([Note: Parameters changed in place] in
groups/shard_group.py).

An integer (or bool) parameter, which never trains, was refused as a model of mixed dtypes: "pass an
fp32 model (model.float())", which leaves it int64. It is refused by name now, saying to register it
as a buffer (model_claims.refuse_unsupported_features); the engine cannot hold it as a parameter (its
homes, optimizer and checkpoints are floating point).

An in-place op on `p.data` changed a new tensor with a version counter of its own, so neither check
saw it (outside use it changed the empty placeholder, nothing; in forward the device copy the
eviction drops). A held parameter's class is model_changes.HeldParameter while its engine is open,
whose `.data` is `p.detach()` (the same memory, p's counter): the op moves p's `_version` and is
refused as any in-place write ([Note: In-place ops on p.data] in model_changes.py). Left: a
parameter of a user's own nn.Parameter subclass keeps its class and its `.data`, unseen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import offload_trainer as ot
from tests.offload_trainer.runtime.test_engine_parity import accelerator
from tests.offload_trainer.runtime.test_model_zoo import DIM, VOCAB, config, lm_loss, token_batches
from tests.offload_trainer.runtime.test_model_zoo import train_and_compare as zoo_train_and_compare
from tests.offload_trainer.runtime.test_model_zoo_6 import Block, BlocksLM


def clip_weights(model: nn.Module) -> None:
    """WGAN's weight clipping, as its reference code writes it (`p.data = ...`)."""
    for p in model.parameters():
        p.data = p.data.clamp(-0.05, 0.05)


@pytest.mark.parametrize("setting", [("host", 1, "cpu"), ("nvme", 1, "sim")], ids=["host-cpu", "nvme-sim"])
def test_data_given_in_the_loop_is_refused(tmp_path: Path, setting: tuple) -> None:
    """Outside use `p.data` is the empty placeholder, so `p.data.clamp(...)` is another empty tensor:
    its data_ptr() is 0, as the placeholder's was, and the write passed unseen. (That a refused write
    is dropped and training goes on as plain PyTorch's: test_model_zoo_3.py.)"""
    placement, lookahead, device = setting
    torch.manual_seed(0)
    ids = token_batches(1)[0]
    with ot.initialize(BlocksLM(), config(tmp_path, placement, lookahead), device=accelerator(device)) as engine:
        engine.backward(lm_loss(engine(ids), ids))
        engine.step()
        clip_weights(engine.model)
        with pytest.raises(ValueError, match=r"\['layers.0.fc.weight', 'layers.0.fc.bias', 'layers.0.norm.weight'\] were written outside the engine's use") as refused:
            engine(ids)
        assert len(str(refused.value).splitlines()) == 1
        engine.backward(lm_loss(engine(ids), ids))
        assert engine.step()


class MomentumEncoderLM(BlocksLM):
    """MoCo's key encoder: frozen weights following the trained ones by a moving average taken in
    forward, `p_k.data = p_k.data * m + p_q.data * (1 - m)`."""

    def __init__(self) -> None:
        super().__init__()
        self.key_head = nn.Linear(DIM, VOCAB)
        self.key_head.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for p_k, p_q in zip(self.key_head.parameters(), self.head.parameters()):
                p_k.data = p_k.data * 0.9 + p_q.data * 0.1
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h) + self.key_head(h)


@pytest.mark.parametrize("setting", [("host", 1, "cpu"), ("nvme", 1, "sim")], ids=["host-cpu", "nvme-sim"])
def test_data_given_in_forward_is_refused_at_the_eviction(tmp_path: Path, setting: tuple) -> None:
    """While bound, `p.data = t` left the version counter alone and the eviction put the placeholder
    back over t: the moving average was lost at every forward, silently."""
    placement, lookahead, device = setting
    torch.manual_seed(0)
    ids = token_batches(1)[0]
    with ot.initialize(MomentumEncoderLM(), config(tmp_path, placement, lookahead), device=accelerator(device)) as engine:
        with pytest.raises(ValueError, match=r"\['key_head.weight', 'key_head.bias'\] were changed in place or given other data") as refused:
            engine.backward(lm_loss(engine(ids), ids))
        assert len(str(refused.value).splitlines()) == 1
        assert "register_buffer" in str(refused.value)


def clamp_weights_in_place(model: nn.Module) -> None:
    """WGAN's weight clipping as most code writes it."""
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)


class CodebookBlock(Block):
    """A block that edits its own weight through `.data` in forward (a codebook's dead-entry restart, a
    weight kept in range by hand)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.fc.bias.data[0] = 0.0
        return super().forward(h)


@pytest.mark.parametrize("setting", [("host", 1, "cpu"), ("nvme", 1, "sim")], ids=["host-cpu", "nvme-sim"])
def test_in_place_ops_on_data_are_refused(tmp_path: Path, setting: tuple) -> None:
    """`p.data` had a version counter of its own, so neither check saw an in-place op on it: in the loop
    it changed the empty placeholder, in forward the device copy the eviction drops, silently."""
    placement, lookahead, device = setting
    torch.manual_seed(0)
    ids = token_batches(1)[0]
    with ot.initialize(BlocksLM(), config(tmp_path, placement, lookahead), device=accelerator(device)) as engine:
        engine.backward(lm_loss(engine(ids), ids))
        engine.step()
        clamp_weights_in_place(engine.model)
        with pytest.raises(ValueError, match=r"\['layers.0.fc.weight', 'layers.0.fc.bias', 'layers.0.norm.weight'\] were written outside the engine's use"):
            engine(ids)
        engine.backward(lm_loss(engine(ids), ids))
        assert engine.step()
    model = BlocksLM(CodebookBlock)
    with ot.initialize(model, config(tmp_path, placement, lookahead), device=accelerator(device)) as engine:
        with pytest.raises(ValueError, match=r"\['layers.0.fc.bias'\] were changed in place"):
            engine(ids)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # the engine's class goes at close


class IndexTableLM(BlocksLM):
    """A frozen index table kept as a parameter (`nn.Parameter(torch.randperm(n), requires_grad=False)`),
    or, as the refusal says to, as a buffer."""

    def __init__(self, as_buffer: bool = False) -> None:
        super().__init__()
        perm = torch.randperm(DIM)
        if as_buffer:
            self.register_buffer("perm", perm)
        else:
            self.perm = nn.Parameter(perm, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)[..., self.perm]
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_an_integer_parameter_is_refused_with_a_fix_that_works(tmp_path: Path) -> None:
    """Refused with "pass an fp32 model (model.float())", which leaves an int64 parameter int64."""
    with pytest.raises(ValueError, match=r"parameters \['perm'\] are torch.int64, not floating point.*register_buffer") as refused:
        ot.initialize(IndexTableLM(), config(tmp_path, "host", 1))
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.slow
def test_an_index_table_kept_as_a_buffer_trains_bitwise(tmp_path: Path) -> None:
    """The refusal's fix."""
    zoo_train_and_compare(lambda: IndexTableLM(as_buffer=True), tmp_path, ("host", 1, "cpu"), batches=token_batches(2), outputs_and_buffers=True)
