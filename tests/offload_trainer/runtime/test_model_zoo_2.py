"""Models and training loops plain PyTorch trains, through the engine API, round 2 (round 1:
test_model_zoo.py, whose settings and helpers this file shares): each trains bitwise equal to plain
PyTorch (fused AdamW, weight decay by torch_param_groups, clipping) in fp32 on one rank, and here
also every loss or evaluation output the loop computes and every buffer of the model, or is refused
up front with one line naming the feature and the fix.

Found wrong, fixed:
- torch's TransformerEncoderLayer (alone, in nn.TransformerEncoder, in nn.Transformer) in eval mode
  under no_grad, batch_first, takes its fused fast path only when no module of it has forward hooks;
  the engine's hooks made it take the module-by-module path, so an evaluation between training steps
  gave other numbers than plain PyTorch's (its last bits). The engine's hooks of such a module go
  around its call now ([Note: Modules that read their own hooks] in hooks.py);
- a manual learning-rate schedule written into engine.param_groups before each step, as with a torch
  optimizer (nanoGPT's `for g in optimizer.param_groups: g["lr"] = lr`), was overwritten by the
  engine's own schedule at step(), silently: the rates the loop writes are the rates now
  (LearningRates.follows_schedule);
- `module.state_dict()` read in a module's forward (`F.linear(h, self.fc.state_dict()["weight"])`)
  was refused with "it would return no weights", though the acquisition held them: inside a forward
  a module whose parameters are bound gives its state dict;
- the model called itself instead of the engine (`model(x)`, `functional_call(model, {}, (x,))`):
  its modules' hooks fetched their groups, but without the engine's saved-tensor hooks each saved
  weight kept its device slot until backward, and at a device budget the engine's own call trains
  in the step was refused ("all 9 slots hold groups that are in use"). The model's call begins a
  forward with them now where none runs ([Note: The model called itself] in hooks.py);
- torch.func transforms over the model (per-sample gradients: vmap(grad(...)) over
  functional_call(model, ...)) failed in the engine's hooks ("Cannot access data pointer of Tensor
  that doesn't have storage": views of its slots made inside the transform are the transform's
  wrappers); its hooks now work on its buffers outside the transform, and ask nothing of a
  transform's backward;
- a model holding a Lazy module not run yet (nn.LazyLinear) failed half-way through initialize with
  torch's "Attempted to use an uninitialized parameter": refused at its start, naming the
  parameters and saying to run one forward first (after which it trains);
- a block compiled after initialize (`model.layers[1].compile()`) failed inside inductor ("wrong
  number of dimensions1 for op: input"): refused by name at the next forward, as the root already was;
- torch.compile(model) or torch.compile(engine) made after initialize (the engine cannot see such a
  wrapper on the model) failed the same way: refused at its call, seen on the stack (torch.compile's
  wrapper), and training goes on uncompiled;
- nn.Embedding(max_norm=...) renormalises its weight in place in every forward: refused at
  initialize now, not at the end of the first forward, after the step's first batch had run.

Held (they trained right when probed; kept here so they stay so): nn.LSTM, nn.GRU and nn.RNN
(bidirectional, two layers, batch_first both ways, as a block in a ModuleList; their _flat_weights
list the Parameter objects the engine rebinds); nn.MultiheadAttention, nn.TransformerEncoder and
Decoder and nn.Transformer in train mode (dropout included) and with an evaluation under no_grad
between steps, batch_first both ways; the old hook forms torch.nn.utils.weight_norm and
spectral_norm; GroupNorm, LayerNorm without affine or bias, RMSNorm, BatchNorm with and without
affine (cumulative momentum) under gradient accumulation, int and bool buffers and a buffer updated
in forward under no_grad; parameters frozen for some steps and unfrozen again (trainable at
initialize); learning rates per weight-decay group; torch.func.functional_call over the model (its
parameters passed, or none); F.linear of a weight's slice, weights through
.to()/.float() in forward, a tied head as `h @ self.emb.weight.t()`, a parameter of shape () and
one of 0 elements; torch.autocast(cpu, bfloat16) around the forward (and the loss), with and
without activation checkpointing.

Not expressible through the engine's API, so not probed: param groups other than the weight-decay
split (a head at 10x the rate), and parameters added to the optimizer later (the engine's optimizer
takes every parameter trainable at initialize).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

import offload_trainer as ot
from offload_trainer.runtime.optimizer import torch_param_groups
from tests.offload_trainer.runtime.test_engine_parity import accelerator
from tests.offload_trainer.runtime.test_model_zoo import (
    DIM, OPT, SETTINGS, VOCAB, Block, ZooLM, config, lm_loss, token_batches,
)
from tests.offload_trainer.runtime.test_model_zoo import train_and_compare as zoo_train_and_compare

Backward = Callable[..., None]
Step = Callable[[Callable[..., Any], nn.Module, Backward, torch.Tensor], Optional[torch.Tensor]]
IDS = ["-".join(map(str, s)) for s in SETTINGS]


def plain_step(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(run(ids), ids)
    backward(loss)
    return loss.detach()


def train_and_compare(
    build: Callable[[], nn.Module],
    tmp_path: Path,
    setting: Tuple[str, int, str] = ("host", 1, "cpu"),
    step: Step = plain_step,
    accum: int = 1,
) -> ot.Engine:
    """test_model_zoo.train_and_compare, and also: what each `step` returns (a loss, an evaluation's
    output) and the model's buffers at the end must equal plain PyTorch's."""
    return zoo_train_and_compare(build, tmp_path, setting, step, accum, outputs_and_buffers=True)


def evaluation_between(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> torch.Tensor:
    """An evaluation forward in eval mode under no_grad (torch's fast paths), then a training step;
    the evaluation's output is compared."""
    run.eval()
    with torch.no_grad():
        out = run(ids)
    run.train()
    backward(lm_loss(run(ids), ids))
    return out


def causal_mask(n: int) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(n)


# -- fixed: modules that read their own hooks ----------------------------------------------------------


class EncoderLM(nn.Module):
    def __init__(self, batch_first: bool, norm_first: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout, batch_first=batch_first, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) if self.batch_first else self.emb(ids).transpose(0, 1)
        h = self.enc(h, mask=causal_mask(ids.shape[1]), is_causal=True)
        return self.head(h if self.batch_first else h.transpose(0, 1))


class TransformerLM(nn.Module):
    """nn.Transformer, the source the reversed tokens."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, DIM)
        self.t = nn.Transformer(DIM, 2, 2, 2, 2 * DIM, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        src, tgt = self.emb(ids.flip(1)), self.emb(ids)
        if not self.batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        h = self.t(src, tgt, tgt_mask=causal_mask(ids.shape[1]))
        return self.head(h if self.batch_first else h.transpose(0, 1))


def some_slow(default: List[int]) -> List[Any]:
    """SETTINGS, those not in `default` marked slow."""
    return [pytest.param(s, id=i, marks=() if k in default else pytest.mark.slow) for k, (s, i) in enumerate(zip(SETTINGS, IDS))]


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("setting", some_slow([1]))
def test_an_encoder_evaluated_between_steps_takes_plain_pytorchs_fast_path(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    """The evaluations' outputs differed (fast path in plain PyTorch, the slow one under the engine's hooks)."""
    fast = torch._transformer_encoder_layer_fwd
    calls = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fast(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_transformer_encoder_layer_fwd", counted)
        train_and_compare(lambda: EncoderLM(True), tmp_path / "enc", setting, evaluation_between)
        assert len(calls) == 2 * 4 * 3  # plain PyTorch's and the engine's 4 evaluations, 3 layers each
        if setting == SETTINGS[2]:
            train_and_compare(lambda: TransformerLM(True), tmp_path / "t", setting, evaluation_between)


# -- fixed: learning rates the loop writes ----------------------------------------------------------


@pytest.mark.parametrize("setting", some_slow([3]))
def test_learning_rates_written_into_param_groups_apply_as_in_torch(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    """nanoGPT's schedule: each step's rate written into every param group before the step, here
    another per weight-decay group. The engine's own schedule overwrote them at step()."""
    placement, lookahead, device = setting
    torch.manual_seed(0)
    model = ZooLM()
    torch.manual_seed(0)
    ref = ZooLM()
    opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    with ot.initialize(model, config(tmp_path, placement, lookahead), device=accelerator(device)) as engine:
        assert [g["weight_decay"] for g in engine.param_groups] == [g["weight_decay"] for g in opt.param_groups]
        for k, ids in enumerate(token_batches()):
            for groups in (opt.param_groups, engine.param_groups):
                for i, group in enumerate(groups):
                    group["lr"] = OPT.lr * (k + 1) / 4 * (1 + 2 * i)
            lm_loss(ref(ids), ids).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.backward(lm_loss(engine(ids), ids))
            assert engine.step()
        assert [g["lr"] for g in engine.param_groups] == [g["lr"] for g in opt.param_groups]
        state = engine.full_state_dict()
        saved = engine.lr_optimizer.state_dict()
    assert all(torch.equal(p.detach(), state[n]) for n, p in ref.named_parameters())
    assert saved["written_by_loop"]


# -- fixed: a state dict read in forward ----------------------------------------------------------


class StateDictReader(nn.Module):
    """Reads a child's weight through its state dict (a detached tensor: no gradient through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + F.linear(h, self.fc.state_dict()["weight"]) + self.fc(h)
        return self.head(h)


@pytest.mark.parametrize("setting", some_slow([1]))
def test_a_state_dict_read_in_forward(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    engine = train_and_compare(StateDictReader, tmp_path, setting)
    with pytest.raises(ot.UnresidentReadError, match=r"state_dict\(\) reached module 'emb'.*closed"):
        engine.model.state_dict()  # outside a forward: refused as before


# -- fixed: the model called itself --------------------------------------------------------------------


class DeepLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(12)])
        self.head = nn.Linear(64, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


@pytest.mark.parametrize("how", [pytest.param("engine", marks=pytest.mark.slow), "model", "functional_call"])
def test_the_model_called_itself_under_a_small_device_budget(tmp_path: Path, how: str) -> None:
    """Called itself, the model ran without the engine's saved-tensor hooks: each block's saved
    weights kept its slot, and the step was refused ("all 9 slots hold groups that are in use ...
    needs at least 10 slots") at a budget the engine's own call trains in."""
    torch.manual_seed(0)
    model = DeepLM()
    torch.manual_seed(0)
    ref = DeepLM()
    opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    tiers = {"params": "host", "grads": "host", "optimizer": "host", "nvme_dir": str(tmp_path), "device_budget_bytes": 200_000}
    cfg = ot.OffloadConfig(tiers=tiers, prefetch={"lookahead_groups": 1}, optimizer=OPT)
    run: Dict[str, Callable[..., Any]] = {}
    with ot.initialize(model, cfg, device="cpu") as engine:
        run = {"engine": engine, "model": model, "functional_call": lambda x: functional_call(model, {}, (x,))}
        for ids in token_batches(2):
            lm_loss(ref(ids), ids).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
            engine.backward(lm_loss(run[how](ids), ids))
            assert engine.step()
        assert engine.stats().slots_added == 0
        state = engine.full_state_dict()
    assert all(torch.equal(p.detach(), state[n]) for n, p in ref.named_parameters())


def per_sample_gradients(model: nn.Module, params: Dict[str, torch.Tensor], ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    def loss(p: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return lm_loss(functional_call(model, p, (x[None],)), x[None])

    return vmap(grad(loss), in_dims=(None, 0))(params, ids)


def test_per_sample_gradients_through_torch_func(tmp_path: Path) -> None:
    """vmap(grad(...)) over functional_call of the engine's model, with every parameter given, and
    grad alone with the head's only (the rest the engine's): the engine's hooks failed inside the
    transform ("Cannot access data pointer of Tensor that doesn't have storage": the slot views they
    made were the transform's wrappers), and once past that the model's own call refused
    ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks")."""
    ids = token_batches(1)[0]
    torch.manual_seed(0)
    ref = ZooLM()
    torch.manual_seed(0)
    model = ZooLM()
    expected = per_sample_gradients(ref, {k: v.detach() for k, v in ref.named_parameters()}, ids)
    head = {k: v.detach() for k, v in ref.head.named_parameters(prefix="head")}
    expected_head = grad(lambda p: lm_loss(functional_call(ref, p, (ids,)), ids))(head)
    with ot.initialize(model, config(tmp_path, "nvme", 1), device=accelerator("sim")) as engine:
        got = per_sample_gradients(model, engine.full_state_dict(), ids)
        got_head = grad(lambda p: lm_loss(functional_call(model, p, (ids,)), ids))(head)
        engine.backward(lm_loss(engine(ids), ids))  # and training goes on
        assert engine.step()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert all(torch.equal(expected_head[k], got_head[k]) for k in expected_head)


# -- refused up front ------------------------------------------------------------------------------


def test_a_block_compiled_after_initialize_is_refused_by_name(tmp_path: Path) -> None:
    """It failed inside inductor ("wrong number of dimensions1 for op: input")."""
    pytest.importorskip("torch._dynamo")
    model = ZooLM()
    ids = token_batches(1)[0]
    with ot.initialize(model, config(tmp_path, "host", 1)) as engine:
        model.layers[1].compile()
        with pytest.raises(ValueError, match=r"'layers.1' is compiled with torch.compile.*do not compile it after initialize"):
            engine(ids)


@pytest.mark.parametrize("what", ["model", pytest.param("engine", marks=pytest.mark.slow)])
def test_torch_compile_after_initialize_is_refused_and_training_goes_on(tmp_path: Path, what: str) -> None:
    """torch.compile(model) or torch.compile(engine) made after initialize: the engine cannot see the
    wrapper on the model, and dynamo failed inside inductor ("wrong number of dimensions1 for op:
    input"), having traced the hooks with the empty placeholders."""
    pytest.importorskip("torch._dynamo")
    model = ZooLM()
    ids = token_batches(1)[0]
    with ot.initialize(model, config(tmp_path, "host", 1)) as engine:
        compiled = torch.compile(model if what == "model" else engine)
        with pytest.raises(ValueError, match=r"called through torch.compile.*call the engine \(or the model\) uncompiled"):
            compiled(ids)
        engine.backward(lm_loss(engine(ids), ids))
        assert engine.step()


class MaxNormLM(nn.Module):
    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, DIM, max_norm=1.0) if bag else nn.Embedding(VOCAB, DIM, max_norm=1.0)
        self.head = nn.Linear(DIM, VOCAB)


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding-bag"])
def test_max_norm_embeddings_are_refused_at_initialize(tmp_path: Path, bag: bool) -> None:
    """Refused at the end of the first forward before, by the in-place change it had made."""
    model = MaxNormLM(bag)
    with pytest.raises(ValueError, match=r"module 'emb' \(Embedding(Bag)?\) is built with max_norm=1.0.*max_norm=None"):
        ot.initialize(model, config(tmp_path, "host", 1))
    assert model.emb.weight.shape == (VOCAB, DIM)  # the model is left as it was


class LazyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.LazyLinear(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.emb(ids)))


def test_a_lazy_module_not_run_yet_is_refused_and_trains_once_run(tmp_path: Path) -> None:
    """Its UninitializedParameters failed half-way through initialize, inside the partition, with
    torch's "Attempted to use an uninitialized parameter in <method 'dim' ...>"."""
    with pytest.raises(ValueError, match=r"\['fc.weight', 'fc.bias'\] are not initialized yet.*run one forward"):
        ot.initialize(LazyLM(), config(tmp_path, "host", 1))

    def run_once() -> nn.Module:
        model = LazyLM()
        model(token_batches(1)[0])
        return model

    train_and_compare(run_once, tmp_path)


# -- held ------------------------------------------------------------------------------------------


class RecurrentLM(nn.Module):
    def __init__(self, kind: str, bidirectional: bool, layers: int, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, DIM)
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]
        self.rnn = rnn(DIM, DIM, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
        self.head = nn.Linear(DIM * (2 if bidirectional else 1), VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) if self.batch_first else self.emb(ids).transpose(0, 1)
        out = self.rnn(h)[0]
        return self.head(out if self.batch_first else out.transpose(0, 1))


class GRUBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.rnn = nn.GRU(DIM, DIM, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.rnn(self.norm(x))[0]


class GRUBlocksLM(ZooLM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([GRUBlock() for _ in range(3)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(0, 3, self.emb(ids)))


class AttentionLM(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, DIM)
        self.attn = nn.ModuleList([nn.MultiheadAttention(DIM, 2, batch_first=batch_first) for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) if self.batch_first else self.emb(ids).transpose(0, 1)
        for attn in self.attn:
            h = h + attn(h, h, h, need_weights=False)[0]
        return self.head(h if self.batch_first else h.transpose(0, 1))


class DecoderLM(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, DIM)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(DIM, 2, 2 * DIM, 0.0, batch_first=batch_first), 2)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, memory = self.emb(ids), self.emb(ids.flip(1))
        if not self.batch_first:
            h, memory = h.transpose(0, 1), memory.transpose(0, 1)
        h = self.dec(h, memory, tgt_mask=causal_mask(ids.shape[1]), tgt_is_causal=True)
        return self.head(h if self.batch_first else h.transpose(0, 1))


class OldNormsLM(ZooLM):
    """The hook forms: a forward pre-hook computes `weight` from weight_g and weight_v (weight_norm) or
    from weight_orig and the buffers weight_u, weight_v (spectral_norm)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        for layer in self.layers:
            (nn.utils.weight_norm if how == "weight_norm" else nn.utils.spectral_norm)(layer.fc1)
        if how == "weight_norm":
            nn.utils.weight_norm(self.head, dim=None)


class NormsAndBuffersLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.gn = nn.GroupNorm(4, DIM)
        self.ln = nn.LayerNorm(DIM, elementwise_affine=False)
        self.ln_no_bias = nn.LayerNorm(DIM, bias=False)
        self.bn = nn.BatchNorm1d(DIM)
        self.bn_cumulative = nn.BatchNorm1d(DIM, affine=False, momentum=None)
        self.rms = nn.RMSNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(VOCAB, dtype=torch.bool))
        self.register_buffer("mean", torch.zeros(DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            self.seen[ids.flatten()] = True
        h = self.emb(ids)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(h.mean((0, 1)), alpha=0.1)
        h = self.gn(h.transpose(1, 2)).transpose(1, 2)
        h = self.ln(h) + self.ln_no_bias(h)
        h = self.bn_cumulative(self.bn(h.transpose(1, 2))).transpose(1, 2)
        h = self.rms(torch.tanh(self.fc(h)))
        return self.head(h) + 0.01 * self.calls + 0.001 * self.seen.float().sum() + self.mean.sum()


class WeightUsesLM(ZooLM):
    """A weight's slice in F.linear, weights through .to()/.float(), a scalar and an empty parameter,
    and a tied head as the embedding's weight transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 2 * DIM)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.empty = nn.Parameter(torch.zeros(0, DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.run(0, 4, self.emb(ids))
        h = h + F.linear(h, self.proj.weight[:DIM], self.proj.bias[:DIM])
        h = h + F.linear(h, self.proj.weight.to(torch.float32).float()[DIM:], self.proj.bias.to(h.dtype)[DIM:])
        h = h * self.scale + self.empty.sum()
        return h @ self.emb.weight.t()


def freezing_some_steps(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> torch.Tensor:
    """Block 1 frozen for the second and third step, the head's bias for the third: torch.optim skips
    a parameter without a gradient (its step count too), and so does the engine."""
    k = model.__dict__.setdefault("step_calls", 0)
    model.__dict__["step_calls"] = k + 1
    model.layers[1].requires_grad_(k not in (1, 2))  # type: ignore[index]
    model.head.bias.requires_grad_(k != 2)  # type: ignore[union-attr]
    return plain_step(run, model, backward, ids)


def through_functional_call(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(functional_call(model, dict(model.named_parameters()), (ids,)), ids)
    backward(loss)
    return loss.detach()


def calling_the_model(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> torch.Tensor:
    return plain_step(model, model, backward, ids)


def under_autocast(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = run(ids)
        loss = lm_loss(logits, ids) + lm_loss(logits.float(), ids)
    backward(loss)
    return loss.detach()


HELD: Dict[str, Tuple[Callable[[], nn.Module], Step]] = {
    "lstm bidirectional 2 layers": (lambda: RecurrentLM("lstm", True, 2, True), plain_step),
    "gru sequence first": (lambda: RecurrentLM("gru", False, 1, False), plain_step),
    "rnn bidirectional sequence first": (lambda: RecurrentLM("rnn", True, 2, False), plain_step),
    "gru blocks": (GRUBlocksLM, plain_step),
    "attention batch first": (lambda: AttentionLM(True), evaluation_between),
    "attention sequence first": (lambda: AttentionLM(False), evaluation_between),
    "encoder sequence first, dropout": (lambda: EncoderLM(False, True, 0.1), evaluation_between),
    "decoder": (lambda: DecoderLM(True), plain_step),
    "decoder sequence first": (lambda: DecoderLM(False), evaluation_between),
    "transformer sequence first": (lambda: TransformerLM(False), evaluation_between),
    "weight_norm": (lambda: OldNormsLM("weight_norm"), evaluation_between),
    "spectral_norm": (lambda: OldNormsLM("spectral_norm"), evaluation_between),
    "norms and buffers": (NormsAndBuffersLM, evaluation_between),
    "frozen some steps": (ZooLM, freezing_some_steps),
    "functional_call": (ZooLM, through_functional_call),
    "the model called": (ZooLM, calling_the_model),  # at the default budget; at a small one: above
    "weight uses": (WeightUsesLM, plain_step),
    "autocast": (WeightUsesLM, under_autocast),
    "autocast, checkpointed": (lambda: ZooLM("ckpt inside"), under_autocast),
}
DEFAULT = {"lstm bidirectional 2 layers", "norms and buffers", "weight uses", "autocast"}


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True", "ignore:.*torch.nn.utils.weight_norm is deprecated")
@pytest.mark.parametrize(
    "setting", [pytest.param(SETTINGS[1], marks=pytest.mark.slow, id=IDS[1]), pytest.param(SETTINGS[2], id=IDS[2])]
)
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in DEFAULT else pytest.mark.slow) for c in sorted(HELD)]
)
def test_held_models_and_loops_train_bitwise(tmp_path: Path, case: str, setting: Tuple[str, int, str]) -> None:
    build, step = HELD[case]
    train_and_compare(build, tmp_path, setting, step, accum=2 if case == "norms and buffers" else 1)
