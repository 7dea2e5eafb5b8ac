"""``smp-adapter check``: the NVIDIA apex names a script uses, in the script itself and in its own
modules beside it (the GPT templates' ``fp16/`` helpers), and what the run will get for each.

A name is a dotted path as the code reaches it: ``from apex.multi_tensor_apply import
multi_tensor_applier`` uses ``apex.multi_tensor_apply.multi_tensor_applier``; ``import amp_C`` then
``amp_C.multi_tensor_scale(...)`` uses ``amp_C.multi_tensor_scale``; ``from torch._six import inf``
(removed in torch 2.0; the same fallback provides it) uses ``torch._six.inf``. What the run gets:

* real apex, where Python finds an ``apex`` package in this environment (``supported``);
* otherwise smp-adapter's apex fallback (smp_adapter/compat/apex_fallback: plain PyTorch, apex's semantics):
  ``supported`` for the names it carries out; ``partial`` for the names it refuses when used
  (``apex.amp.initialize``, ``apex.parallel.DistributedDataParallel``) where the script only imports
  them or uses them under an ``if``; ``unsupported`` where used unconditionally, and for names it does
  not have (install apex);
* with ``SMP_ADAPTER_APEX_FALLBACK=0``: ``unsupported`` (apex is needed).

Nothing is executed: files are parsed, and names resolved against the fallback's table.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from smp_adapter.compat import apex_fallback
from smp_adapter.check.local import imported_roots, module_files, parsed_files

ROOTS = (*apex_fallback.ROOTS, "torch._six")


@dataclass(frozen=True)
class ApexUse:
    name: str  # dotted path, e.g. "amp_C.multi_tensor_l2norm"
    line: int
    col: int
    expr: str
    conditional: bool  # under an if / try (import: a guarded one): needed only when that code runs
    call: bool  # called here (refused names raise only when used)


def _root_of(module: str) -> str | None:
    for root in ROOTS:
        if module == root or module.startswith(root + "."):
            return root
    return None


def _conditional(parents: dict, node: ast.AST) -> bool:
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, (ast.If, ast.IfExp, ast.While)) and child is not node.test:
            return True
        if isinstance(node, ast.Try) and child in node.body:
            return True
    return False


def uses_in(tree: ast.Module) -> list[ApexUse]:
    """The apex names one parsed file uses: what it imports from them and the attributes it reads on them."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bound: dict[str, str] = {}  # local name -> dotted apex path
    found: list[ApexUse] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _root_of(a.name):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    found.append(ApexUse(a.name, node.lineno, node.col_offset + 1, ast.unparse(node),
                                         _conditional(parents, node), False))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _root_of(node.module):
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
                found.append(ApexUse(f"{node.module}.{a.name}", node.lineno, node.col_offset + 1, ast.unparse(node),
                                     _conditional(parents, node), False))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            name = f"{bound[node.value.id]}.{node.attr}"
        elif isinstance(node, ast.Name) and node.id in bound and isinstance(node.ctx, ast.Load):
            name = bound[node.id]
        else:
            continue
        parent = parents.get(node)
        call = isinstance(parent, ast.Call) and parent.func is node
        if call or isinstance(node, ast.Attribute):
            found.append(ApexUse(name, node.lineno, node.col_offset + 1, ast.unparse(parent if call else node),
                                 _conditional(parents, node), call))
    return sorted(found, key=lambda u: (u.line, u.col))


def helper_uses(script: str | Path, module: str) -> list[tuple[str, ApexUse]]:
    """(``"fp16/fp16.py"``, use) for the apex names the script's own module ``module`` beside it uses,
    and the modules it imports in turn (read, never executed)."""
    root = Path(script).resolve().parent
    queue = list(module_files(root, module))
    found = []
    for path, tree in parsed_files(queue):
        found += [(str(path.relative_to(root)), use) for use in uses_in(tree)]
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name, level in imported_roots(node):
                    queue += module_files(path.parent if level else root, name)
    return found


def _real(root: str) -> str | None:
    if root == "torch._six":
        spec = importlib.util.find_spec("torch")
        locations = spec.submodule_search_locations if spec else None
        return next((str(Path(p) / "_six.py") for p in locations or () if (Path(p) / "_six.py").exists()), None)
    return apex_fallback.real_apex("apex") or (apex_fallback.real_apex(root) if root != "apex" else None)


def _split(name: str) -> tuple[str, str | None]:
    """(module in the fallback's table, attribute or None) for a dotted name."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in apex_fallback.MODULES:
            return module, ".".join(parts[cut:]) or None
    return name, None


def status(use: ApexUse) -> tuple[str, str]:
    """(status, note) of one use: real apex, the fallback, or missing."""
    root = _root_of(use.name)
    real = _real(root)
    what = "torch._six (removed in torch 2.0)" if root == "torch._six" else "NVIDIA apex"
    if real:
        return "supported", f"{what} is installed here ({real}): the run uses it"
    if not apex_fallback.enabled():
        return "unsupported", (f"{what} is not installed and {apex_fallback.ENV}=0 turns smp-adapter's fallback off: "
                               "install apex (CUDA toolchain) or unset it")
    module, attr = _split(use.name)
    if not apex_fallback.provides(module, attr.split(".")[0] if attr else None):
        return "unsupported", (f"{use.name} is not in smp-adapter's apex fallback (it has "
                               f"{', '.join(sorted(apex_fallback.MODULES))}): install NVIDIA apex (needs CUDA)")
    refusal = apex_fallback.REFUSED.get(f"{module}.{attr.split('.')[0]}" if attr else module)
    if refusal is None:
        return "supported", f"{what} is not installed: smp-adapter's fallback ({apex_fallback.describe(module)})"
    used = "used" if use.call else "imported"
    if not use.call or use.conditional:
        return "partial", (f"{what} is not installed: {use.name} is {used} here but raises UnsupportedFeatureError "
                           f"when it runs ({refusal})")
    return "unsupported", f"{what} is not installed: {use.name} raises UnsupportedFeatureError ({refusal})"
