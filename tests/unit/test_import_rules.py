"""The import rules docs/architecture.md states, read from the source with ``ast`` (nothing of the
project is imported, so a rule breaks here before it breaks a process):

* the floors of the map: a room of ``smp_adapter`` (a top-level package or module) imports only rooms
  on lower floors (the floors held below as data, and checked against the map's text), and inside
  runtime/ each part imports only the parts the map lists below it;
* no import circles between rooms;
* DeepSpeed is imported only under runtime/engines/deepspeed/, torch FSDP only under runtime/engines/mics/;
* config/ imports no torch at all; launch/ and plan/ import none when they are imported.

Every ``import`` and ``from ... import`` counts, also those inside functions (see ``Import.lazy``),
and so do ``importlib.import_module`` / ``__import__`` calls with a literal module name."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "adapter"
MAP = ROOT / "docs" / "architecture.md"

# The floors of docs/architecture.md's map, one entry per room of adapter/smp_adapter/ (and the
# smdistributed package beside it). ``__init__`` is smp_adapter/__init__.py. cli.py reaches commands/
# by a computed name (``importlib.import_module(f"smp_adapter.commands.{name}")``), which is no edge here:
# the map draws cli low for that reason.
FLOORS = {
    "commands": 7,
    "check": 6, "smdistributed": 6,
    "runtime": 5,
    "parallel": 4, "plan": 4,
    "launch": 3, "translate": 3,
    "config": 2, "ledger": 2, "compat": 2, "module_init_hooks": 2, "cli": 2,
    "errors": 1, "__init__": 1,
}

# The map's floors inside runtime/, top floor first: a part is a module or package right under runtime/.
RUNTIME_FLOORS = {
    **dict.fromkeys(["model", "init", "memory"], 5),
    "engines": 4,
    "checkpoint": 3,
    **dict.fromkeys(["step", "optimizer", "comm", "finiteness", "partition", "process_exit", "agreement",
                     "activation_checkpoint", "grad_scaler"], 2),
    **dict.fromkeys(["state", "job", "clipping", "attention", "kernel_switches", "deferred_init", "file_backed"], 1),
}

# Libraries whose import imports torch: none of them may be imported where torch may not be.
TORCH_LIBRARIES = {"torch", "deepspeed", "transformers", "megatron", "accelerate", "apex", "torchvision"}


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module's dotted name
    line: int
    module: str  # the absolute name of the imported module (``from X import Y``: X)
    name: str | None  # ``from X import Y``: Y, which may be a module or a name in X
    # Inside a function (a lazy import: it runs when the function is first called, not when the file
    # is imported). Lazy imports count for every rule below but the ones about import time: for the
    # floors and circles because deferring an import defers its cost, not the dependency (today every
    # lazy import between rooms points down a floor too: check/ reaches runtime/ only lazily, and the
    # map draws it above runtime/); for DeepSpeed, FSDP and torch because a lazy import is how those
    # are meant to be imported, in the one place each is allowed.
    lazy: bool

    @property
    def where(self) -> str:
        return f"{modules()[self.importer].relative_to(ROOT)}:{self.line}"

    def is_under(self, folder: str) -> bool:
        package = f"smp_adapter.{folder.replace('/', '.')}"
        return self.importer == package or self.importer.startswith(package + ".")

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module

    @property
    def target(self) -> str:
        """The project module this imports (a submodule when Y is one), else the external name."""
        return self.dotted if self.dotted in modules() else self.module


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of adapter/, by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(ADAPTER.rglob("*.py")):
        parts = list(path.relative_to(ADAPTER).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _absolute(importer: str, level: int, module: str | None) -> str:
    package = importer.split(".")
    if modules()[importer].name != "__init__.py":
        package.pop()
    package = package[:len(package) - (level - 1)]
    return ".".join(package + ([module] if module else []))


def _literal_import(node: ast.Call) -> str | None:
    """``importlib.import_module("x")`` / ``__import__("x")`` with a literal name: x."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


@functools.cache
def imports_of(importer: str) -> tuple[Import, ...]:
    path = modules()[importer]
    found = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(importer, child.lineno, alias.name, None, lazy) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                module = _absolute(importer, child.level, child.module) if child.level else child.module
                found.extend(Import(importer, child.lineno, module, alias.name, lazy) for alias in child.names)
            elif isinstance(child, ast.Call) and _literal_import(child):
                found.append(Import(importer, child.lineno, _literal_import(child), None, lazy))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return tuple(found)


def all_imports() -> list[Import]:
    return [imp for name in modules() for imp in imports_of(name)]


def room(module: str) -> str | None:
    """The room of a project module (None for anything outside adapter/)."""
    parts = module.split(".")
    if parts[0] == "smdistributed":
        return "smdistributed"
    if parts[0] != "smp_adapter":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def runtime_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["smp_adapter", "runtime"] and len(parts) > 2 else None


def _floor_violations(part_of, floors: dict[str, int], what: str) -> list[str]:
    unmapped = sorted({f"{what}{p}" for name in modules() if (p := part_of(name)) and p not in floors})
    bad = [f"{name} is not on the map: give it a floor in docs/architecture.md and in this test"
           for name in unmapped]
    for imp in all_imports():
        src, dst = part_of(imp.importer), part_of(imp.target)
        if src and dst and src != dst and src in floors and dst in floors and floors[dst] >= floors[src]:
            bad.append(f"{imp.where} imports {imp.target}: {what}{src} is on floor {floors[src]}, "
                       f"{what}{dst} on floor {floors[dst]} (not below it)")
    return bad


def test_rooms_import_only_rooms_on_lower_floors():
    bad = _floor_violations(room, FLOORS, "")
    assert not bad, "a room imports only rooms on lower floors (docs/architecture.md, The map):\n" + "\n".join(bad)


def test_runtime_parts_import_only_parts_below_them():
    bad = _floor_violations(runtime_part, RUNTIME_FLOORS, "runtime/")
    assert not bad, "inside runtime/, a part imports only the parts below it (docs/architecture.md, The map):\n" \
        + "\n".join(bad)


def _map_rooms() -> dict[str, int]:
    """The rooms the map's text puts on each floor: ``floor N  name`` or a name at the same column."""
    (block,) = re.findall(r"## The map\n.*?```\n(.*?)```", MAP.read_text(), re.S)
    floors, floor = {}, None
    for line in block.splitlines():
        if match := re.match(r"(?:floor (\d)  | {9})(\S+)", line):
            floor = int(match[1] or floor)
            floors[re.sub(r"(/|\.py)$", "", match[2])] = floor
    return floors


def test_the_floors_here_are_the_maps():
    drawn = _map_rooms()
    differ = [f"{name}: floor {drawn.get(name)} on the map, {FLOORS.get(name)} in FLOORS"
              for name in sorted(drawn.keys() | FLOORS.keys()) if drawn.get(name) != FLOORS.get(name)]
    assert not differ, "docs/architecture.md's map and FLOORS here differ:\n" + "\n".join(differ)


def test_no_import_circles_between_rooms():
    edges: dict[str, dict[str, Import]] = {}
    for imp in all_imports():
        src, dst = room(imp.importer), room(imp.target)
        if src and dst and src != dst:
            edges.setdefault(src, {}).setdefault(dst, imp)
    done: set[str] = set()

    def circle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in edges.get(node, {}):
            if found := circle_from(nxt, path + [node]):
                return found
        done.add(node)
        return None

    for start in sorted(edges):
        if circle := circle_from(start, []):
            steps = [f"{a} -> {b} ({edges[a][b].where} imports {edges[a][b].target})"
                     for a, b in zip(circle, circle[1:])]
            raise AssertionError("an import circle between rooms:\n" + "\n".join(steps))


def test_deepspeed_is_imported_only_under_engines_deepspeed():
    bad = [f"{imp.where} imports {imp.dotted}" for imp in all_imports()
           if imp.module.split(".")[0] == "deepspeed" and not imp.is_under("runtime/engines/deepspeed")]
    assert not bad, "DeepSpeed is imported only under runtime/engines/deepspeed/ (docs/architecture.md):\n" \
        + "\n".join(bad)


def _is_fsdp(imp: Import) -> bool:
    return imp.dotted.startswith(("torch.distributed.fsdp", "torch.distributed._composable")) or (
        imp.module.startswith("torch") and imp.name in ("fully_shard", "FSDPModule", "FullyShardedDataParallel"))


def test_torch_fsdp_is_imported_only_under_engines_mics():
    bad = [f"{imp.where} imports {imp.dotted}" for imp in all_imports()
           if _is_fsdp(imp) and not imp.is_under("runtime/engines/mics")]
    assert not bad, "torch FSDP (fully_shard) is imported only under runtime/engines/mics/ " \
        "(docs/architecture.md: mics/ is smp v1's MiCS on torch FSDP2):\n" + "\n".join(bad)


def _imports_torch(imp: Import) -> bool:
    return imp.module.split(".")[0] in TORCH_LIBRARIES


def _torch_at_import_time(name: str) -> list[str]:
    """The torch imports that importing the module runs: its module-level imports and theirs (and
    their packages'), through the project's modules; each with the chain of modules that leads there."""
    via: dict[str, str | None] = {name: None}
    todo, found = [name], []
    while todo:
        current = todo.pop()
        parts = current.split(".")
        packages = [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in modules()]
        for imp in imports_of(current):
            if imp.lazy:
                continue
            if _imports_torch(imp):
                chain, step = [], current
                while step:
                    chain.insert(0, step)
                    step = via[step]
                found.append(f"{imp.where} imports {imp.dotted} when {name} is imported ({' -> '.join(chain)})")
            elif imp.target in modules():
                packages.append(imp.target)
        for nxt in packages:
            if nxt not in via:
                via[nxt] = current
                todo.append(nxt)
    return found


def test_config_imports_no_torch():
    bad = [f"{imp.where} imports {imp.dotted}" for imp in all_imports()
           if imp.is_under("config") and _imports_torch(imp)]
    bad += [found for name in modules() if room(name) == "config" for found in _torch_at_import_time(name)]
    assert not bad, "config/ is pure data: no torch import (docs/architecture.md, layer 1):\n" \
        + "\n".join(sorted(set(bad)))


def test_launch_and_plan_import_no_torch_when_imported():
    bad = sorted(found for name in modules() if room(name) in ("launch", "plan")
                 for found in _torch_at_import_time(name))
    assert not bad, "launch/ (no torch import at import time) and plan/ (no torch import on the arithmetic " \
        "path), docs/architecture.md layers 3 and 10: import torch inside the function that needs it:\n" \
        + "\n".join(bad)
