"""Models outside the decoder family, trained through the engine bitwise equal to plain PyTorch
(fused AdamW, weight decay by torch_param_groups, clipping), buffers included:

- forward pre-hooks that read the module's parameters (torch.nn.utils.spectral_norm computes
  `weight` from `weight_orig` in one): the engine's acquisition runs first;
- a ModuleList handed to a function that reads its layers' weights (HF Reformer's reversible
  function): the caller's group holds them;
- BatchNorm's running statistics (buffers updated in forward) across train()/eval() switches and
  an evaluation forward under no_grad between steps; nn.LSTM's flat weights;
- mixture-of-experts layers whose idle experts get no gradient (a ModuleList of experts, top-1 of
  8, one token or three), with gradient accumulation; HF Mixtral's fused experts, top-1 of 16;
- a parameter changed in place in forward (a no_grad clamp_): refused by name, since the engine
  would lose the change; so is a parameter frozen at initialize and unfrozen later
  (freezing later trains as torch.optim does: no gradient, no update).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload_trainer as ot
from offload_trainer.runtime.device.host import SimulatedAccelerator
from offload_trainer.runtime.optimizer import torch_param_groups

OPT = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
VOCAB = 32
PLACEMENTS = {
    "host": dict(params="host", grads="host", optimizer="host"),
    "nvme": dict(params="nvme", grads="nvme", optimizer="nvme"),
    # Updated on the (simulated) device, its step counts kept there ([Note: Step counts on the device]).
    "device": dict(params="device", grads="device", optimizer="device"),
}


def token_batches(n: int = 3, batch: int = 2, seq: int = 6) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def lm_loss(model: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def train_and_compare(
    build: Callable[[], nn.Module],
    batches: Sequence[Any],
    loss_fn: Callable[[Callable[..., Any], Any], torch.Tensor],
    tmp_path: Path,
    placement: str = "host",
    simulated: bool = False,
    accum: int = 1,
    modes: Sequence[bool] = (True,),
    evaluate_between: bool = False,
    grouping: Optional[dict] = None,
) -> None:
    """Steps of `accum` micro-batches each, the model in mode modes[step % len(modes)]; with
    `evaluate_between`, a forward under eval() and no_grad after each step (its loss compared too)."""
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    ref = build()
    torch_opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    tiers = dict(PLACEMENTS[placement], nvme_dir=str(tmp_path))
    cfg = ot.OffloadConfig(
        tiers=tiers, prefetch={"lookahead_groups": 1}, optimizer=OPT, grad_accum_steps=accum, grouping=grouping or {}
    )
    device = SimulatedAccelerator(h2d_delay_s=0.001, d2h_delay_s=0.001) if simulated else "cpu"
    evaluations: List[List[float]] = [[], []]
    with ot.initialize(model, cfg, device=device) as engine:
        for step in range(len(batches) // accum):
            micro = batches[step * accum : (step + 1) * accum]
            mode = modes[step % len(modes)]
            for side, run in enumerate((ref, engine)):
                run.train(mode)
                for x in micro:
                    loss = loss_fn(run, x) / accum
                    if run is ref:
                        loss.backward()
                    else:
                        engine.backward(loss)
                        engine.step()
                if run is ref:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
                    torch_opt.step()
                    torch_opt.zero_grad()
                if evaluate_between:
                    run.eval()
                    with torch.no_grad():
                        evaluations[side].append(loss_fn(run, batches[0]).item())
        state = engine.full_state_dict()
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    bad += [n for n, b in ref.named_buffers() if not torch.equal(b, buffers[n])]
    assert not bad, f"differ from plain PyTorch: {bad}"
    assert evaluations[0] == evaluations[1]


# -- forward pre-hooks that read parameters ----------------------------------------------------


class SpectralNormLM(nn.Module):
    """torch.nn.utils.spectral_norm (the hook form): a forward pre-hook computes `weight` from the
    parameter `weight_orig` and updates the buffers `weight_u`, `weight_v`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.mid = nn.utils.spectral_norm(nn.Linear(16, 16))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_pre_hook_reading_parameters(tmp_path: Path, placement: str) -> None:
    train_and_compare(SpectralNormLM, token_batches(), lm_loss, tmp_path, placement, evaluate_between=True)


# -- a ModuleList handed to a function -----------------------------------------------------------


def _run_layers(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = x + torch.tanh(F.linear(x, layer.weight, layer.bias))  # the layers' weights, never a call
    return x


class HandsLayersOn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(_run_layers(self.layers, self.emb(ids)))


def test_module_list_handed_to_a_function(tmp_path: Path) -> None:
    train_and_compare(HandsLayersOn, token_batches(), lm_loss, tmp_path, "nvme", simulated=True)


# -- buffers updated in forward, mode switches ---------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        return self.head(F.relu(self.bn2(self.conv2(x))).mean((2, 3)))


def image_batches(n: int = 3) -> List[Any]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(n)]


def image_loss(model: Callable[..., Any], batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("placement,simulated", [("host", False), ("nvme", True)])
def test_batchnorm_buffers_across_mode_switches(tmp_path: Path, placement: str, simulated: bool) -> None:
    train_and_compare(SmallCNN, image_batches(), image_loss, tmp_path, placement, simulated, modes=(True, False), evaluate_between=True)


def test_batchnorm_buffers_with_accumulation(tmp_path: Path) -> None:
    train_and_compare(SmallCNN, image_batches(4), image_loss, tmp_path, "nvme", accum=2)


class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.rnn = nn.LSTM(16, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0])


def test_lstm_flat_weights(tmp_path: Path) -> None:
    train_and_compare(LSTMLM, token_batches(), lm_loss, tmp_path, "nvme", simulated=True)


# -- experts that get no tokens ------------------------------------------------------------------


class ListMoE(nn.Module):
    """Top-1 of 8 experts, each a module of its own: an expert without tokens is not called and its
    parameters get no gradient (AdamW leaves them, weight decay included, as it leaves any)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.router = nn.Linear(16, 8, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(8))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).flatten(0, 1)
        weight, chosen = self.router(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows = chosen == e
            out[rows] = self.experts[e](x[rows]) * weight[rows, None]
        return self.head(self.norm(x + out).view(*ids.shape, -1))


@pytest.mark.parametrize("accum", [1, 2])
def test_idle_experts(tmp_path: Path, accum: int) -> None:
    train_and_compare(ListMoE, token_batches(3 * accum, 1, 3), lm_loss, tmp_path, "nvme", simulated=True, accum=accum, evaluate_between=True)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_experts_in_turn_in_one_group(tmp_path: Path, placement: str) -> None:
    """All 8 experts in one group (the model's only ModuleList is the experts: min_group_bytes merges
    them), so the group's pattern of parameters with a gradient changes every step, some seen again
    after idle steps ([Note: Gradient patterns] in runtime/optimizer.py): each parameter's step count
    must move only when it got a gradient, updated on the host and on the device."""
    train_and_compare(
        ListMoE, token_batches(8, 1, 3), lm_loss, tmp_path, placement, simulated=placement == "device",
        grouping={"min_group_bytes": "1MiB", "max_group_bytes": "1MiB"},
    )


def test_hf_mixtral_idle_experts(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, num_local_experts=16, num_experts_per_tok=1,
    )

    def loss(model: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    train_and_compare(lambda: transformers.MixtralForCausalLM(config), token_batches(4, 1, 4), loss, tmp_path, "nvme", accum=2)


# -- refused: a parameter changed in place ---------------------------------------------------------


class ClampingLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.emb.weight.clamp_(-0.5, 0.5)  # WGAN-style weight clipping, in forward
        return self.head(self.emb(ids))


def test_parameter_changed_in_place_is_refused(tmp_path: Path) -> None:
    """(nn.Embedding(max_norm=...), which does this in every forward, is refused at initialize:
    test_model_zoo_2.py.)"""
    with pytest.raises(ValueError, match=r"\['emb.weight'\] were changed in place"):
        train_and_compare(ClampingLM, token_batches(), lm_loss, tmp_path)


# -- requires_grad changed after initialize --------------------------------------------------------


class TwoLayerLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_freezing_after_initialize_skips_the_parameter(tmp_path: Path) -> None:
    """A parameter frozen between steps gets no gradient: skipped, as torch.optim skips it."""
    frozen_at = {"step": 0}

    def loss(model: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
        target = model.model if isinstance(model, ot.Engine) else model
        frozen_at["step"] += 1
        target.head.bias.requires_grad_(frozen_at["step"] <= 2)  # each side's second step on: frozen
        return lm_loss(model, ids)

    train_and_compare(TwoLayerLM, token_batches(2), loss, tmp_path)


def test_unfreezing_after_initialize_is_refused(tmp_path: Path) -> None:
    model = TwoLayerLM()
    model.head.weight.requires_grad_(False)
    cfg = ot.OffloadConfig(tiers=dict(PLACEMENTS["host"], nvme_dir=str(tmp_path)), optimizer=OPT)
    ids = token_batches(1)[0]
    with ot.initialize(model, cfg, device="cpu") as engine:
        engine.backward(lm_loss(engine, ids))
        engine.step()
        model.head.weight.requires_grad_(True)
        with pytest.raises(ValueError, match=r"\['head.weight'\] were frozen .* set requires_grad before it"):
            engine.backward(lm_loss(engine, ids))
        model.head.weight.requires_grad_(False)  # and training goes on
        engine.backward(lm_loss(engine, ids))
        assert engine.step()
