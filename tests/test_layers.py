"""The import rule of the house, read from the installed packages' source (docs/design.md, "The layers").

- io_engine imports nothing of offload_trainer;
- offload_trainer.config imports only itself and io_engine; errors, version and models import nothing else;
- offload_trainer.runtime imports only itself, config, errors, version and io_engine;
- offload_trainer.planning may add the runtime's pure layout (runtime.layout), its copy path
  (runtime.device, so the machine probe measures copies as the engine makes them) and the built-in models;
- offload_trainer.app, and the package's face (offload_trainer, offload_trainer.initialize), import anything;
- no circle of imports anywhere.

Every import counts: at module level, inside functions, and under `if TYPE_CHECKING:`. The rule
is checked on the real packages, and shown to catch a forbidden import and a circle on a
synthetic package tree.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import pytest

ALLOWED: Dict[str, Tuple[str, ...]] = {
    "io_engine": ("io_engine",),
    "offload_trainer.config": ("offload_trainer.config", "io_engine"),
    "offload_trainer.errors": (),
    "offload_trainer.version": (),
    "offload_trainer.models": ("offload_trainer.models",),
    "offload_trainer.runtime": (
        "offload_trainer.runtime", "offload_trainer.config", "offload_trainer.errors", "offload_trainer.version", "io_engine",
    ),
    "offload_trainer.planning": (
        "offload_trainer.planning", "offload_trainer.runtime.layout", "offload_trainer.runtime.device",
        "offload_trainer.config", "offload_trainer.errors", "offload_trainer.models", "io_engine",
    ),
    "offload_trainer.app": ("offload_trainer", "io_engine"),
    "offload_trainer.initialize": ("offload_trainer", "io_engine"),
    "offload_trainer.__main__": ("offload_trainer",),
    "offload_trainer": ("offload_trainer", "io_engine"),
}
"""Layer (a module or package prefix; the longest one that matches a module is its layer) -> the
prefixes it may import from."""


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer(module: str, rules: Dict[str, Tuple[str, ...]]) -> Optional[str]:
    matches = [p for p in rules if _within(module, p)]
    return max(matches, key=len) if matches else None


def modules_of(root: Path, packages: Iterable[str]) -> Dict[str, Path]:
    """Dotted module name -> source file, for every .py file of `packages` found under `root`."""
    out: Dict[str, Path] = {}
    for package in packages:
        base = root / package
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, known: Set[str]) -> Set[str]:
    """The modules of `known` that `module` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            # The module itself, else its nearest known parent package (`import a.b.c` of a non-module c).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def violations(root: Path, packages: Iterable[str], rules: Dict[str, Tuple[str, ...]]) -> List[str]:
    """Every import that breaks `rules`, and every circle of imports, as sentences."""
    modules = modules_of(root, packages)
    known = set(modules)
    graph = {m: imports_of(m, p, known) for m, p in modules.items()}
    problems = []
    for module, targets in sorted(graph.items()):
        layer = _layer(module, rules)
        if layer is None:
            problems.append(f"{module} belongs to no layer of the rule")
            continue
        for target in sorted(targets):
            if not any(_within(target, allowed) for allowed in rules[layer]):
                problems.append(f"{module} (layer {layer}) imports {target}, which it may not")
    problems += [f"import circle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle for each strongly connected component of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _installed_root(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
    return Path(list(spec.submodule_search_locations)[0]).parent


def test_the_installed_packages_keep_the_import_rule() -> None:
    root = _installed_root("offload_trainer")
    assert _installed_root("io_engine") == root
    problems = violations(root, ["io_engine", "offload_trainer"], ALLOWED)
    assert not problems, "\n".join(problems)


def _tree(tmp_path: Path, files: Dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


SYNTHETIC = {
    "io_engine/__init__.py": "",
    "io_engine/files.py": "import os\n",
    "offload_trainer/__init__.py": "",
    "offload_trainer/config/__init__.py": "",
    "offload_trainer/config/base.py": "from io_engine.files import os\n",
    "offload_trainer/runtime/__init__.py": "",
    "offload_trainer/runtime/engine.py": "from offload_trainer.config.base import os\nfrom . import state\n",
    "offload_trainer/runtime/state.py": "x = 1\n",
    "offload_trainer/planning/__init__.py": "",
    "offload_trainer/planning/planner.py": "from offload_trainer.runtime import engine\n",
}


def test_the_planner_may_not_reach_past_the_runtimes_layout(tmp_path: Path) -> None:
    root = _tree(tmp_path, SYNTHETIC)
    assert violations(root, ["io_engine", "offload_trainer"], ALLOWED) == [
        "offload_trainer.planning.planner (layer offload_trainer.planning) imports offload_trainer.runtime.engine, "
        "which it may not"
    ]


@pytest.mark.parametrize(
    "path, source, expected",
    [
        # The runtime reaching up into the planner, even only inside a function.
        ("offload_trainer/runtime/engine.py", "def f():\n    from offload_trainer.planning import planner\n",
         "offload_trainer.runtime.engine (layer offload_trainer.runtime) imports offload_trainer.planning.planner"),
        # io_engine importing offload_trainer, even only for type checking.
        ("io_engine/files.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import offload_trainer.config.base\n",
         "io_engine.files (layer io_engine) imports offload_trainer.config.base"),
        # A circle within one layer, through a relative import.
        ("offload_trainer/runtime/state.py", "from .engine import x\n",
         "import circle: offload_trainer.runtime.engine -> offload_trainer.runtime.state -> offload_trainer.runtime.engine"),
    ],
)
def test_a_forbidden_import_or_a_circle_is_caught(tmp_path: Path, path: str, source: str, expected: str) -> None:
    files = {k: v for k, v in SYNTHETIC.items() if k != "offload_trainer/planning/planner.py"}
    files["offload_trainer/planning/planner.py"] = "from offload_trainer.runtime.layout import partition\n"
    files["offload_trainer/runtime/layout/__init__.py"] = ""
    files["offload_trainer/runtime/layout/partition.py"] = "y = 2\n"
    root = _tree(tmp_path, files)
    assert violations(root, ["io_engine", "offload_trainer"], ALLOWED) == []
    files[path] = source
    root = _tree(tmp_path, files)
    problems = violations(root, ["io_engine", "offload_trainer"], ALLOWED)
    assert any(p.startswith(expected) for p in problems), problems
