"""The script's own helper modules, as ``smp-adapter check`` sees them: which imports of the script and
of those modules the environment ``check`` runs in cannot find (``missing_imports``; CUDA-only packages
are named as such), and the file walk check/apex_names.py uses for the apex names they use.

Why: the public AWS scripts import bundled helpers unconditionally (the GPT templates' ``fp16``
package imports apex's ``amp_C`` and ``humanize``); the script itself names neither. Only modules
found beside the script (``name.py`` or a package ``name/``) are read, never executed, and only up to
a few levels of their own imports of each other.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

APEX_ROOTS = ("apex", "amp_C", "apex_C", "torch._six")  # what the apex fallback provides (reported by check/apex_names.py)
_MAX_FILES = 50  # a helper package is small; a huge tree beside the script is not followed further


def imported_roots(node: ast.Import | ast.ImportFrom) -> list[tuple[str, int]]:
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


def module_files(base: Path, name: str) -> list[Path]:
    if (base / f"{name}.py").is_file():
        return [base / f"{name}.py"]
    package = base / name
    if (package / "__init__.py").is_file():
        return sorted(package.glob("*.py"))
    return []


def _static_path(node: ast.AST, script: Path) -> Path | str | None:
    """The value of a path expression a script builds from its own location, where it can be read
    without running anything: ``__file__``, ``Path(...)``, ``.resolve()`` / ``.absolute()``,
    ``.parent``, ``.parents[N]``, ``str(...)``, ``os.path.abspath / realpath / dirname / join`` and
    string literals. None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id == "__file__":
        return script
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        inner = _static_path(node.value, script)
        return Path(inner).parent if inner is not None else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents" \
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
        inner = _static_path(node.value.value, script)
        parents = Path(inner).parents if inner is not None else ()
        return parents[node.slice.value] if 0 <= node.slice.value < len(parents) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):  # Path(...) / "shared"
        left, right = _static_path(node.left, script), _static_path(node.right, script)
        return Path(left) / right if left is not None and right is not None else None
    if not isinstance(node, ast.Call):
        return None
    func, args = node.func, [_static_path(a, script) for a in node.args]
    if any(a is None for a in args) or node.keywords:
        return None
    name = ast.unparse(func)
    if name in ("Path", "pathlib.Path", "str", "os.fspath") and len(args) == 1:
        return Path(args[0]) if name.endswith("Path") else str(args[0])
    if name in ("os.path.abspath", "os.path.realpath", "os.path.normpath") and len(args) == 1:
        return Path(args[0])
    if name == "os.path.dirname" and len(args) == 1:
        return Path(args[0]).parent
    if name == "os.path.join" and args:
        return Path(*map(str, args))
    if isinstance(func, ast.Attribute) and func.attr in ("resolve", "absolute") and not args:
        inner = _static_path(func.value, script)
        return Path(inner) if inner is not None else None
    return None


def search_roots(tree: ast.Module, path: Path) -> list[Path]:
    """Where the file's absolute imports are looked for among the script's own modules: its folder,
    then each folder it puts on ``sys.path`` at module level with a path built from its own location
    (``sys.path.insert(0, str(Path(__file__).resolve().parents[1]))``, as the recipes and many AWS
    examples do to reach a shared helper)."""
    roots = [path.parent]
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
        if call is None or ast.unparse(call.func) not in ("sys.path.insert", "sys.path.append") or not call.args:
            continue
        value = _static_path(call.args[-1], path)
        if value is not None:
            folder = Path(value) if Path(value).is_absolute() else path.parent / value
            if folder.is_dir() and folder not in roots:
                roots.append(folder)
    return roots


def local_module_files(roots: list[Path], name: str) -> list[Path]:
    """``module_files`` in the first of ``roots`` that holds the module."""
    for root in roots:
        found = module_files(root, name)
        if found:
            return found
    return []


def parsed_files(queue: list[Path]):
    """(path, syntax tree) of each file in ``queue`` once, breadth first, including the files the
    caller appends to ``queue`` while reading (a module's own imports); at most ``_MAX_FILES``.
    Files that cannot be read or parsed are passed over (the script's own run would say why)."""
    seen: set[Path] = set()
    while queue and len(seen) < _MAX_FILES:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            yield path, ast.parse(path.read_text(), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            continue


# Packages that build or run only with CUDA: on a machine without it they are absent by design,
# and a script importing them unguarded cannot start there. import name -> pip name.
GPU_ONLY_PACKAGES = {"flash_attn": "flash-attn", "transformer_engine": "transformer-engine[pytorch]",
                     "xformers": "xformers", "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d",
                     "fused_dense_lib": "flash-attn", "dropout_layer_norm": "flash-attn",
                     "rotary_emb": "flash-attn", "megablocks": "megablocks", "grouped_gemm": "grouped_gemm",
                     "cupy": "cupy-cuda12x", "pynvml": "nvidia-ml-py"}
# import name -> pip name where they differ (the hint's install command)
_PIP_NAMES = {"sklearn": "scikit-learn", "PIL": "pillow", "cv2": "opencv-python", "yaml": "pyyaml",
              "skimage": "scikit-image", "bs4": "beautifulsoup4", "smdebug": "smdebug"}


@dataclass(frozen=True)
class MissingImport:
    line: int  # the script's import statement that leads to it
    col: int
    statement: str
    module: str  # top-level name that does not resolve
    where: str  # "" in the script itself, else "helper.py:26" in a module beside it
    conditional: bool  # inside a function / if: needed only when that code runs

    def note(self) -> str:
        pip = GPU_ONLY_PACKAGES.get(self.module)
        if "." in self.module:  # the package is installed, this module of it is not
            root = self.module.split(".")[0]
            try:
                from importlib.metadata import version

                installed = f"{root} {version(_PIP_NAMES.get(root, root))}"
            except Exception:  # noqa: BLE001 - no distribution metadata (a source checkout)
                installed = f"the installed {root}"
            what = (f"`{self.module}` does not exist in {installed} (a module of another release, or a misspelled "
                    f"name: install a {root} that has it, or change the import)")
            if self.where:
                what += f", imported by the script's own module at {self.where}"
            return what + (": needed when that code runs" if self.conditional else "")
        what = (f"`{self.module}` is not installed (a CUDA-only package; on a GPU machine `pip install {pip}`)" if pip
                else f"`{self.module}` is not installed (`pip install {_PIP_NAMES.get(self.module, self.module)}`, or put "
                     "it beside the script if it is one of the script's own modules)")
        if self.where:
            what += f", imported by the script's own module at {self.where}"
        return what + (": needed when that code runs" if self.conditional else "")


def _resolves(name: str) -> bool:
    if name in sys.builtin_module_names or name in sys.stdlib_module_names:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _conditional(tree: ast.Module, node: ast.AST) -> bool:
    """Not run when the module is imported: inside a function, class body or ``if``."""
    return not any(node is stmt for stmt in tree.body)


def missing_imports(script: str | Path, skip: tuple[str, ...] = APEX_ROOTS) -> list[MissingImport]:
    """Every module the script, and the modules beside it that it imports (followed the same way),
    import without a ``try`` guard and that the running environment cannot find. Nothing is executed:
    names are resolved with importlib's finder. ``skip``: roots reported elsewhere (apex)."""
    path = Path(script).resolve()
    root = path.parent
    try:
        script_tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    roots = search_roots(script_tree, path)
    found, cache = [], {}
    for node in ast.walk(script_tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _guarded(script_tree, node):
            continue
        for name, level in imported_roots(node):
            if level or name in skip:
                continue
            local = local_module_files(roots, name)
            if local:
                for module, where, conditional in _missing_in_helpers(root, roots, local, skip, cache):
                    found.append(MissingImport(node.lineno, node.col_offset + 1, ast.unparse(node), module, where,
                                               conditional or _conditional(script_tree, node)))
            else:
                missing = name if not _resolves(name) else next(
                    (d for d in _dotted_modules(node, name, skip) if not _resolves_dotted(d)), None)
                if missing:
                    found.append(MissingImport(node.lineno, node.col_offset + 1, ast.unparse(node), missing, "",
                                               _conditional(script_tree, node)))
    return found


def _dotted_modules(node: ast.Import | ast.ImportFrom, root: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The dotted module names under ``root`` an absolute import statement names (``transformers.sagemaker``
    of ``from transformers.sagemaker import X``; not X, which may be an attribute)."""
    if isinstance(node, ast.ImportFrom):
        names = [node.module] if node.module and not node.level else []
    else:
        names = [a.name for a in node.names]
    return [n for n in names if "." in n and n.split(".")[0] == root
            and not any(n == s or n.startswith(s + ".") for s in skip)]


def _resolves_dotted(name: str) -> bool:
    """Whether ``a.b.c`` exists, found through each package's search locations with importlib's path
    finder: the packages are not imported (find_spec of a dotted name would import ``a`` and ``a.b``).
    A parent that is a plain module (its attributes may be modules, as ``os.path``) counts as found."""
    parts = name.split(".")
    if parts[0] in sys.builtin_module_names or parts[0] in sys.stdlib_module_names:
        return True
    try:
        spec = importlib.util.find_spec(parts[0])
        for i in range(1, len(parts)):
            if spec is None:
                return False
            locations = spec.submodule_search_locations
            if locations is None:
                return True
            # str(): an imported transformers' lazy module lists its location as a PosixPath, which the path
            # finder skips (so every transformers.x.y looked missing once a transformers model was built)
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), [str(p) for p in locations])
        return spec is not None
    except (ImportError, ValueError):
        return True  # a finder that cannot answer without importing: not reported


def _missing_in_helpers(root: Path, roots: list[Path], files: list[Path], skip,
                        cache: dict) -> list[tuple[str, str, bool]]:
    """(module, "file.py:line", conditional) for each unresolvable import in the helper files and
    the helpers they import in turn (breadth first, a few dozen files at most); a helper's own
    ``sys.path`` additions count from where they are read on."""
    queue, found, roots = list(files), [], list(roots)
    for path, tree in parsed_files(queue):
        roots += [r for r in search_roots(tree, path)[1:] if r not in roots]
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _guarded(tree, node):
                continue
            for name, level in imported_roots(node):
                beside = module_files(path.parent, name) if level else local_module_files(roots, name)
                if beside or level:
                    queue += beside
                elif name not in skip:
                    missing = name if not cache.setdefault(name, _resolves(name)) else next(
                        (d for d in _dotted_modules(node, name, skip) if not cache.setdefault(d, _resolves_dotted(d))), None)
                    if missing:
                        where = path.relative_to(root) if path.is_relative_to(root) else path
                        found.append((missing, f"{where}:{node.lineno}", _conditional(tree, node)))
    return found
