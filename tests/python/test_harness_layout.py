"""The harness's layout: no module of tests/python imports from a test module (``test_*``), at
any nesting level (module top, inside functions, ``import x``, ``from x import y``, or a literal
``__import__``/``importlib.import_module`` name). What more than one test module needs lives in
a helper module named by its job (``ort_helpers.py``, ``hf_reference.py``, ``lora_helpers.py``,
...), so a test module's tests move with the code they test.
"""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = sorted(HERE.glob("*.py"))


def _imported_modules(tree: ast.AST):
    """(line, module name) of every import in a parsed module, at any nesting level."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.lineno, node.module
            else:  # `from . import test_x` / `from .test_x import y`
                for name in ([node.module] if node.module else [a.name for a in node.names]):
                    yield node.lineno, name
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("__import__", "import_module"):
                yield node.lineno, node.args[0].value


def test_no_module_imports_a_test_module():
    assert len([p for p in MODULES if p.name.startswith("test_")]) > 30, MODULES
    bad = [f"{path.name}:{line}: imports {name}" for path in MODULES
           for line, name in _imported_modules(ast.parse(path.read_text(encoding="utf-8"), str(path)))
           if name.split(".")[0].startswith("test_")]
    assert not bad, ("helpers imported from a test module; move them to a helper module "
                     "(not test_*.py):\n" + "\n".join(bad))
