"""Put on ``PYTHONPATH`` by ``smp-adapter launch`` for the processes it starts: Python runs a module
named ``sitecustomize`` at start-up, before the training script's first line, so the apex fallback's
import finder is in place even for scripts that import apex before smp (smp_adapter/compat/apex_fallback).

Then the ``sitecustomize`` this one shadows (a distribution's or a virtual environment's, later on
``sys.path``) runs as it would have without us. Nothing here imports torch.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _install_apex_fallback() -> None:
    try:
        from smp_adapter.compat.apex_fallback import install
    except ImportError:  # an interpreter without smp-adapter (a helper the launcher runs): nothing to do
        return
    install()


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_install_apex_fallback()
_run_shadowed_sitecustomize()
