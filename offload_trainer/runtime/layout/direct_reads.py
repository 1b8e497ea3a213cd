"""Which parameters a module's own code reads without calling the module that holds them.

A module whose forward reads a descendant's weights directly (nn.MultiheadAttention passes
`self.out_proj.weight` to F.multi_head_attention_forward and never calls `out_proj`) needs those
weights resident while it runs, although no hook of the descendant fires. The engine cannot see a
read as it happens (an unbound parameter is an empty placeholder), so the partition decides from
the code, before the first step: this file reads the source of each module's class and resolves
every `self.a.b...` chain it finds against the module instance.

The rule is conservative; what it cannot prove is a call counts as a read:
- `self.child(...)`: a call; the child's own hooks fetch its groups. `self.child.forward(...)`
  runs no hook: a read of every parameter under the child, as any other method. So is a call of a
  child whose class overrides `__call__` with code that does not reach nn.Module's (`def
  __call__(self, x): return self.forward(x)`: torch runs hooks in nn.Module.__call__ only);
  an override calling `super().__call__(...)` (for its type hints) is a call.
- `self.child.weight`, `self.child.grand.bias`: a read of that parameter.
- `self.child.method(...)` for any other method, and a child module used any other way (passed to
  a function, returned, put in a list): a read of every parameter under the child.
- Indexing or iterating a ModuleList, ModuleDict or Sequential: its items are called (the usual
  `for layer in self.layers: x = layer(x)`, `enumerate(self.layers)`), except a
  ParameterList/ParameterDict, which is read. Such a container handed to any other function is
  read, as any child is: HF Reformer's `_ReversibleFunction.apply(x, self.layers, ...)` runs
  each layer's `backward_pass`, not its forward, in backward, so no hook of a layer fires there.
- `getattr(self, name)` with a name not written in the code, `self._modules`, `self.children()`,
  `self.parameters()` and the like, or a class whose source cannot be read: every descendant's
  parameter is read (`getattr(self, "a")` is `self.a`).
- A plain list, tuple or dict of modules kept as an attribute (`self.ref = [self.emb]`: a list
  hides its modules from nn.Module's setattr) is resolved as a ModuleList (a dict as a ModuleDict),
  and a module kept in the instance's attributes unregistered as a child; parameters of modules
  outside the model are no read of the engine's.
- A plain object kept as an attribute (not a module, tensor, function or container) that keeps
  modules or parameters itself (`self.tied = Helper(self.emb)`, whose `__call__` reads
  `self.emb.weight`): its code is not followed, so whatever it keeps, two attributes deep, is read
  whole wherever code reaches the object.
- An attribute found nowhere but by the class's own `__getattr__` (a wrapper delegating to the
  module it wraps, as PEFT's do: `self.weight` is `self.inner.weight`): every parameter under the
  module is read.
- An item of such a container reached by index or loop variable (`self.layers[2].norm(x)`,
  `self.layers[-1].mlp.weight`, `for layer in self.layers: x = layer.mlp(x)`) is resolved as a
  chain on each item it may be (the indexed one, else all of them), by the rules above.
- A local set to any of these (`last = self.layers[-1]; last.norm(x)`, `norm = self.layers[2].norm;
  norm(x)`, `blocks = self.layers; blocks[0].mlp(x)`) stands for what it was set to: its uses are
  resolved as those chains, by the rules above (_Locals).
Methods are followed from `forward` through every `self.method(...)` and property of the class,
and through:
- `super().name(...)` (`super(Cls, self)`): the method of the classes after the caller's in the MRO
  (a subclass of nn.MultiheadAttention whose forward calls super().forward reads out_proj.weight);
- a callable kept on the instance, which wins over the class's (`m.forward = MethodType(f, m)`,
  accelerate's `functools.partial(new_forward, m)`): a method bound to the instance, or a partial
  handing it first, is followed as its code; any other function only through what it captured;
- what a followed function captured (its closure): a module there is read whole
  (`self.tie = lambda h: h @ emb.weight.t()`), a method bound to the instance followed;
- a function handed the instance first (`logits_of(self, h)`, `Base.forward(self, x)`, a
  decorator's `func(self, *args)` without functools.wraps): followed, its first parameter the
  instance. The instance handed anywhere else, or to code that cannot be read (a C function, an
  attention function chosen at run time: HF's `attention_interface(self, ...)`), reads everything.
- A container's items handed on (`stack_module_state(list(self.members))`, `ms = list(self.layers)`)
  are read; only a loop over them (`for m in list(self.layers)`) calls them.
- An item handed first to a function (`project(self.layers[-1], h)`, `fn(layer, h)` in a loop over
  them): that function's chains on its first parameter, resolved on the item. Where its code cannot
  be read or hands the item on (torch's `checkpoint(layer, h)`, which calls it), the item is taken
  for a call, as an item alone is: reading it would put every block in the caller's group.
- An indexed parameter (`w = self.emb.weight; w[i]`, `self.scales[i]`) is read whole.
Not seen: a local set by anything but a plain assignment or a loop (`a, b = self.x, self.y`; `m =
self.a or self.b`: each module there is read whole, as any child used another way, but a
container's items are not), and a module reached through a global variable.

called_modules() reports the other half: the modules such code calls. A block's root is hooked,
the modules inside it are not (the root's acquisition covers them), so a module inside a block
called from outside its root's forward needs a hook of its own: partition.py names them
(PartitionPlan.entry_uses) and hooks.py gives them a guarded one, which acquires only when no
enclosing acquisition holds their groups.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import nn

_CALLED_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_READ_CONTAINERS = (nn.ParameterList, nn.ParameterDict)
_DYNAMIC = {
    "_modules", "_parameters", "children", "named_children", "modules", "named_modules", "parameters",
    "named_parameters", "get_submodule", "get_parameter", "state_dict", "__dict__", "apply",
}
"""Attributes of `self` through which code reaches any descendant by name: all of them count as read."""


@dataclass(frozen=True)
class _Use:
    """One `self.a.b...` expression of a function: the names, and whether it is called or assigned."""

    chain: Tuple[str, ...]
    called: bool
    stored: bool
    passed: bool = False
    """Handed as an argument to a function other than Python's iteration built-ins (enumerate, zip...)."""


_ITERATING = {"enumerate", "zip", "len", "reversed", "iter", "list", "tuple", "range"}
"""Built-ins that iterate a container (or count it) without reading its items' weights."""
_ITEMS_OF = {"enumerate", "reversed", "iter", "list", "tuple"}
"""Built-ins whose iteration yields the items of their first argument (enumerate: with an index)."""
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""The attributes nn.Module keeps on every instance (`_modules`, the hook dicts): none is a plain attribute."""
ANY_ITEM = object()
"""_ItemUse.index of a non-constant index or a loop variable: any item of the container."""


@dataclass(frozen=True)
class _ItemUse:
    """`self.c[i].a.b...` or `item.a.b...` with `item` a loop variable over `self.c`: the
    container's chain, the index (a constant, or ANY_ITEM), and the chain after the item."""

    container: Tuple[str, ...]
    index: object
    rest: Tuple[str, ...]
    called: bool
    stored: bool
    passed: bool


def _passed(node: ast.AST, parents: Dict[int, ast.AST]) -> bool:
    """Whether `node` is an argument of a call (`fn(self.layers)`, `fn(x=self.layers)`) to a function
    that is not one of _ITERATING, or of one of those whose items go anywhere but a loop's iteration
    (`stack_module_state(list(self.members))`, `ms = list(self.members)`: handed on, the items are
    not called through it)."""
    parent = parents.get(id(node))
    if isinstance(parent, ast.Starred):  # `fn(*self.layers)`
        node, parent = parent, parents.get(id(parent))
    if isinstance(parent, ast.keyword):
        parent = parents.get(id(parent))
    elif not (isinstance(parent, ast.Call) and node in parent.args):
        return False
    if not isinstance(parent, ast.Call):
        return False
    if not (isinstance(parent.func, ast.Name) and parent.func.id in _ITERATING):
        return True
    if parent.func.id not in _ITEMS_OF and parent.func.id != "zip":
        return False  # len(), range(): no item leaves
    outer = parents.get(id(parent))
    if isinstance(outer, (ast.For, ast.AsyncFor, ast.comprehension)) and outer.iter is parent:
        return False  # `for layer in list(self.layers)`: each item is a loop variable
    return _passed(parent, parents) or not isinstance(outer, ast.Call)


_Ref = Tuple[Tuple[str, ...], object, Tuple[str, ...]]
"""What an expression stands for: (chain, NOT_AN_ITEM, ()) for `self.<chain>`, or (container chain,
index, rest) for `self.<container>[index].<rest>` (index: a constant, or ANY_ITEM)."""
NOT_AN_ITEM = object()


@dataclass
class _Locals:
    """The local names a function binds to parts of its instance (_Ref each), so that a chain
    through one reads as the chains it may stand for:
    - a loop variable over a container (`for layer in self.layers`, `enumerate(...)`, slices,
      comprehensions): any item of it;
    - a local set to a `self` chain or an item, or to a chain through another such local
      (`blocks = self.layers`, `last = self.layers[-1]`, `norm = last.norm`, `layer = blocks[i]`).
    A name bound several times stands for each of its bindings (a binding to anything else adds
    none: reading through the name then may name a module the code does not reach there, which costs
    an unneeded fetch or a guarded hook, never a missed read). `values` holds the right-hand sides
    of those assignments: they are no use of their own, since every use of the name is resolved."""

    refs: Dict[str, List[_Ref]] = field(default_factory=dict)
    values: Set[int] = field(default_factory=set)

    def bind(self, name: str, ref: _Ref) -> bool:
        bound = self.refs.setdefault(name, [])
        if ref in bound:
            return False
        bound.append(ref)
        return True


def _index(key: ast.AST) -> object:
    """The item a subscript names: a constant int or str (`[2]`, `[-1]`, `["a"]`), else ANY_ITEM."""
    if isinstance(key, ast.Constant) and isinstance(key.value, (int, str)):
        return key.value
    if isinstance(key, ast.UnaryOp) and isinstance(key.op, ast.USub) and isinstance(key.operand, ast.Constant):
        return -key.operand.value if isinstance(key.operand.value, int) else ANY_ITEM
    return ANY_ITEM


def _refs(node: ast.AST, me: str, names: _Locals) -> List[_Ref]:
    """What `node` (an attribute chain, a subscript, a name) may stand for; [] if nothing of the instance."""
    attrs: List[str] = []
    base = node
    while isinstance(base, ast.Attribute):
        attrs.append(base.attr)
        base = base.value
    rest = tuple(attrs[::-1])
    if isinstance(base, ast.Name):
        if base.id == me:
            return [(rest, NOT_AN_ITEM, ())] if rest else []
        return [
            (chain + rest, NOT_AN_ITEM, ()) if index is NOT_AN_ITEM else (chain, index, after + rest)
            for chain, index, after in names.refs.get(base.id, ())
        ]
    if isinstance(base, ast.Subscript) and not isinstance(base.slice, ast.Slice):
        index = _index(base.slice)
        return [(chain, index, rest) for chain, kind, _ in _refs(base.value, me, names) if kind is NOT_AN_ITEM]
    return []


def _locals(tree: ast.AST, me: str) -> _Locals:
    """The _Locals of one function, its assignments followed until nothing new is bound (a local may
    be bound through another bound later in the walk)."""
    names = _Locals()
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                source, target = node.iter, node.target
                if isinstance(source, ast.Call) and isinstance(source.func, ast.Name) and source.func.id in _ITEMS_OF and source.args:
                    if source.func.id == "enumerate" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                        target = target.elts[1]
                    source = source.args[0]
                if isinstance(source, ast.Subscript) and isinstance(source.slice, ast.Slice):
                    source = source.value  # `self.layers[:n]`, `self.layers[::-1]`: items of self.layers
                if isinstance(target, ast.Name):
                    for chain, kind, _ in _refs(source, me, names):
                        if kind is NOT_AN_ITEM:
                            changed |= names.bind(target.id, (chain, ANY_ITEM, ()))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if len(targets) != 1 or not isinstance(targets[0], ast.Name):
                    continue
                if not isinstance(node.value, (ast.Attribute, ast.Subscript, ast.Name)):
                    continue
                refs = _refs(node.value, me, names)
                if refs:
                    names.values.add(id(node.value))
                for ref in refs:
                    changed |= names.bind(targets[0].id, ref)
    return names


@dataclass(frozen=True)
class _FunctionUses:
    """What one function's source does with its instance (_function_uses)."""

    uses: Tuple["_Use | _ItemUse", ...]
    dynamic: bool
    """It reaches attributes by name (`getattr(self, name)`, `vars(self)`), or hands the instance to
    something whose code cannot be followed: anything may be read."""
    supers: Tuple[Tuple[str, Optional[str]], ...] = ()
    """`super().name` (name, None) and `super(Cls, self).name` (name, "Cls"): methods of a base class."""
    handed: Tuple[Tuple[str, ...], ...] = ()
    """Dotted names of the functions called with the instance as their first argument (`fn(self, x)`,
    `Base.forward(self, x)`, a decorator's `func(self, *args)`): their code reads through it."""
    handed_items: Tuple[Tuple[Tuple[str, ...], _ItemUse], ...] = ()
    """(dotted name, the item) of the functions called with an item of a container first
    (`project(self.layers[-1], h)`, `fn(layer, h)` in a loop over it): their code reads through it."""


_HARMLESS = {
    "isinstance", "issubclass", "type", "id", "hash", "hasattr", "callable", "repr", "str", "print", "format",
    "super", "getattr", "setattr", "delattr", "vars",
}
"""Built-ins that may be handed the instance without reading its weights (getattr and vars are
resolved on their own)."""


def _dotted(node: ast.AST) -> Optional[Tuple[str, ...]]:
    """`fn` -> ("fn",), `mod.Cls.method` -> ("mod", "Cls", "method"); None for any other expression."""
    names: List[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    names.append(node.id)
    return tuple(reversed(names))


@functools.lru_cache(maxsize=None)
def _function_uses(func: object) -> Optional[_FunctionUses]:
    """The `self` attribute chains of one function (and chains on its containers' items, and both
    through the locals bound to them), whether it reaches attributes by name (`getattr(self,
    ...)`, `vars(self)`), the base-class methods it calls through super() and the functions it
    hands the instance to; None where its source cannot be read. Parsed once per function."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    me = _self_name(tree)
    if me is None:
        return _FunctionUses((), True)  # the instance has no name here (`def forward(*args)`): anything may be read
    parents: Dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    uses: List["_Use | _ItemUse"] = []
    dynamic = False
    supers: List[Tuple[str, Optional[str]]] = []
    handed: List[Tuple[str, ...]] = []
    handed_items: List[Tuple[Tuple[str, ...], _ItemUse]] = []
    names = _locals(tree, me)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
            call = node.value
            if isinstance(call.func, ast.Name) and call.func.id == "super":
                first = call.args[0] if call.args else None
                supers.append((node.attr, first.id if isinstance(first, ast.Name) else None))
        if isinstance(node, ast.Call):
            given = [*node.args, *(k.value for k in node.keywords)]
            given = [a.value if isinstance(a, ast.Starred) else a for a in given]
            if any(isinstance(a, ast.Name) and a.id == me for a in given):
                callee = _dotted(node.func)
                if callee is None or callee[0] == me:
                    dynamic = True  # handed to code this scan does not follow
                elif callee[0] not in _HARMLESS or len(callee) > 1:
                    first = node.args[0] if node.args else None
                    if isinstance(first, ast.Name) and first.id == me:
                        handed.append(callee)
                    else:
                        dynamic = True  # the instance under another parameter's name there
        if isinstance(node, ast.Call) and node.args and not isinstance(node.args[0], ast.Starred):
            callee = _dotted(node.func)
            if callee is not None and callee[0] != me and callee[0] not in _HARMLESS and callee[0] not in _ITERATING:
                for chain, index, rest in _refs(node.args[0], me, names):
                    if index is not NOT_AN_ITEM:
                        handed_items.append((callee, _ItemUse(chain, index, rest, False, False, True)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "vars"):
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == me:
                name = node.args[1] if node.func.id == "getattr" and len(node.args) > 1 else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    parent = parents.get(id(node))  # getattr(self, "a") is self.a
                    called = isinstance(parent, ast.Call) and parent.func is node
                    uses.append(_Use((name.value,), called, False))
                else:
                    dynamic = True
        parent = parents.get(id(node))
        if not isinstance(node, (ast.Attribute, ast.Subscript, ast.Name)) or isinstance(parent, ast.Attribute):
            continue  # only the longest chain is resolved
        if isinstance(node, ast.Name) and (isinstance(parent, ast.Subscript) or node.id == me):
            continue  # `blocks[i]` is resolved as the subscript
        if id(node) in names.values:
            continue  # `norm = self.layers[2].norm`: the uses of `norm` are resolved instead
        called = isinstance(parent, ast.Call) and parent.func is node
        stored = isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))
        if stored and isinstance(node, ast.Name):
            continue  # binding the name is no use of what it stood for
        passed = _passed(node, parents)
        for chain, index, rest in _refs(node, me, names):
            if index is NOT_AN_ITEM:
                uses.append(_Use(chain, called, stored, passed))
            else:
                uses.append(_ItemUse(chain, index, rest, called, stored, passed))
    return _FunctionUses(tuple(uses), dynamic, tuple(supers), tuple(handed), tuple(handed_items))


def _class_member(cls: type, name: str, start: int = 0) -> Optional[object]:
    """The function (or property getter) `name` of cls, found along its MRO from its `start`th class
    (a super() call looks from the class after the caller's), if defined below nn.Module."""
    found = _class_member_at(cls, name, start)
    return found[0] if found is not None else None


def _class_member_at(cls: type, name: str, start: int = 0) -> Optional[Tuple[object, int]]:
    """_class_member, and the MRO position of the class that defines it."""
    for position, klass in enumerate(cls.__mro__):
        if position < start:
            continue
        if klass in (nn.Module, object):
            return None
        if name in vars(klass):
            member = vars(klass)[name]
            if isinstance(member, property):
                member = member.fget
            elif isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            return (member, position) if inspect.isfunction(member) else None
    return None


def _defining_position(cls: type, func: object) -> int:
    """Where along cls's MRO `func` is defined (a method reached as `Base.forward`), else 0."""
    for position, klass in enumerate(cls.__mro__):
        for member in vars(klass).values():
            if member is func or getattr(member, "fget", None) is func or getattr(member, "__func__", None) is func:
                return position
    return 0


def _closure(func: object) -> Dict[str, object]:
    """A function's free variables and their values (a decorator's wrapped `func`, a captured module)."""
    code = getattr(func, "__code__", None)
    cells = getattr(func, "__closure__", None) or ()
    out: Dict[str, object] = {}
    for name, cell in zip(code.co_freevars if code is not None else (), cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
    return out


def _resolve_name(func: object, dotted: Tuple[str, ...]) -> object:
    """What a dotted name in func's code stands for: its closure, then its globals, then builtins."""
    scope = {**vars(builtins), **getattr(func, "__globals__", {}), **_closure(func)}
    value = scope.get(dotted[0])
    for attr in dotted[1:]:
        value = getattr(value, attr, None)
    return value


def _self_name(tree: ast.Module) -> Optional[str]:
    """The name the function gives its instance: its first positional parameter (`self` by custom,
    but any name works in Python: `def forward(m, x)`); None where it has none (`*args` only)."""
    func = tree.body[0] if tree.body else None
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "self"
    positional = [*func.args.posonlyargs, *func.args.args]
    return positional[0].arg if positional else None


class _Reads:
    """The parameters one module's code reads, found by walking its class's methods."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.params: Dict[int, nn.Parameter] = {}
        self.everything = False
        self.calls: Dict[int, nn.Module] = {}
        """Modules below this one that its code calls (called_modules())."""

    def read_all_of(self, module: nn.Module) -> None:
        for p in module.parameters():
            self.params[id(p)] = p

    def scan(self) -> None:
        cls = type(self.module)
        pending: List[Tuple[object, int]] = []
        self._follow_member("forward", 0, pending)
        seen: Set[int] = set()
        while pending:  # on past `everything` too: the calls it finds are wanted (called_modules)
            func, position = pending.pop()
            if id(func) in seen:
                continue
            seen.add(id(func))
            found = _function_uses(func)
            if found is None:
                self.everything = True
                continue
            self.everything = self.everything or found.dynamic
            self._read_closure(func, pending)
            methods: List[str] = []
            for use in found.uses:
                if isinstance(use, _ItemUse):
                    self._resolve_items(use)
                else:
                    self._resolve(list(use.chain), use.called, use.stored, use.passed, methods)
            for name in methods:
                self._follow_member(name, 0, pending)
            for name, base in found.supers:
                # super() looks from the class after the one whose code calls it (or after `base`).
                after = next((i for i, k in enumerate(cls.__mro__) if k.__name__ == base), None) if base else position
                if after is None:
                    self.everything = True
                else:
                    self._follow_member(name, after + 1, pending)
            for dotted, item in found.handed_items:
                self._read_through_callee(_resolve_name(func, dotted), item)
            for dotted in found.handed:
                callee = _resolve_name(func, dotted)
                callee = getattr(callee, "__func__", callee)  # a bound method: its function
                if inspect.isfunction(callee):
                    pending.append((callee, _defining_position(cls, callee)))
                else:
                    self.everything = True  # handed to code that cannot be read (a C function, a class)

    def _read_through_callee(self, callee: object, item: _ItemUse) -> None:
        """An item of a container handed first to a function (`project(self.layers[-1], h)`): the
        chains that function's code has on its first parameter, resolved on the item. Code that
        cannot be read, or hands the item on (torch's checkpoint(layer, h), which calls it), is
        taken for a call of it, as the item itself is: reading every item there would put every
        block's weights in this module's group."""
        if inspect.ismethod(callee):
            return  # its first parameter is the object it is bound to, not the item
        found = _function_uses(callee) if inspect.isfunction(callee) else None
        if found is None or found.dynamic:
            return
        for use in found.uses:
            if isinstance(use, _Use):
                self._resolve_items(_ItemUse(item.container, item.index, item.rest + use.chain, use.called, use.stored, use.passed))

    def _follow_member(self, name: str, start: int, pending: List[Tuple[object, int]]) -> None:
        """Queue the code that `self.name` runs: a function kept on the instance (`module.forward =
        ...`, as patches and accelerate's hooks do; it wins over the class's), else the class's
        method or property from MRO position `start` on."""
        value = vars(self.module).get(name) if start == 0 else None
        if value is not None and callable(value) and not isinstance(value, nn.Module):
            self._follow_callable(value, pending)
            return
        found = _class_member_at(type(self.module), name, start)
        if found is not None:
            pending.append(found)

    def _follow_callable(self, value: object, pending: List[Tuple[object, int]]) -> None:
        """A callable kept on the instance: a method bound to it, or a partial handing it as the first
        argument, is followed as its code; any other function is read through what it captured."""
        if isinstance(value, functools.partial):
            for arg in [*value.args[1:], *value.keywords.values()]:
                self._read_value(arg, pending)
            if value.args and value.args[0] is self.module:
                func = getattr(value.func, "__func__", value.func)
                if inspect.isfunction(func):
                    pending.append((func, _defining_position(type(self.module), func)))
                else:
                    self.everything = True
                return
            value = value.func
        if isinstance(value, types.MethodType):
            if value.__self__ is self.module:
                pending.append((value.__func__, _defining_position(type(self.module), value.__func__)))
            else:
                self._read_value(value.__self__, pending)
            return
        if inspect.isfunction(value):
            self._read_closure(value, pending)

    def _read_closure(self, func: object, pending: List[Tuple[object, int]]) -> None:
        """What a function captured (`emb = self.emb; self.tie = lambda h: h @ emb.weight.t()`, a
        decorator's wrapped method) is reached by its code as the instance's own attributes are."""
        for value in _closure(func).values():
            self._read_value(value, pending)

    def _read_value(self, value: object, pending: List[Tuple[object, int]]) -> None:
        if value is self.module:
            self.everything = True  # the instance under another name: anything may be read
        elif isinstance(value, nn.Module):
            self.read_all_of(value)
        elif isinstance(value, nn.Parameter):
            self.params[id(value)] = value
        elif isinstance(value, types.MethodType):
            self._follow_callable(value, pending)
        elif isinstance(value, (list, tuple, dict)):
            for item in _plain_items(value):
                self._read_value(item, pending)

    def _resolve_items(self, use: _ItemUse) -> None:
        """An _ItemUse: its chain resolved on the item it names, or on every item of the container
        (a ModuleList, ModuleDict or Sequential, or a plain list, tuple or dict of modules)."""
        container: object = self.module
        for attr in use.container:
            if not isinstance(container, nn.Module):
                container = None
                break
            child = container._modules.get(attr)
            container = child if child is not None else _plain_attribute(container, attr)
            if container is None:
                break
        if isinstance(container, _CALLED_CONTAINERS):
            values = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
        elif isinstance(container, (list, tuple, dict)):
            values = list(container.values()) if isinstance(container, dict) else list(container)
        else:
            # Not a container of modules: a parameter (`w = self.emb.weight; w[i]`, `self.scales[i]` of
            # a ParameterList) or a module indexed. What is indexed is read whole.
            self._resolve(list(use.container), False, False, use.passed, [])
            return
        if use.index is ANY_ITEM:
            items = values
        else:
            try:
                items = [container[use.index]]  # type: ignore[index]
            except (IndexError, KeyError, TypeError):
                return
        for item in items:
            if isinstance(item, nn.Module):
                self._walk(item, list(use.rest), use.called, use.stored, use.passed, [])

    def _resolve(self, chain: List[str], called: bool, stored: bool, passed: bool, methods: List[str]) -> None:
        if chain and chain[0] in _DYNAMIC:
            self.everything = True
            return
        self._walk(self.module, chain, called, stored, passed, methods)

    def _walk(self, obj: nn.Module, chain: List[str], called: bool, stored: bool, passed: bool, methods: List[str]) -> None:
        """`chain` from `obj`: this module (its `self.a.b` chains; its methods go to `methods`), or an
        item of one of its containers (an empty chain then is the item itself)."""
        if not chain:
            if called and not runs_hooks(obj):
                self.read_all_of(obj)
            elif called:
                self.calls[id(obj)] = obj
            return  # the item itself, taken (`layer = self.layers[i]`): called, as items are
        for depth, attr in enumerate(chain):
            last = depth == len(chain) - 1
            if attr in obj._parameters:
                p = obj._parameters[attr]
                if p is not None and obj is not self.module and not stored:
                    self.params[id(p)] = p
                return
            if attr in obj._modules:
                child = obj._modules[attr]
                if child is None:
                    return
            else:
                child = _plain_attribute(obj, attr)
            if isinstance(child, nn.Module):  # a submodule, or a module kept outside _modules: as a child
                obj = child
                if last:
                    if called and not runs_hooks(child):
                        self.read_all_of(child)
                    elif called:
                        self.calls[id(child)] = child
                    self._use_module(child, called, stored, passed)
                continue
            if child is not None:  # a plain list, tuple or dict of modules
                if not stored and (passed or not last):  # handed to a function, or a method of it used
                    for item in _plain_items(child):
                        self.read_all_of(item)
                return  # its items, indexed or iterated, are _ItemUses
            # Neither a parameter nor a submodule: a method, a buffer or a plain attribute.
            held = _held_by_object(vars(obj).get(attr)) if attr not in _MODULE_INTERNALS else []
            if held:  # a plain object keeping modules (a helper's `self.lin`): its code is not followed
                for item in held:
                    if item is self.module:
                        self.everything = True  # the instance under another name
                    elif isinstance(item, nn.Module):
                        self.read_all_of(item)
                    elif not stored:
                        self.params[id(item)] = item
                return
            if _unresolved(obj, attr):  # only the class's own __getattr__ knows (a delegating wrapper)
                if obj is self.module:
                    self.everything = True
                else:
                    self.read_all_of(obj)
                return
            if obj is self.module:
                value = vars(obj).get(attr)
                if _class_member(type(obj), attr) is not None or (callable(value) and not isinstance(value, torch.Tensor)):
                    methods.append(attr)
                return
            if attr == "__call__":
                self.calls[id(obj)] = obj
                return  # the module is called
            # `.forward(...)` calls the code without the module's hooks: read below, as another method.
            if attr in _DYNAMIC or callable(getattr(type(obj), attr, None)):
                self.read_all_of(obj)  # another method of a descendant may read its weights unhooked
            return

    def _use_module(self, child: nn.Module, called: bool, stored: bool, passed: bool) -> None:
        if called or stored:
            return
        if isinstance(child, _READ_CONTAINERS):
            self.read_all_of(child)
        elif isinstance(child, _CALLED_CONTAINERS) and not passed:
            return
        else:
            self.read_all_of(child)


_HOOKED_CALLS = {"__call__", "_call_impl", "_wrapped_call_impl"}
"""The nn.Module methods that run a module's hooks around its forward."""


@functools.lru_cache(maxsize=None)
def _call_runs_hooks(cls: type) -> bool:
    """Whether calling an instance of `cls` runs its hooks: its `__call__` is nn.Module's, or an override
    whose code reaches it (`super().__call__(...)`, `nn.Module.__call__(self, ...)`, `self._call_impl(...)`).
    An override that calls `self.forward` (or anything else), or whose source cannot be read, runs none."""
    call = getattr(cls, "__call__", None)
    if call is nn.Module.__call__:
        return True
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(call)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError, IndentationError):
        return False
    return any(isinstance(node, ast.Attribute) and node.attr in _HOOKED_CALLS for node in ast.walk(tree))


def runs_hooks(module: nn.Module) -> bool:
    """Whether `module(...)` runs the module's hooks (see _call_runs_hooks)."""
    return _call_runs_hooks(type(module))


def _plain_items(value: object) -> List[nn.Module]:
    """The modules a plain list, tuple or dict holds (its values for a dict)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [item for item in items if isinstance(item, nn.Module)]


_NOT_PLAIN_OBJECTS = (
    nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
    types.MethodType, functools.partial, list, tuple, dict, set, frozenset, str, bytes, int, float, bool,
)


def _held_by_object(value: object, depth: int = 2) -> List[object]:
    """The modules and parameters a plain object keeps in its attributes (and the plain objects and
    lists, tuples or dicts there keep, `depth` levels down): `self.helper = Helper(self.emb)`, whose
    `__call__` reads `self.lin.weight`. Its code is not followed: whatever it keeps is read whole.
    Empty for anything else (a module, a tensor, a function, a container: the other rules see them)."""
    if isinstance(value, _NOT_PLAIN_OBJECTS) or not hasattr(value, "__dict__"):
        return []
    found: List[object] = []
    for item in list(vars(value).values()):
        items = list(item.values()) if isinstance(item, dict) else list(item) if isinstance(item, (list, tuple)) else [item]
        for kept in items:
            if isinstance(kept, (nn.Module, nn.Parameter)):
                found.append(kept)
            elif depth > 1:
                found.extend(_held_by_object(kept, depth - 1))
    return found


def _unresolved(module: nn.Module, attr: str) -> bool:
    """Whether `module.attr` is found nowhere but by a `__getattr__` of its class below nn.Module's (a
    wrapper delegating to the module it wraps: PEFT's, `return getattr(self.inner, name)`)."""
    if attr in vars(module) or attr in module._buffers or hasattr(type(module), attr):
        return False
    return any("__getattr__" in vars(klass) for klass in type(module).__mro__[: type(module).__mro__.index(nn.Module)])


def _plain_attribute(module: nn.Module, attr: str) -> object:
    """A module, or a plain list, tuple or dict holding modules, kept in the instance's own attributes
    rather than registered (`self.ref = [self.emb]`: a list hides its module from nn.Module's
    setattr); None for anything else. Code reaches through it as through a child or a ModuleList."""
    if attr in _MODULE_INTERNALS:
        return None
    value = vars(module).get(attr)
    if isinstance(value, nn.Module) or _plain_items(value):
        return value
    return None


def _scanned(model: nn.Module) -> List[_Reads]:
    """The scan of every module with children (containers but for their items' code, leaves aside)."""
    out = []
    for module in model.modules():
        if isinstance(module, (_CALLED_CONTAINERS, _READ_CONTAINERS)):
            continue
        reaches_others = any(
            _plain_attribute(module, a) is not None or (a not in _MODULE_INTERNALS and _held_by_object(v))
            for a, v in vars(module).items()
        )
        if not any(True for _ in module.children()) and not reaches_others:
            continue  # a leaf module reads only its own parameters
        reads = _Reads(module)
        reads.scan()
        out.append(reads)
    return out


def called_modules(model: nn.Module) -> List[Tuple[nn.Module, nn.Module]]:
    """(caller, callee) for every module below another that the other's code calls by an
    attribute chain, through a container's item, or through a local set to either (see the module
    docstring). A call may be missed where the module is reached another way (a tuple assignment);
    the reads are the conservative half, this one only adds hooks."""
    return [(reads.module, callee) for reads in _scanned(model) for callee in reads.calls.values()]


def direct_reads(model: nn.Module) -> Dict[int, Tuple[nn.Parameter, ...]]:
    """id(module) -> the parameters its code reads outside its own (see the module docstring)."""
    out: Dict[int, Tuple[nn.Parameter, ...]] = {}
    in_model = {id(p) for p in model.parameters()}
    for reads in _scanned(model):
        module = reads.module
        if reads.everything:
            reads.params = {}
            reads.read_all_of(module)
        own = {id(p) for p in module.parameters(recurse=False)}
        # A module kept in a plain attribute may hold parameters outside the model: not the engine's.
        params = tuple(p for key, p in reads.params.items() if key not in own and key in in_model)
        if params:
            out[id(module)] = params
    return out
