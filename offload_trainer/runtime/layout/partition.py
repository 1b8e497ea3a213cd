"""Partition a module tree into ShardGroups: which parameters move together, and their flat layout.

Pure planning, no memory is touched. The unit that moves is a group of whole modules: by default
each block of the model's largest nn.ModuleList (a transformer layer; a block that is itself a
ModuleList or ModuleDict, never called, is hooked on each of its items); or the modules whose class
is named in GroupingConfig.module_classes; consecutive blocks may be packed up to
GroupingConfig.max_group_bytes. Parameters outside every block (embeddings, final norm, head)
form one group per module whose code uses them: its own parameters and those of descendants it
reads without calling them (direct_reads.py; nn.MultiheadAttention reads out_proj.weight), so
a module's hooks always fetch what its forward touches. A module object that appears several
times in the tree (a ModuleList `[a, b, a]`) is one module with one group, under its first name.

A group's parameters are laid out in one flat 1-D buffer: trainable parameters first, then
frozen ones, padded so that each of the world's ranks owns an equal shard whose size is a
multiple of `align_numel`. A parameter shared by several modules (tied weights) is owned by the
first group that contains it; every other module that uses it depends on that group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload_trainer.config import GroupingConfig
from offload_trainer.runtime.layout.direct_reads import called_modules, direct_reads
from offload_trainer.runtime.layout.param_kind import ParamKind, param_kinds


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives in its group's flat buffer."""

    name: str
    """Qualified name (the first one, for a shared parameter)."""
    index: int
    """Position in model.parameters() order."""
    shape: Tuple[int, ...]
    offset_numel: int
    """Start in the group's flat buffer, in elements."""
    numel: int
    requires_grad: bool
    kind: ParamKind = ParamKind.MATRIX
    """What it is for weight decay (param_kind.py)."""
    stride: Optional[Tuple[int, ...]] = None
    """The parameter's strides when its elements lie densely in another order than row-major
    (`model.to(memory_format=torch.channels_last)`, a weight stored transposed), else None. [Note:
    Parameter memory order]"""

    def view(self, region: torch.Tensor) -> torch.Tensor:
        """The parameter as a view of `region`, its numel elements of a flat buffer (a slot, a grad
        home), with the parameter's own strides."""
        return region.view(self.shape) if self.stride is None else region.as_strided(self.shape, self.stride)

    def flatten(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (this parameter's shape, any strides: a gradient, a loaded weight) as its numel
        elements in flat-buffer order: a view where it already has the parameter's strides."""
        if self.stride is None:
            return value.reshape(-1)
        if value.stride() != self.stride:
            value = torch.empty_strided(self.shape, self.stride, dtype=value.dtype, device=value.device).copy_(value)
        return value.as_strided((self.numel,), (1,))


@dataclass(frozen=True)
class GroupPlan:
    """One group's parameters and layout. Shard r of the flat buffer belongs to rank r."""

    index: int
    name: str
    module_names: Tuple[str, ...]
    """The modules whose parameters this group owns (hooks acquire the group around their use)."""
    dtype: torch.dtype
    params: Tuple[ParamLayout, ...]
    trainable_numel: int
    """Elements [0, trainable_numel) of the flat buffer hold trainable parameters (and the gaps that
    align them)."""
    flat_numel: int
    """Padded size of the flat buffer: world_size * shard_numel."""
    shard_numel: int

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def shard_bytes(self) -> int:
        return self.shard_numel * self.element_bytes

    @property
    def flat_bytes(self) -> int:
        return self.flat_numel * self.element_bytes

    def shard_range(self, rank: int) -> Tuple[int, int]:
        """[start, end) of rank's shard in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def trainable_shard_numel(self, rank: int) -> int:
        """Elements of rank's shard that hold trainable parameters (they start the shard)."""
        start, end = self.shard_range(rank)
        return max(0, min(end, self.trainable_numel) - start)

    @property
    def real_numel(self) -> int:
        """Elements of the flat buffer that hold parameters (the rest is padding)."""
        return sum(p.numel for p in self.params)

    @property
    def used_numel(self) -> int:
        """Elements [0, used_numel) of the flat buffer hold every parameter, with the gaps that align
        them ([Note: Parameter alignment]); past it is padding only. Frozen parameters follow the
        trainable ones: trainable_numel < used_numel where the group has any."""
        return max((p.offset_numel + p.numel for p in self.params), default=0)

    @property
    def has_trainable(self) -> bool:
        return self.trainable_numel > 0

    def shard_pieces(self, rank: int) -> Tuple["ShardPiece", ...]:
        """The trainable parameters' parts that fall in rank's shard, in parameter order."""
        start, end = self.shard_range(rank)
        pieces = []
        for i, slot in enumerate(self.params):
            if not slot.requires_grad:
                continue
            lo = max(start, slot.offset_numel)
            hi = min(end, slot.offset_numel + slot.numel)
            if lo < hi:
                pieces.append(ShardPiece(i, lo - start, hi - lo))
        return tuple(pieces)


@dataclass(frozen=True)
class ShardPiece:
    """The part of parameter `param` (an index into GroupPlan.params) held in one rank's shard."""

    param: int
    shard_offset: int
    """Start within the rank's shard, in elements."""
    numel: int


@dataclass(frozen=True)
class PartitionPlan:
    """All groups, and which groups each hooked module needs while it runs."""

    groups: Tuple[GroupPlan, ...]
    module_uses: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    """Hooked module name -> the groups it needs resident (its own, then those of shared params)."""
    world_size: int = 1
    entry_uses: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    """Module inside a block that code outside the block's root calls (`self.layers[2].norm(x)` in
    the model's forward; direct_reads.called_modules) -> the groups it needs: hooked too, but
    acquiring only when no enclosing acquisition holds them (hooks.py)."""

    @property
    def num_params(self) -> int:
        return sum(slot.numel for g in self.groups for slot in g.params)

    def enclosing_groups(self) -> Tuple[int, ...]:
        """The groups of hooked modules that enclose other hooked modules (the root of a model whose
        blocks are hooked; a module with parameters of its own around hooked children): their
        parameters' gradients may come after a child's backward acquisition replaced theirs.
        [Note: Gradients after the acquisition moved on] in hooks.py."""
        enclosing = set()
        for name in self.module_uses:
            parts = name.split(".") if name else []
            enclosing.update(".".join(parts[:k]) for k in range(len(parts)))  # every strict ancestor, "" too
        return tuple(sorted({g for name in enclosing if name in self.module_uses for g in self.module_uses[name]}))


def _block_roots(model: nn.Module, grouping: GroupingConfig) -> List[List[str]]:
    """Names of the module roots of each block group, in module order."""
    if grouping.module_classes:
        wanted = set(grouping.module_classes)
        roots: List[str] = []
        for name, module in model.named_modules():
            if type(module).__name__ in wanted and not any(name.startswith(r + ".") for r in roots):
                roots.append(name)
        if not roots:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"grouping.module_classes={list(grouping.module_classes)} matches no module of the model; "
                f"its module classes are: {', '.join(found)}"
            )
        blocks = [[r] for r in roots]
    else:
        best: Optional[Tuple[int, str, nn.ModuleList]] = None
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) > 1:
                numel = sum(p.numel() for p in module.parameters())
                if best is None or numel > best[0]:
                    best = (numel, name, module)
        if best is None:
            return []
        _, _, module_list = best
        # named_modules() names a module once, by its first name: a list that repeats a module holds
        # one block for it, used as often as the model calls it.
        first_name = {id(m): n for n, m in model.named_modules()}
        blocks = []
        taken: "set[str]" = set()
        for item in module_list:
            roots = [r for r in _called_roots(item, first_name) if r not in taken]
            if roots:
                taken.update(roots)
                blocks.append(roots)
    if grouping.max_group_bytes is None:
        return blocks
    modules = dict(model.named_modules())
    packed: List[List[str]] = []
    packed_bytes = 0
    for block in blocks:
        nbytes = sum(p.numel() * p.element_size() for r in block for p in modules[r].parameters())
        if packed and packed_bytes + nbytes <= grouping.max_group_bytes:
            packed[-1].extend(block)
            packed_bytes += nbytes
        else:
            packed.append(list(block))
            packed_bytes = nbytes
    return packed


def _called_roots(module: nn.Module, first_name: Dict[int, str]) -> List[str]:
    """The modules of one block that code calls: the block itself, or, for a ModuleList or ModuleDict
    (which has no forward, so hooks on it never fire), its items', recursively. A list of lists
    (HF Funnel's `blocks`, a U-Net's `downs` of `[resnet, attn, downsample]`) makes a block of each
    inner list: one group, whose every item is hooked."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        items = module.values() if isinstance(module, nn.ModuleDict) else module
        roots: List[str] = []
        for item in items:
            roots.extend(r for r in _called_roots(item, first_name) if r not in roots)
        return roots
    return [first_name[id(module)]]


def _row_major_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def memory_order_stride(p: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """ParamLayout.stride of `p`: its strides when it is dense and not overlapping but not
    row-major; None when row-major, or when it has gaps or overlaps (then it is laid out row-major).

    [Note: Parameter memory order]
    Kernels choose their algorithm, and so their rounding, by the strides of what they are given:
    a channels_last Conv2d weight runs channels_last convolutions, a transposed Linear weight
    another matmul. So a parameter's elements sit in its group's flat buffer in its own memory
    order, and every view of it (bound into the module, a gradient home) has its strides: the
    engine computes what plain PyTorch computes, and gradients (which autograd gives the
    parameter's strides) go to their homes without a copy. Everything that moves one parameter
    in or out of a flat buffer goes through ParamLayout.view and ParamLayout.flatten.
    Row-major means row-major strides, not is_contiguous(), which ignores the strides of dimensions
    of size 1: a depthwise Conv2d weight (C, 1, kH, kW) made channels_last is "contiguous", but its
    strides still make convolutions run channels_last."""
    stride = tuple(p.stride())
    if stride == _row_major_stride(tuple(p.shape)):
        return None
    order = sorted(range(p.dim()), key=lambda d: -stride[d])
    return stride if p.permute(order).is_contiguous() else None


PARAM_ALIGN_BYTES = 256
"""Where each parameter starts in its group's flat buffer: a multiple of this many bytes, the
largest alignment any kernel tells apart (PyTorch's CPU allocator aligns every tensor to 64 bytes,
its CUDA caching allocator to 512, and its cuBLASLt calls report an alignment of at most 256).
[Note: Parameter alignment]"""


def lay_out(slots: Sequence[ParamLayout], dtype: torch.dtype) -> Tuple[List[ParamLayout], int, int]:
    """The slots (trainable ones first) placed one after another, each at a PARAM_ALIGN_BYTES offset;
    with the end of the last trainable one (GroupPlan.trainable_numel) and of the last one.

    [Note: Parameter alignment]
    Kernels may round by the address of what they are given, not only by its strides: PyTorch's CPU
    matrix-vector product (F.linear of one row: an MoE expert given one token, a batch of one) gives
    other last bits for a weight that is not 16-byte aligned (torch 2.13, measured: offsets of 1-3
    elements differ, 0 and 4 do not). Plain PyTorch's parameters are separate allocations, 64-byte
    aligned; packed at any element offset of a flat buffer, the engine's were not, and HF GPT-OSS's
    gradients differed from the first step that routed one token to an expert. On a GPU, PyTorch
    hands cuBLASLt each operand's alignment (up to 256 bytes, `_getAlignment` in ATen's CUDABlas.cpp)
    and cuBLASLt's heuristics choose the kernel by it, and so its rounding; the caching allocator
    gives plain PyTorch's parameters 512-byte aligned memory. So each parameter starts at a 256-byte
    offset of its group (the buffers themselves are page- or allocator-aligned: 64 bytes at least on
    the CPU, 512 on a GPU); the gaps are padding that nothing reads, at most 252 bytes a parameter.
    test_cuda.py's dim-33 parity case is the check on a GPU (not yet run there)."""
    align_numel = max(1, PARAM_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    out: List[ParamLayout] = []
    cursor = trainable = 0
    for slot in slots:
        cursor = -(-cursor // align_numel) * align_numel
        out.append(dataclasses.replace(slot, offset_numel=cursor))  # every other field (kind, ...) carried
        cursor += slot.numel
        if slot.requires_grad:
            trainable = cursor
    return out, trainable, cursor


SHARD_ALIGN_NUMEL = 1024
"""Each rank's shard of a group is a multiple of this many elements (the engine's alignment)."""


def plan_partition(
    model: nn.Module, grouping: GroupingConfig, world_size: int = 1, align_numel: int = SHARD_ALIGN_NUMEL
) -> PartitionPlan:
    """Group the model's parameters and lay each group out for `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    modules = dict(model.named_modules())
    param_index = {id(p): i for i, p in enumerate(model.parameters())}
    first_name = {id(p): n for n, p in model.named_parameters()}
    owner: Dict[int, int] = {}  # id(param) -> group index
    members: List[Tuple[str, Tuple[str, ...], List[nn.Parameter]]] = []

    def claim(module_names: Sequence[str], params: Sequence[nn.Parameter]) -> None:
        own = [p for p in params if id(p) not in owner]
        if not own:
            return
        for p in own:
            owner[id(p)] = len(members)
        name = module_names[0] if len(module_names) == 1 else f"{module_names[0]}..{module_names[-1]}"
        members.append((name or "<root>", tuple(module_names), own))

    # Hooked module -> its parameters: a block root needs all it contains; any other module that
    # holds parameters directly needs only those (so a parent does not pin its children's groups).
    hooked: Dict[str, List[nn.Parameter]] = {}
    block_roots = _block_roots(model, grouping)
    for block in block_roots:
        claim(block, [p for r in block for p in modules[r].parameters()])
        for r in block:
            hooked[r] = list(modules[r].parameters())
    inside_block = tuple(r + "." for block in block_roots for r in block)
    reads = direct_reads(model)
    for module_name, module in model.named_modules():
        if module_name in hooked or (module_name + ".").startswith(inside_block):
            continue
        # Parents come before their children here, so a parent that reads a child's weights owns them.
        used = list({id(p): p for p in [*module.parameters(recurse=False), *reads.get(id(module), ())]}.values())
        if used:
            claim([module_name], used)
            hooked[module_name] = used

    kinds = param_kinds(model)
    groups = []
    for gi, (name, module_names, params) in enumerate(members):
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"group {name!r} mixes parameter dtypes {sorted(str(d) for d in dtypes)}; "
                "convert the model to one dtype (model.float()) before initialize()"
            )
        ordered = [p for p in params if p.requires_grad] + [p for p in params if not p.requires_grad]
        slots = [
            ParamLayout(
                first_name[id(p)], param_index[id(p)], tuple(p.shape), 0, p.numel(), p.requires_grad, kinds[id(p)],
                memory_order_stride(p),
            )
            for p in ordered
        ]
        slots, trainable, cursor = lay_out(slots, params[0].dtype)
        shard = -(-max(cursor, 1) // (world_size * align_numel)) * align_numel
        groups.append(
            GroupPlan(gi, name, module_names, params[0].dtype, tuple(slots), trainable, shard * world_size, shard)
        )

    uses: Dict[str, Tuple[int, ...]] = {}
    for module_name, params in hooked.items():
        needed: List[int] = []
        for p in params:
            if owner[id(p)] not in needed:
                needed.append(owner[id(p)])
        uses[module_name] = tuple(needed)
    return PartitionPlan(tuple(groups), uses, world_size, _entry_uses(model, block_roots, owner))


def _entry_uses(model: nn.Module, block_roots: List[List[str]], owner: Dict[int, int]) -> Dict[str, Tuple[int, ...]]:
    """PartitionPlan.entry_uses: each module inside a block that a module outside that block calls,
    with the groups of the parameters below it."""
    name_of = {id(m): n for n, m in model.named_modules()}
    roots = [r for block in block_roots for r in block]
    out: Dict[str, Tuple[int, ...]] = {}
    for caller, callee in called_modules(model):
        name, caller_name = name_of.get(id(callee)), name_of.get(id(caller))
        if name is None or caller_name is None or name in out:
            continue
        root = next((r for r in roots if name.startswith(r + ".")), None)
        if root is None or caller_name == root or caller_name.startswith(root + "."):
            continue  # not inside a block, or called by its own block's code
        needed: List[int] = []
        for p in callee.parameters():
            if owner[id(p)] not in needed:
                needed.append(owner[id(p)])
        if needed:
            out[name] = tuple(needed)
    return out
