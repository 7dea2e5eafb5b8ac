"""The script's own helper modules, as ``smp-adapter check`` sees them: whether one that the script
imports needs NVIDIA apex.

Why: the DLC GPT-2 test script imports its bundled ``fp16`` package unconditionally, and that package
imports apex's ``amp_C``; the script itself names no apex module, yet cannot start without it. Only
modules found beside the script (``name.py`` or a package ``name/``) are read, never executed, and
only up to a few levels of their own imports of each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

APEX_ROOTS = ("apex", "amp_C", "apex_C")
_MAX_FILES = 50  # a helper package is small; a huge tree beside the script is not followed further


def _imported_roots(node: ast.Import | ast.ImportFrom) -> list[tuple[str, int]]:
    """(top-level module, relative level) of each module an import statement names."""
    if isinstance(node, ast.ImportFrom):
        if node.level:  # `from .fp16util import x`, `from . import loss_scaler`: the package's own
            return [(node.module.split(".")[0], node.level)] if node.module else \
                [(a.name, node.level) for a in node.names]
        return [(node.module.split(".")[0], 0)] if node.module else []
    return [(a.name.split(".")[0], 0) for a in node.names]


def _guarded(tree: ast.Module, node: ast.AST) -> bool:
    """Inside a ``try:`` body (its fallback is the module's business)."""
    return any(isinstance(t, ast.Try) and any(node is n for stmt in t.body for n in ast.walk(stmt))
               for t in ast.walk(tree))


def _module_files(base: Path, name: str) -> list[Path]:
    if (base / f"{name}.py").is_file():
        return [base / f"{name}.py"]
    package = base / name
    if (package / "__init__.py").is_file():
        return sorted(package.glob("*.py"))
    return []


def apex_need(script: str | Path, module: str) -> str | None:
    """Where the script's own module ``module`` (beside ``script``) imports apex unguarded, as
    ``fp16/fp16.py:9 (amp_C)``; None when it does not, or when no such module is beside the script."""
    root = Path(script).resolve().parent
    queue, seen = list(_module_files(root, module)), set()
    while queue and len(seen) < _MAX_FILES:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name, level in _imported_roots(node):
                if not level and name in APEX_ROOTS and not _guarded(tree, node):
                    return f"{path.relative_to(root)}:{node.lineno} ({name})"
                queue += _module_files(path.parent if level else root, name)
    return None
