"""Models and training loops plain PyTorch trains, through the engine API: each trains bitwise equal
to plain PyTorch (fused AdamW, weight decay by torch_param_groups, clipping) in fp32 on one rank,
host and NVMe homes, lookahead 1 and 2, on the CPU and on the simulated accelerator (copies landing
late), or is refused up front with one line naming the feature and the fix.

Found wrong, fixed:
- parameters that are not row-major (`model.to(memory_format=torch.channels_last)`, a weight stored
  transposed) were bound as row-major views: plain PyTorch ran channels_last convolutions (another
  matmul for the transposed weight), the engine row-major ones, and the results differed in their
  last bits. Their memory order is kept now ([Note: Parameter memory order] in layout/partition.py),
  and a checkpoint of another memory order is refused by name;
- nn.Embedding(sparse=True) failed in backward with "reshape is not implemented for sparse
  tensors" (torch.optim.AdamW refuses sparse gradients too): refused at initialize, and a sparse
  gradient from F.embedding(..., sparse=True) at its first backward; complex parameters were
  refused with "pass an fp32 model (model.float())", which leaves them complex; a TorchScript block
  failed half-way through initialize() (torch: "register_forward_pre_hook is not supported on
  ScriptModules"), leaving the model's parameters placeholders: refused before anything is taken;
- a ViT's root adds its cls_token and pos_embed (parameters of its own) before calling its
  blocks: backward reached their gradients after the blocks' acquisitions had evicted the root's
  group, and autograd's AccumulateGrad met the empty placeholder ("The size of tensor a (0) must
  match the size of tensor b (16)"), whether the blocks were a ModuleList or an nn.Sequential of
  modules each hooked alone ([Note: Gradients after the acquisition moved on] in hooks.py);
- a module returning a parameter as it is (a soft prompt; a position table, frozen, beside a
  trainable one in a tuple): the module's release unbound the Parameter before its output was
  routed, so the caller got the empty placeholder ("Sizes of tensors must match ... Expected size
  0"), with grad enabled or not;
- `self.head.forward(h)`, `layer.forward(h)`: taken for calls of the modules, whose hooks would
  fetch their weights, but `.forward` runs no hook, and they computed on placeholders ("mat2 must
  be a matrix"): now a read, so the caller's acquisition holds them;
- a block called twice under reentrant checkpointing: each recomputation's nested backward
  accumulates into the parameters on its own, and where gradients pass through host staging (an
  accelerator; NVMe homes) the second overwrote the first while the group's staging entry was not
  flushed yet (copies still landing, or a parameter of the group that gets no gradient);
- a reversible block (RevNet, Reformer: a custom autograd.Function that takes the weights as inputs,
  returns None for them, and computes their gradients in its backward with a nested
  torch.autograd.backward) failed an assertion: autograd runs a parameter's post-accumulate-grad
  hook even where no gradient came, with `.grad` None.

Held (they trained right when probed; kept here so they stay so): activation checkpointing inside a
block (reentrant and not) and around several blocks; torch.nn.utils.parametrize (orthogonal,
weight_norm); a parameter or a module shared by two blocks that are not adjacent; a block called
several times per forward (a universal transformer); two forwards before one backward; a gradient
penalty through torch.autograd.grad(create_graph=True) on the input and on parameters; a custom
autograd.Function keeping its weight on ctx; user forward hooks and pre-hooks that change inputs and
outputs, and a loss over outputs a user hook collected; blocks returning a dataclass pytree does not
know; dropout with gradient accumulation; a GAN with an engine for each network (the
discriminator frozen for the generator's loss, as GAN code does; unfrozen, its engine refuses the
gradients, and says now that another engine's backward brought them and how to freeze it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.parametrizations import orthogonal, weight_norm
from torch.utils.checkpoint import checkpoint

import offload_trainer as ot
from offload_trainer.runtime.optimizer import torch_param_groups
from tests.offload_trainer.runtime.test_engine_parity import accelerator

OPT = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
VOCAB = 32
DIM = 16
# (placement, lookahead, device): every placement and lookahead once, each device twice.
SETTINGS = [("host", 1, "cpu"), ("nvme", 2, "cpu"), ("host", 2, "sim"), ("nvme", 1, "sim")]

Backward = Callable[..., None]
Step = Callable[[Callable[..., Any], nn.Module, Backward, torch.Tensor], None]


def token_batches(n: int = 4) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, 6), generator=g) for _ in range(n)]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def plain_step(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> None:
    backward(lm_loss(run(ids), ids))


def config(tmp_path: Path, placement: str, lookahead: int, accum: int = 1) -> ot.OffloadConfig:
    tiers = {"params": placement, "grads": placement, "optimizer": placement, "nvme_dir": str(tmp_path)}
    return ot.OffloadConfig(tiers=tiers, prefetch={"lookahead_groups": lookahead}, optimizer=OPT, grad_accum_steps=accum)


def train_and_compare(
    build: Callable[[], nn.Module],
    tmp_path: Path,
    setting: Tuple[str, int, str] = ("host", 1, "cpu"),
    step: Step = plain_step,
    accum: int = 1,
    batches: Optional[List[torch.Tensor]] = None,
    outputs_and_buffers: bool = False,
) -> ot.Engine:
    """Train build() with plain PyTorch and through the engine on the same batches; `step(run, model,
    backward, x)` is one micro-batch's forward and backward (`run` the model or the engine, `backward`
    loss.backward or engine.backward, each taking retain_graph); the torch seed is the same for both.
    `outputs_and_buffers`: what each `step` returns (a loss, an evaluation's output) and the model's
    buffers at the end must equal plain PyTorch's too."""
    placement, lookahead, device = setting
    batches = batches if batches is not None else token_batches()
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    ref = build()  # not a deepcopy: a hook's closure would still point at the first model
    torch_opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    outputs: Dict[str, List[Optional[torch.Tensor]]] = {"plain": [], "engine": []}
    with ot.initialize(model, config(tmp_path, placement, lookahead, accum), device=accelerator(device)) as engine:
        for k in range(len(batches) // accum):
            micro = batches[k * accum : (k + 1) * accum]
            torch.manual_seed(100 + k)
            for x in micro:
                outputs["plain"].append(step(ref, ref, lambda loss, **kw: (loss / accum).backward(**kw), x))
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            torch_opt.step()
            torch_opt.zero_grad()
            torch.manual_seed(100 + k)
            for x in micro:
                outputs["engine"].append(step(engine, model, lambda loss, **kw: engine.backward(loss / accum, **kw), x))
                engine.step()
        state = engine.full_state_dict()
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    if outputs_and_buffers:
        buffers = dict(model.named_buffers())
        bad += [f"buffer {n}" for n, b in ref.named_buffers() if not torch.equal(b, buffers[n])]
        bad += [
            f"output {i}" for i, (a, b) in enumerate(zip(outputs["plain"], outputs["engine"]))
            if a is not None and (b is None or not torch.equal(a, b))
        ]
    assert not bad, f"differ from plain PyTorch: {bad}"
    return engine


# -- parameters that are not row-major ---------------------------------------------------------------


class ChannelsLastCNN(nn.Module):
    """Conv2d blocks made channels_last the way PyTorch's guide does (model.to(memory_format=...)),
    inputs left row-major, and a head whose weight is stored transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8 * 4 * 4)
        self.convs = nn.ModuleList([nn.Conv2d(8, 8, 3, padding=1) for _ in range(3)])
        self.head = nn.Linear(8 * 4 * 4, VOCAB)
        self.to(memory_format=torch.channels_last)
        self.head.weight = nn.Parameter(self.head.weight.detach().t().contiguous().t())
        self.seen_channels_last: List[bool] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.emb(ids).view(b * t, 8, 4, 4)
        for conv in self.convs:
            self.seen_channels_last.append(conv.weight.is_contiguous(memory_format=torch.channels_last))
            h = h + torch.tanh(conv(h))
        return self.head(h.flatten(1)).view(b, t, -1)


@pytest.mark.parametrize("setting", SETTINGS, ids=["-".join(map(str, s)) for s in SETTINGS])
def test_parameters_keep_their_memory_order(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    """The engine bound every parameter as a row-major view of its slot: the convolutions ran
    row-major where plain PyTorch's ran channels_last, and every parameter differed after a step."""
    engine = train_and_compare(ChannelsLastCNN, tmp_path, setting, accum=2)
    model = engine.model
    assert isinstance(model, ChannelsLastCNN) and model.seen_channels_last and all(model.seen_channels_last)


def test_checkpoints_and_exports_keep_the_memory_order(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = config(tmp_path, "nvme", 1)
    with ot.initialize(ChannelsLastCNN(), cfg) as engine:
        ids = token_batches(1)[0]
        engine.backward(lm_loss(engine(ids), ids))
        engine.step()
        saved = engine.full_state_dict()
        engine.save_checkpoint(tmp_path / "ckpt")
        engine.export_safetensors(tmp_path / "weights.safetensors")
    for load in (lambda e: e.load_checkpoint(tmp_path / "ckpt"), lambda e: e.load_safetensors([tmp_path / "weights.safetensors"])):
        with ot.initialize(ChannelsLastCNN(), cfg) as engine:
            load(engine)
            loaded = engine.full_state_dict()
            assert all(torch.equal(saved[n], loaded[n]) for n in saved)
            assert loaded["convs.0.weight"].is_contiguous(memory_format=torch.channels_last)
    row_major = ChannelsLastCNN().to(memory_format=torch.contiguous_format)
    with ot.initialize(row_major, cfg) as engine:
        with pytest.raises(ot.CheckpointError, match=r"'convs.0.weight' in another memory order.*model.to\(memory_format"):
            engine.load_checkpoint(tmp_path / "ckpt")


class LayerScaleBlock(nn.Module):
    """A ViT block: attention and MLP, the attention's output scaled by a parameter of the block's own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.gamma = nn.Parameter(torch.full((DIM,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attn) * self.gamma
        return x + self.mlp(self.norm2(x))


class ViTLike(nn.Module):
    """timm's VisionTransformer's shape: cls_token and pos_embed on the root, added before the blocks
    (a ModuleList, or an nn.Sequential as timm has it), a final norm and a head."""

    def __init__(self, sequential: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos_embed = nn.Parameter(torch.randn(1, 6, DIM) * 0.02)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        blocks = [LayerScaleBlock() for _ in range(3)]
        self.blocks = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos_embed
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))[:, 1:]


@pytest.mark.parametrize("setting", SETTINGS, ids=["-".join(map(str, s)) for s in SETTINGS])
@pytest.mark.parametrize("sequential", [False, True], ids=["module-list", "sequential"])
def test_root_parameters_used_before_the_blocks(tmp_path: Path, sequential: bool, setting: Tuple[str, int, str]) -> None:
    engine = train_and_compare(lambda: ViTLike(sequential), tmp_path, setting)
    # Only the groups of modules around hooked modules get the hook: the root's; with an
    # nn.Sequential of blocks also each block's own (its layer scale, around its hooked children).
    enclosing = {engine.plan.groups[g].name for g in engine.plan.enclosing_groups()}
    assert enclosing == ({"<root>", "blocks.0", "blocks.1", "blocks.2"} if sequential else {"<root>"})


class ReversibleFunction(torch.autograd.Function):
    """y1 = x1 + f(x2), y2 = x2 + g(y1), inputs not kept: backward recomputes them from the outputs and
    backpropagates through f and g itself. The weights are inputs only so that the outputs require grad."""

    @staticmethod
    def forward(ctx: Any, x1: torch.Tensor, x2: torch.Tensor, f: nn.Module, g: nn.Module, *weights: torch.Tensor) -> Any:
        with torch.no_grad():
            y1 = x1 + f(x2)
            y2 = x2 + g(y1)
        ctx.f, ctx.g = f, g
        ctx.save_for_backward(y1, y2)
        return y1, y2

    @staticmethod
    def backward(ctx: Any, dy1: torch.Tensor, dy2: torch.Tensor) -> Any:
        y1, y2 = ctx.saved_tensors
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_(True)
            gy1 = ctx.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2 = y2 - gy1
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_(True)
            torch.autograd.backward(ctx.f(x2), dx1)
        return (dx1, dy2 + x2.grad, None, None) + (None,) * (len(ctx.needs_input_grad) - 4)


class ReversibleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(DIM // 2), nn.Linear(DIM // 2, DIM // 2), nn.Tanh())
        self.g = nn.Sequential(nn.LayerNorm(DIM // 2), nn.Linear(DIM // 2, DIM // 2), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, -1)
        return torch.cat(ReversibleFunction.apply(x1, x2, self.f, self.g, *self.parameters()), -1)


class ReversibleLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([ReversibleBlock() for _ in range(4)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("setting", [SETTINGS[1], SETTINGS[2]], ids=["nvme-2-cpu", "host-2-sim"])
def test_reversible_blocks_computing_their_weights_gradients_in_backward(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    """Failed with an AssertionError in Engine.on_grad (`.grad` None): the hook ran for the weights'
    inputs of ReversibleFunction, whose gradients it returns as None."""
    train_and_compare(ReversibleLM, tmp_path, setting, accum=2)


# -- refused up front --------------------------------------------------------------------------------


class SparseLM(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(VOCAB, 8, sparse=how == "module")
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.how == "functional":
            return self.head(F.embedding(ids, self.emb.weight, sparse=True))
        return self.head(self.emb(ids))


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_sparse_gradients_are_refused_by_name(tmp_path: Path, placement: str) -> None:
    """They failed inside backward ("reshape is not implemented for sparse tensors")."""
    cfg = config(tmp_path, placement, 1)
    with pytest.raises(ValueError, match=r"module 'emb' \(Embedding\) is built with sparse=True.*build it with sparse=False"):
        ot.initialize(SparseLM("module"), cfg)
    ids = token_batches(1)[0]
    with ot.initialize(SparseLM("functional"), cfg) as engine:
        with pytest.raises(ValueError, match=r"'emb.weight' got a torch.sparse_coo gradient.*sparse=False"):
            engine.backward(lm_loss(engine(ids), ids))
        assert engine.step() is False  # nothing of that backward is kept


def test_complex_parameters_are_refused_by_name(tmp_path: Path) -> None:
    """They were refused with "pass an fp32 model (model.float())", which leaves them complex."""
    model = SparseLM("none")
    model.phase = nn.Parameter(torch.randn(8, dtype=torch.cfloat))
    with pytest.raises(ValueError, match=r"\['phase'\] are complex.*torch.complex\(re, im\)"):
        ot.initialize(model, config(tmp_path, "host", 1))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_torchscript_module_is_refused_before_its_parameters_are_taken(tmp_path: Path) -> None:
    """A scripted block failed half-way through initialize() with torch's "register_forward_pre_hook is
    not supported on ScriptModules", the model's parameters already placeholders."""
    torch.manual_seed(0)
    model = ZooLM()
    model.layers[1] = torch.jit.script(model.layers[1])
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"module 'layers.1' is a TorchScript module.*pass the eager module"):
        ot.initialize(model, config(tmp_path, "host", 1))
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())  # the model is left as it was


# -- held: models and loops that train right ---------------------------------------------------------


class Block(nn.Module):
    def __init__(self, checkpointed: Optional[bool] = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout)
        self.checkpointed = checkpointed  # None: no checkpoint; else its use_reentrant

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(torch.tanh(self.fc1(self.norm(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed is None:
            return x + self.mlp(x)
        return x + checkpoint(self.mlp, x, use_reentrant=self.checkpointed)


class ZooLM(nn.Module):
    """Embedding, four blocks, head; `how` picks the variant."""

    def __init__(self, how: str = "plain") -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(VOCAB, DIM)
        inner = {"ckpt inside reentrant": True, "ckpt inside": False}.get(how)
        self.layers = nn.ModuleList([Block(inner, 0.1 if how == "dropout" else 0.0) for _ in range(4)])
        self.head = nn.Linear(DIM, VOCAB)
        if how == "parametrized":
            self.layers[1].square = nn.Linear(DIM, DIM)
            orthogonal(self.layers[1].square)
            for layer in self.layers:
                weight_norm(layer.fc2)
            weight_norm(self.head)
        elif how == "shared parameter":
            self.layers[3].fc1.weight = self.layers[0].fc1.weight
        elif how == "shared module":
            self.layers[0].extra = self.layers[2].extra = nn.Linear(DIM, DIM)

    def run(self, start: int, end: int, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[start:end]:
            h = layer(h)
            if hasattr(layer, "square"):
                h = layer.square(h)
            if hasattr(layer, "extra"):
                h = h + layer.extra(h)
        return h

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if self.how == "ckpt around blocks":
            h = checkpoint(self.run, 0, 2, h, use_reentrant=False)
            h = checkpoint(self.run, 2, 4, h, use_reentrant=True)
        elif self.how == "universal":  # blocks 0 and 1 applied three times, on two inputs each
            for _ in range(3):
                h = self.layers[0](h) + self.layers[1](h * 0.5)
        else:
            h = self.run(0, 4, h)
        return self.head(h)


def with_user_hooks() -> nn.Module:
    model = ZooLM()
    model.layers[0].register_forward_pre_hook(lambda m, args: (args[0] * 1.5,))
    model.layers[1].register_forward_hook(lambda m, args, out: out * 0.9)
    model.layers[2].fc1.register_forward_hook(lambda m, args, out: out + 0.1)
    model.head.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    collected: List[torch.Tensor] = []
    model.collected = collected  # type: ignore[assignment]
    for layer in model.layers:
        layer.register_forward_hook(lambda m, args, out: collected.append(out))
    return model


def hook_collected_loss(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> None:
    model.collected.clear()  # type: ignore[operator]
    logits = run(ids)
    backward(lm_loss(logits, ids) + 0.01 * sum(o.pow(2).mean() for o in model.collected))  # type: ignore[attr-defined]


def two_forwards(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> None:
    loss = lm_loss(run(ids), ids) + lm_loss(run(ids.flip(1)), ids.flip(1))
    backward(loss * 0.5, retain_graph=True)
    backward(loss * 0.25)


def parameter_gradient_penalty(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> None:
    loss = lm_loss(run(ids), ids)
    grads = torch.autograd.grad(loss, list(model.layers[1].parameters()), create_graph=True)
    backward(loss + sum(g.pow(2).sum() for g in grads))


class LinearKeepingWeightOnCtx(torch.autograd.Function):
    """A custom op that keeps its weight as a ctx attribute, not through save_for_backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.x, ctx.weight = x, weight
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        flat = grad.flatten(0, -2)
        return grad @ ctx.weight, flat.t() @ ctx.x.flatten(0, -2), flat.sum(0)


class CustomFunctionBlock(Block):
    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return LinearKeepingWeightOnCtx.apply(torch.tanh(self.fc1(self.norm(x))), self.fc2.weight, self.fc2.bias)


class CustomFunctionLM(ZooLM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([CustomFunctionBlock() for _ in range(4)])


@dataclass
class BlockOutput:
    hidden: torch.Tensor
    aux: torch.Tensor


class DataclassBlock(Block):
    def forward(self, x: torch.Tensor) -> BlockOutput:  # type: ignore[override]
        u = torch.tanh(self.fc1(self.norm(x)))
        return BlockOutput(x + self.fc2(u), u.pow(2).mean())


class DataclassLM(ZooLM):
    """Blocks returning a dataclass pytree does not know, whose auxiliary loss joins the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DataclassBlock() for _ in range(4)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, aux = self.emb(ids), 0.0
        for layer in self.layers:
            out = layer(h)
            h, aux = out.hidden, aux + out.aux
        return self.head(h) + aux


HELD = {
    "ckpt inside reentrant": (lambda: ZooLM("ckpt inside reentrant"), plain_step),
    "ckpt inside": (lambda: ZooLM("ckpt inside"), plain_step),
    "ckpt around blocks": (lambda: ZooLM("ckpt around blocks"), plain_step),
    "parametrized": (lambda: ZooLM("parametrized"), plain_step),
    "shared parameter": (lambda: ZooLM("shared parameter"), plain_step),
    "shared module": (lambda: ZooLM("shared module"), plain_step),
    "universal": (lambda: ZooLM("universal"), plain_step),
    "two forwards": (ZooLM, two_forwards),
    "parameter gradient penalty": (ZooLM, parameter_gradient_penalty),
    "custom function": (CustomFunctionLM, plain_step),
    "user hooks": (with_user_hooks, hook_collected_loss),
    "dataclass outputs": (DataclassLM, plain_step),
}


@pytest.mark.parametrize(
    "setting",
    [pytest.param(SETTINGS[0], marks=pytest.mark.slow, id="host-1-cpu"), pytest.param(SETTINGS[3], id="nvme-1-sim")],
)
@pytest.mark.parametrize("case", sorted(HELD))
def test_held_models_and_loops_train_bitwise(tmp_path: Path, case: str, setting: Tuple[str, int, str]) -> None:
    build, step = HELD[case]
    train_and_compare(build, tmp_path, setting, step)


class SoftPrompt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.prompt = nn.Parameter(torch.randn(3, DIM) * 0.1)

    def forward(self) -> torch.Tensor:
        return self.prompt


class PositionTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fixed = nn.Parameter(torch.randn(6, DIM), requires_grad=False)
        self.learned = nn.Parameter(torch.zeros(6, DIM))

    def forward(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.fixed, self.learned


class PromptedLM(ZooLM):
    """Prompt tuning: a soft prompt before the tokens, position tables added to them; with `frozen`
    only the prompt and the learned table train."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.soft_prompt = SoftPrompt()
        self.positions = PositionTables()
        if frozen:
            for module in (self.emb, self.layers, self.head):
                module.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        fixed, learned = self.positions()
        prompt = self.soft_prompt().expand(ids.shape[0], -1, -1)
        h = self.run(0, 4, torch.cat([prompt, self.emb(ids) + fixed + learned], 1))
        return self.head(h)[:, prompt.shape[1] :]


def step_after_an_evaluation(run: Callable[..., Any], model: nn.Module, backward: Backward, ids: torch.Tensor) -> None:
    run.eval()
    with torch.no_grad():
        lm_loss(run(ids), ids)
    run.train()
    backward(lm_loss(run(ids), ids))


@pytest.mark.parametrize("setting", [SETTINGS[0], SETTINGS[3]], ids=["host-1-cpu", "nvme-1-sim"])
@pytest.mark.parametrize("frozen", [False, True], ids=["all-trained", "prompt-tuning"])
def test_modules_returning_their_parameters(tmp_path: Path, frozen: bool, setting: Tuple[str, int, str]) -> None:
    train_and_compare(lambda: PromptedLM(frozen), tmp_path, setting, step_after_an_evaluation)


class ForwardCallLM(ZooLM):
    """Calls `.forward` of its blocks and head instead of the modules themselves."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer.forward(h)
        return self.head.forward(h)


@pytest.mark.parametrize("setting", [SETTINGS[1], SETTINGS[2]], ids=["nvme-2-cpu", "host-2-sim"])
def test_forward_methods_called_directly(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    engine = train_and_compare(ForwardCallLM, tmp_path, setting)
    assert len(engine.plan.module_uses[""]) == len(engine.plan.groups) - 1  # the root holds all but the embedding


class TwiceCheckpointedLM(ZooLM):
    """Block 0 called twice per forward under reentrant checkpointing; it holds a Linear it never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[0].unused = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for _ in range(2):
            h = checkpoint(self.layers[0], h, use_reentrant=True) + self.layers[1](h * 0.5)
        return self.head(h)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("setting", SETTINGS, ids=["-".join(map(str, s)) for s in SETTINGS])
def test_a_block_checkpointed_twice_reentrant(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    train_and_compare(TwiceCheckpointedLM, tmp_path, setting, accum=2)


def test_grad_accum_steps_counts_backward_calls(tmp_path: Path) -> None:
    """Two micro-batches of two backward() calls each (retain_graph): the engine's boundary is after
    grad_accum_steps calls, so 4 here, as documented; with 2, step() would update after the first
    micro-batch."""
    torch.manual_seed(0)
    model = ZooLM()
    torch.manual_seed(0)
    ref = ZooLM()
    opt = torch.optim.AdamW(torch_param_groups(ref, OPT), lr=OPT.lr, betas=OPT.betas, fused=True)
    batches = token_batches(4)
    applied = []
    with ot.initialize(model, config(tmp_path, "nvme", 1, accum=4), device=accelerator("sim")) as engine:
        for k in range(2):
            for run, backward in ((ref, lambda loss, **kw: loss.backward(**kw)), (engine, engine.backward)):
                for ids in batches[2 * k : 2 * k + 2]:
                    two_forwards(run, model if run is engine else ref, lambda loss, **kw: backward(loss / 2, **kw), ids)
                    if run is engine:
                        applied.append(engine.step())
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip_norm)
            opt.step()
            opt.zero_grad()
        state = engine.full_state_dict()
    assert applied == [False, True] * 2
    assert all(torch.equal(p.detach(), state[n]) for n, p in ref.named_parameters())


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def input_gradient_penalty(run: Callable[..., Any], model: nn.Module, backward: Backward, x: torch.Tensor) -> None:
    """WGAN-GP: the critic's score plus the squared distance of its input gradient's norm from 1."""
    x = x.clone().requires_grad_(True)
    score = run(x)
    (grad,) = torch.autograd.grad(score.sum(), x, create_graph=True)
    backward(score.mean() + 10 * ((grad.norm(dim=1) - 1) ** 2).mean())


@pytest.mark.parametrize("setting", [SETTINGS[1], SETTINGS[2]], ids=["nvme-2-cpu", "host-2-sim"])
def test_input_gradient_penalty_and_dropout_with_accumulation(tmp_path: Path, setting: Tuple[str, int, str]) -> None:
    g = torch.Generator().manual_seed(3)
    train_and_compare(Critic, tmp_path / "gp", setting, input_gradient_penalty, batches=[torch.randn(8, DIM, generator=g) for _ in range(4)])
    train_and_compare(lambda: ZooLM("dropout"), tmp_path / "dropout", setting, accum=2)


# -- two engines: a GAN ------------------------------------------------------------------------------


def small_mlp(n_in: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, n_out))


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_a_gan_with_an_engine_each_trains_bitwise(tmp_path: Path, device: str) -> None:
    """Generator and discriminator each through an engine of their own: the generator's loss goes
    through the discriminator, whose engine is frozen for it (requires_grad_(False), then True), as
    GAN code freezes it for plain PyTorch. Without the freezing the discriminator's engine refuses
    the gradients by name; its message spoke only of loss.backward(), though the user had called
    engine.backward() (of the other engine)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g)) for _ in range(3)]

    def train(engines: bool) -> Tuple[nn.Module, nn.Module, Any]:
        torch.manual_seed(0)
        gen, disc = small_mlp(4, 8), small_mlp(8, 1)
        if engines:
            eg = ot.initialize(gen, config(tmp_path / "g", "nvme", 1), device=accelerator(device))
            ed = ot.initialize(disc, config(tmp_path / "d", "host", 2), device=accelerator(device))
            run_g, run_d, back_g, back_d, step_g, step_d = eg, ed, eg.backward, ed.backward, eg.step, ed.step
        else:
            eg = ed = None
            opt_g, opt_d = (torch.optim.AdamW(torch_param_groups(m, OPT), lr=OPT.lr, betas=OPT.betas, fused=True) for m in (gen, disc))
            run_g, run_d = gen, disc
            back_g = back_d = lambda loss: loss.backward()

            def stepper(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
                def step() -> None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.grad_clip_norm)
                    opt.step()
                    opt.zero_grad()
                return step

            step_g, step_d = stepper(gen, opt_g), stepper(disc, opt_d)
        for z, real in data:
            fake = run_g(z)
            back_d(F.softplus(-run_d(real)).mean() + F.softplus(run_d(fake.detach())).mean())
            step_d()
            disc.requires_grad_(False)
            back_g(F.softplus(-run_d(fake)).mean())
            step_g()
            disc.requires_grad_(True)
        return gen, disc, (eg, ed)

    ref_g, ref_d, _ = train(engines=False)
    _, _, (eg, ed) = train(engines=True)
    with eg, ed:
        for ref, engine in ((ref_g, eg), (ref_d, ed)):
            state = engine.full_state_dict()
            assert all(torch.equal(p.detach(), state[n]) for n, p in ref.named_parameters())
        fake = eg(data[0][0])
        with pytest.raises(ot.BackwardOutsideEngineError, match=r"another engine's backward.*requires_grad_\(False\)"):
            eg.backward(F.softplus(-ed(fake)).mean())  # the discriminator not frozen
