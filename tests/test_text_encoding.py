"""Every text file the package reads or writes names its encoding (UTF-8).

Without encoding=, Python uses the locale's: ASCII under LC_ALL=C with PYTHONUTF8=0, Latin-1 or
another code page elsewhere. A config.json holding one non-ASCII character then failed to plan
(UnicodeDecodeError) on such a machine. This scans the source, so a new call site is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("offload_trainer", "io_engine")


def _mode(call: ast.Call, position: int) -> Optional[str]:
    """The call's mode argument if it is a literal string; "r" when it is left out."""
    for keyword in call.keywords:
        if keyword.arg == "mode":
            return keyword.value.value if isinstance(keyword.value, ast.Constant) else None
    if len(call.args) > position:
        arg = call.args[position]
        return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
    return "r"


def _opens_text_without_encoding(call: ast.Call) -> bool:
    if any(keyword.arg == "encoding" for keyword in call.keywords):
        return False
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in ("read_text", "write_text"):
        return True
    if isinstance(func, ast.Name) and func.id == "open":  # open(path, mode)
        mode = _mode(call, 1)
    elif isinstance(func, ast.Attribute) and func.attr == "fdopen":  # os.fdopen(fd, mode)
        mode = _mode(call, 1)
    elif isinstance(func, ast.Attribute) and func.attr == "open":
        # Path.open(mode); other objects' open(path, ...) (IOEngine, safetensors) take no mode first.
        if call.args and not (isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
            return False
        mode = _mode(call, 0)
    else:
        return False
    return mode is not None and "b" not in mode


def test_every_text_open_names_its_encoding() -> None:
    found: List[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and _opens_text_without_encoding(node):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"text opened in the locale's encoding (add encoding='utf-8'): {found}"


def test_no_docstring_holds_a_lone_surrogate() -> None:
    """Python 3.13 strips a docstring's indentation while compiling, through UTF-8: a lone surrogate in
    one (the escape '\\udce9' written unescaped in std_streams.py's) made `import offload_trainer.app.std_streams`,
    and with it offload-train and offload-plan, fail with UnicodeEncodeError there, though 3.11 and 3.12
    import it (pyproject's requires-python >= 3.11 admits 3.13). Write such an escape as \\\\udce9."""
    found: List[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    try:
                        (doc or "").encode("utf-8")
                    except UnicodeEncodeError:
                        found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}")
    assert not found, f"docstrings with a lone surrogate (Python 3.13 cannot compile them): {found}"
