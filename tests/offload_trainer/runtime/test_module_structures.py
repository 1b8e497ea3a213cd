"""Models plain PyTorch trains, whatever their module structure: each trained through the engine
bitwise equal to plain PyTorch (fused AdamW, weight decay by torch_param_groups, clipping).

- a ModuleList holding the same module twice (`[a, b, a]`): one module, one group, called twice;
- a module that reads a child's weights without calling it (nn.MultiheadAttention and out_proj;
  a root computing tied logits from the embedding's weight, whatever it calls its instance): the
  child's weights go with the reader;
- empty parameters (0 elements; an nn.Linear(16, 0)), alone in their group or not;
- a parameter read outside every module's forward (a loss term in the training loop): a plain
  error (UnresidentReadError) naming it, not autograd's "invalid gradient"; so does
  model.state_dict(), which would return the placeholders;
- weight decay by shape and module type: GPT-2's ln_1/ln_2/ln_f weights and every bias decay not.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import List, Tuple

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import functional as F

import offload_trainer as ot
from offload_trainer.config import GroupingConfig
from offload_trainer.runtime.layout.direct_reads import called_modules, direct_reads
from offload_trainer.runtime.layout.param_kind import ParamKind, param_kinds
from offload_trainer.runtime.layout.partition import plan_partition
from offload_trainer.runtime.optimizer import torch_param_groups, weight_decay_of

OPT = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
VOCAB = 24


def batches(n: int = 3, seq: int = 5) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (2, seq), generator=g), torch.randint(0, VOCAB, (2 * seq,), generator=g)) for _ in range(n)]


def train_and_compare(model: nn.Module, cfg: ot.OffloadConfig, opt: ot.OptimizerConfig = OPT) -> ot.Engine:
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(torch_param_groups(ref, opt), lr=opt.lr, betas=opt.betas, fused=True)
    with ot.initialize(model, cfg) as engine:
        for x, y in batches():
            F.cross_entropy(ref(x).flatten(0, 1), y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), opt.grad_clip_norm)
            torch_opt.step()
            torch_opt.zero_grad()
            engine.backward(F.cross_entropy(engine(x).flatten(0, 1), y))
            engine.step()
        state = engine.full_state_dict()
    bad = [n for n, p in ref.named_parameters() if not torch.equal(p.detach(), state[n])]
    assert not bad, f"differ from plain PyTorch: {bad}"
    return engine


def config(**prefetch: int) -> ot.OffloadConfig:
    return ot.OffloadConfig(
        tiers={"params": "host", "grads": "host", "optimizer": "host"},
        prefetch={"lookahead_groups": prefetch.get("lookahead", 1)},
        optimizer=OPT,
    )


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class RepeatedLM(nn.Module):
    """layers = [a, b, a]: the same block object at positions 0 and 2 (an HF list that repeats a layer)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        a, b = Block(dim), Block(dim)
        self.layers = nn.ModuleList([a, b, a])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_module_listed_twice_is_one_module_called_twice(lookahead: int) -> None:
    """It failed at initialize with KeyError: 'layers.2' (named_modules() names a module once)."""
    torch.manual_seed(0)
    model = RepeatedLM()
    plan = plan_partition(model, GroupingConfig())
    assert [g.name for g in plan.groups][:2] == ["layers.0", "layers.1"]
    engine = train_and_compare(model, config(lookahead=lookahead))
    assert engine.stats().prefetch_misses + engine.stats().prefetch_hits >= 3


class AttentionLM(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight and out_proj.bias in its forward, never calling out_proj."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.norm(h))


class TiedReadLM(nn.Module):
    """Logits from the embedding's weight, read by the root (which has no parameters of its own)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([Block(dim), Block(dim)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return F.linear(h, self.emb.weight)


class TiedReadOtherNameLM(TiedReadLM):
    """TiedReadLM whose forward calls its instance `m`, not `self` (any name works in Python): its
    read of the embedding's weight was missed, and training failed in the first forward."""

    def forward(m, tokens: torch.Tensor) -> torch.Tensor:  # noqa: N805 - the point of the test
        h = m.emb(tokens)
        for layer in m.layers:
            h = layer(h)
        return F.linear(h, m.emb.weight)


@pytest.mark.parametrize("model_class", [AttentionLM, TiedReadLM, TiedReadOtherNameLM])
def test_a_module_that_reads_a_childs_weights_fetches_them(model_class: type) -> None:
    """AttentionLM failed with "mat2 must be a matrix, got 1-D tensor": out_proj's own group was never
    fetched. Under grouping by module classes every module but the named ones gets its own group."""
    torch.manual_seed(0)
    model = model_class()
    train_and_compare(model, config(lookahead=1))
    torch.manual_seed(0)
    cfg = config(lookahead=2)
    cfg = ot.OffloadConfig(tiers=cfg.tiers, prefetch=cfg.prefetch, optimizer=OPT, grouping=GroupingConfig(module_classes=("Block", "Embedding")))
    train_and_compare(model_class(), cfg)


class NormedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ReachInLM(nn.Module):
    """Code outside a block calls a module inside it: `how` says which way."""

    def __init__(self, how: str, dim: int = 16) -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([NormedBlock(dim) for _ in range(3)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        if self.how == "loop variable":  # a block's MLP alone, its norm never called
            for layer in self.layers:
                h = h + layer.mlp(h)
        elif self.how == "enumerate":
            for i, layer in enumerate(self.layers):
                h = layer(h) if i % 2 else layer.mlp(h)
        else:
            for layer in self.layers:
                h = layer(h)
            if self.how == "constant index":  # the last block's norm again, as a final norm
                h = self.layers[2].norm(h)
            elif self.how == "negative index":
                h = self.layers[-1].mlp(h)
            elif self.how == "indexed weight":  # a weight inside a block read by the root's own code
                h = h * self.layers[1].norm.weight
            elif self.how == "checkpointed":
                h = torch.utils.checkpoint.checkpoint(self.layers[1].mlp, h, use_reentrant=False)
            elif self.how == "local item":  # a block kept in a local, then reached into
                last = self.layers[2]
                h = last.norm(h)
            elif self.how == "local module":
                norm = self.layers[2].norm
                h = norm(h)
            elif self.how == "local container":
                layers = self.layers
                h = layers[-1].mlp(h)
        return self.head(h)


@pytest.mark.parametrize(
    "how",
    ["constant index", "negative index", "loop variable", "enumerate", "checkpointed", "indexed weight", "local item",
     "local module", "local container"],
)
@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_a_module_inside_a_block_called_from_outside_it_trains(tmp_path, how: str, placement: str) -> None:
    """Only a block's root is hooked; a module inside it called by other code (`self.layers[2].norm(h)`)
    computed on its empty placeholders ("Expected weight to be of same shape as normalized_shape, but
    got weight of shape [0]", "mat2 must be a matrix"). Such a module now acquires its block's group
    itself, only when nothing holds it already."""
    torch.manual_seed(0)
    model = ReachInLM(how)
    plan = plan_partition(model, GroupingConfig())
    assert plan.entry_uses, "the partition names the modules called from outside their block"
    assert plan.module_uses[""] == (1,), "the root reads layers.1.norm.weight: it fetches layers.1's group"
    cfg = ot.OffloadConfig(
        tiers={"params": placement, "grads": placement, "optimizer": placement, "nvme_dir": str(tmp_path)},
        prefetch={"lookahead_groups": 1},
        optimizer=OPT,
    )
    train_and_compare(model, cfg)


def test_called_modules_are_only_the_ones_reached_into() -> None:
    """A block's own calls of its children add no hook: the root's acquisition covers them."""
    # Every branch of ReachInLM.forward counts (the code is read, not run): the loop variable's
    # `layer.mlp` in all blocks, `self.layers[2].norm` in block 2 only.
    plan = plan_partition(ReachInLM("constant index"), GroupingConfig())
    assert plan.entry_uses == {"layers.0.mlp": (0,), "layers.1.mlp": (1,), "layers.2.mlp": (2,), "layers.2.norm": (2,)}
    assert plan_partition(TiedReadLM(), GroupingConfig()).entry_uses == {}
    assert plan_partition(RepeatedLM(), GroupingConfig()).entry_uses == {}


def test_direct_reads_finds_reads_and_calls() -> None:
    attn = AttentionLM()
    reads = direct_reads(attn)
    assert {id(p) for p in reads[id(attn.attn)]} == {id(attn.attn.out_proj.weight), id(attn.attn.out_proj.bias)}
    assert id(attn) not in reads  # the root calls its children
    for tied in (TiedReadLM(), TiedReadOtherNameLM()):
        assert [id(p) for p in direct_reads(tied)[id(tied)]] == [id(tied.emb.weight)]

    class StarArgs(nn.Module):  # the instance has no name: anything may be read
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(*args: torch.Tensor) -> torch.Tensor:
            return args[0].a(args[1])

    star = StarArgs()
    assert len(direct_reads(star)[id(star)]) == 2
    plan = plan_partition(attn, GroupingConfig())
    attn_group = plan.module_uses["attn"]
    assert plan.module_uses["attn.out_proj"] == attn_group  # out_proj's weights live in the reader's group

    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for name in ("a", "b"):
                x = getattr(self, name)(x)
            return x

    dyn = Dynamic()
    assert len(direct_reads(dyn)[id(dyn)]) == 4  # what it cannot prove is a call counts as a read

    class Locals(nn.Module):  # a local bound twice stands for both; one local set through another
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([NormedBlock(4) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim():  # bound deeper than its use below: the walk meets the use first
                blocks = self.layers
            m = blocks[0].norm
            x = m(x)
            m = blocks[1].mlp
            return m(x) * blocks[1].norm.weight

    loc = Locals()
    names = {id(m): n for n, m in loc.named_modules()}
    assert sorted(names[id(callee)] for caller, callee in called_modules(loc) if caller is loc) == ["layers.0.norm", "layers.1.mlp"]
    assert [id(p) for p in direct_reads(loc)[id(loc)]] == [id(loc.layers[1].norm.weight)]


class GPT2ishBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 2 * dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(torch.relu(self.c_fc(self.ln_2(self.ln_1(x)))))


class GPT2ishLM(nn.Module):
    """GPT-2's names: ln_1, ln_2, ln_f say neither "norm" nor "bias"; wte is tied to lm_head."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(8, dim)
        self.h = nn.ModuleList([GPT2ishBlock(dim), GPT2ishBlock(dim)])
        self.ln_f = nn.LayerNorm(dim)
        self.scale = nn.Parameter(torch.ones(dim))
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h) * self.scale)


def test_weight_decay_follows_shape_and_module_type() -> None:
    model = GPT2ishLM()
    kinds = {name: param_kinds(model)[id(p)] for name, p in model.named_parameters()}
    assert kinds["h.0.ln_1.weight"] is kinds["h.1.ln_2.weight"] is kinds["ln_f.weight"] is ParamKind.NO_DECAY
    assert kinds["h.0.c_fc.bias"] is kinds["scale"] is ParamKind.NO_DECAY
    assert kinds["h.0.c_fc.weight"] is ParamKind.MATRIX
    assert kinds["wte.weight"] is kinds["wpe.weight"] is ParamKind.EMBEDDING  # tied lm_head too
    assert weight_decay_of(ParamKind.EMBEDDING, "wte.weight", OPT) == 0.1  # as nanoGPT and the HF Trainer
    no_emb = ot.OptimizerConfig(weight_decay=0.1, decay_embeddings=False)
    assert weight_decay_of(ParamKind.EMBEDDING, "wte.weight", no_emb) == 0.0
    by_name = ot.OptimizerConfig(weight_decay=0.1, no_decay_patterns=("c_fc",))
    assert weight_decay_of(ParamKind.MATRIX, "h.0.c_fc.weight", by_name) == 0.0

    class LlamaRMSNorm(nn.Module):  # an HF norm class, known by its type's name; a 2-D weight still no decay
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1, 4))

    norm = LlamaRMSNorm()
    assert param_kinds(norm)[id(norm.weight)] is ParamKind.NO_DECAY


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_gpt2_names_train_bitwise_with_the_shape_rule(decay_embeddings: bool) -> None:
    torch.manual_seed(0)
    opt = ot.OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip_norm=1.0, decay_embeddings=decay_embeddings)
    cfg = ot.OffloadConfig(tiers={"params": "host", "grads": "host", "optimizer": "host"}, optimizer=opt)
    model = GPT2ishLM()
    groups = {g["weight_decay"]: len(g["params"]) for g in torch_param_groups(model, opt)}
    # Decayed: the two blocks' c_fc/c_proj weights, and the embeddings (wte tied to lm_head) if asked.
    assert groups[0.1] == 4 + (2 if decay_embeddings else 0)
    train_and_compare(model, cfg, opt)


def test_a_parameter_read_outside_every_forward_gets_a_plain_error() -> None:
    """A loss term over model.parameters() computed in the training loop reads empty placeholders;
    backward then refuses their gradients. The error says so and names the parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    x, y = batches(1)[0]
    with ot.initialize(model, config()) as engine:
        out = engine(x)
        penalty = sum(p.pow(2).sum() for p in model.parameters())
        with pytest.raises(ot.UnresidentReadError, match=r"shape \[24\] \(1.bias\).*inside a module's forward"):
            engine.backward(F.cross_entropy(out.flatten(0, 1), y) + 1e-3 * penalty)


class EmptyParamsLM(nn.Module):
    """A 0-element parameter on the root (a group with nothing else to train: it has no gradient
    home, and its gradient once failed an assertion), and an nn.Linear(16, 0) beside a scale."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.empty = nn.Parameter(torch.empty(0))
        self.none_out = nn.Linear(dim, 0)
        self.scale = nn.Parameter(torch.ones(dim))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(h * self.scale) + self.empty.sum() + self.none_out(h).sum()


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_empty_parameters_train() -> None:
    torch.manual_seed(0)
    train_and_compare(EmptyParamsLM(), config())


def test_state_dict_and_load_state_dict_of_the_wrapped_model_are_refused_while_and_after_the_engine_holds_it() -> None:
    """model.state_dict() would return the empty placeholders (torch.save of it, or save_pretrained,
    a model without weights, silently): it raises, naming engine.full_state_dict(); the refusing
    hooks do not keep a closed engine alive."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    engine = ot.initialize(model, config())
    with pytest.raises(ot.UnresidentReadError, match=r"module '0'.*engine.full_state_dict\(\)"):
        model.state_dict()
    # load_state_dict failed with PyTorch's size mismatch against the placeholders (strict=False:
    # loaded nothing, silently).
    for strict in (True, False):
        with pytest.raises(ot.UnresidentReadError, match=r"load_state_dict\(\) reached module '0'.*engine.load_safetensors"):
            model.load_state_dict(weights, strict=strict)
    assert set(engine.full_state_dict()) == {"0.weight", "1.weight", "1.bias"}
    engine.close()
    with pytest.raises(ot.UnresidentReadError, match="is closed"):
        model[1].state_dict()
    with pytest.raises(ot.UnresidentReadError, match="closed; build the model again"):
        model.load_state_dict(weights)
    freed = weakref.ref(engine)
    del engine
    gc.collect()
    assert freed() is None
