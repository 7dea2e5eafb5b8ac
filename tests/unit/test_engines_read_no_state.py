"""runtime/engines/ reads no process-wide state: an engine is handed the job (runtime/job.py), the live
step progress and its collaborators when smp.init creates it, so no module under runtime/engines/ may
import runtime/state.py (at module level or inside a function)."""

import ast
from pathlib import Path

import smp_adapter

ENGINES = Path(smp_adapter.__file__).parent / "runtime" / "engines"
STATE = "smp_adapter.runtime.state"


def _package_of(path: Path) -> list[str]:
    """The dotted package a module under smp_adapter/ belongs to, as a list of names."""
    root = Path(smp_adapter.__file__).parent.parent
    return list(path.relative_to(root).with_suffix("").parts[:-1])


def _state_imports(source: str, package: list[str]) -> list[str]:
    """Each import in ``source`` (a module of ``package``) that reaches runtime/state.py, as ``line: text``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the module's package
                parent = package[:len(package) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == STATE or name.startswith(STATE + ".") for name in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_under_runtime_engines_imports_the_process_state():
    modules = sorted(ENGINES.rglob("*.py"))
    assert len(modules) > 20  # the walk sees the engines' folders
    offenders = {str(p.relative_to(ENGINES)): lines for p in modules
                 if (lines := _state_imports(p.read_text(), _package_of(p)))}
    assert offenders == {}, ("runtime/engines/ must not read runtime/state.py: hand the engine what it needs "
                             f"(the Job, the StepProgress, an argument) instead; found {offenders}")


def test_the_walk_recognises_every_spelling_of_the_import():
    """Absolute, from-package and relative imports, inside a function too, are all caught (the guard above
    cannot pass vacuously); other runtime modules are not."""
    package = ["smp_adapter", "runtime", "engines", "deepspeed"]
    for line in ["from smp_adapter.runtime.state import state", "import smp_adapter.runtime.state",
                 "from smp_adapter.runtime import state", "from ...state import warn_once", "from ... import state"]:
        assert _state_imports(f"def f():\n    {line}\n", package), line
    assert _state_imports("from smp_adapter.runtime import step\nfrom ..base import Engine\n", package) == []


def test_an_engine_is_built_and_asked_before_a_model_exists_without_smp_init():
    """The point of the rule: a Job written by hand (one rank, no process group) is all an engine needs;
    the instance records delayed creation and materialises it, with nothing of smp.init's state set."""
    import torch

    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.config.options import SMPConfig
    from smp_adapter.runtime.deferred_init import DeferredTensor
    from smp_adapter.runtime.engines import engine_for
    from smp_adapter.runtime.job import Job
    from smp_adapter.runtime.state import ProcessGroups, StepProgress, state

    cfg = SMPConfig.from_dict({})
    dims = ParallelDims.from_config(cfg, 1)
    engine_class = engine_for(dims)
    job = Job(cfg=cfg, dims=dims, groups=ProcessGroups(), rank=0, world_size=1, local_rank=0, local_size=1,
              device=torch.device("cpu"), backend="gloo", engine_config=engine_class.build_job_config(dims, "gloo"))
    engine = engine_class(job, StepProgress(), lambda messages, rank: None)
    with engine.module_init_context(torch.float32):
        torch.manual_seed(0)
        module = torch.nn.Linear(3, 2)
    assert isinstance(module.weight, DeferredTensor) and not engine.is_own_parameter(module.weight)
    engine.place_module(module, job.device)
    engine.sync_initial_state(module)  # one rank: nothing to broadcast
    engine.materialize_kept(module, job.device)
    torch.manual_seed(0)
    assert torch.equal(module.weight, torch.nn.Linear(3, 2).weight)  # the undelayed values
    assert not state.initialized and state.engine is None and engine.model is None
