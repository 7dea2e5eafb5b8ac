"""NVIDIA apex's Python names in plain PyTorch, for scripts written for smp v1's containers.

smp v1 ran in SageMaker images that shipped apex; several public smp v1 scripts import it at module
level whatever their precision (the GPT templates' ``fp16/`` helpers: ``amp_C`` and
``apex.multi_tensor_apply``; the BERT example: ``apex.amp``, ``amp_C``, ``apex_C``, ``apex.parallel``).
apex is not on PyPI and builds only with a CUDA toolchain. Where it is not installed, an import
finder makes the names these scripts use importable from this package instead:

  ``amp_C``                    multi_tensor_scale, multi_tensor_l2norm, multi_tensor_axpby (multi_tensor.py)
  ``apex_C``                   flatten, unflatten
  ``apex.multi_tensor_apply``  multi_tensor_applier, MultiTensorApply
  ``apex.optimizers``          FusedAdam, FusedLAMB (compat/fused_optimizers.py, smp.optimizers' classes)
  ``apex.normalization``       FusedLayerNorm
  ``apex.amp``                 initialize, scale_loss, master_params, _amp_state (modules.py: amp itself is
                               not carried out; the smp options that replace it are named in the error)
  ``apex.parallel``            DistributedDataParallel (refused: smp does data parallelism), flat_dist_call
  ``torch._six``               inf, nan, string_classes, ... (removed in torch 2.0; the 2022 GPT templates'
                               fp16/ helpers import ``inf`` from it: torch_six.py)

Rules:
* **Real apex wins.** The finder is the last entry of ``sys.meta_path``: it is asked only after
  Python's own finders found nothing, and it answers nothing at all when a real ``apex`` package can
  be found on ``sys.path`` (a partial apex install keeps its own behaviour).
* **Only the script's own code gets it.** An import made by a library smp-adapter runs on
  (libraries.py: torch, DeepSpeed, Megatron-core, transformers, ...) is not answered, so libraries
  that probe ``import apex`` keep their no-apex paths. A module the script imported first is in
  ``sys.modules`` and a library importing the same name later gets that module (same semantics).
* **Nothing is installed under apex's name.** The modules are created in memory from the table
  below; no file or directory named apex, amp_C or apex_C exists anywhere.
* **Off switch**: ``SMP_ADAPTER_APEX_FALLBACK=0`` in the environment.

Installed (``install()``) in every process ``smp-adapter launch`` starts, before the script's first
line (``boot/sitecustomize.py`` on ``PYTHONPATH``: the BERT example imports ``amp_C`` before smp), and
when ``smdistributed.modelparallel`` is imported (bare ``mpirun`` / ``torchrun`` runs of scripts that
import smp before apex). No torch import here: the launcher's own processes install it too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from smp_adapter.compat.libraries import is_library_module

ENV = "SMP_ADAPTER_APEX_FALLBACK"
ROOTS = ("apex", "amp_C", "apex_C")
_MT = "smp_adapter.compat.apex_fallback.multi_tensor"
_MOD = "smp_adapter.compat.apex_fallback.modules"
_OPT = "smp_adapter.compat.fused_optimizers"
_MT_OPS = ("multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_axpby")
_AMP = ("initialize", "scale_loss", "master_params", "_amp_state", "state_dict", "load_state_dict")

# module under apex's name -> (implementation module, names it holds); a package when other entries
# start with its name and a dot
MODULES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "amp_C": (_MT, _MT_OPS),
    "apex_C": (_MT, ("flatten", "unflatten")),
    "apex": (None, ()),
    "apex.multi_tensor_apply": (_MT, ("multi_tensor_applier", "MultiTensorApply")),
    "apex.multi_tensor_apply.multi_tensor_apply": (_MT, ("MultiTensorApply",)),
    "apex.optimizers": (_OPT, ("FusedAdam", "FusedLAMB")),
    "apex.optimizers.fused_adam": (_OPT, ("FusedAdam",)),
    "apex.optimizers.fused_lamb": (_OPT, ("FusedLAMB",)),
    "apex.normalization": (_MOD, ("FusedLayerNorm",)),
    "apex.normalization.fused_layer_norm": (_MOD, ("FusedLayerNorm",)),
    "apex.amp": (_MOD, _AMP),
    "apex.amp.handle": (_MOD, ("scale_loss",)),
    "apex.amp.frontend": (_MOD, ("initialize", "state_dict", "load_state_dict")),
    "apex.parallel": (_MOD, ("DistributedDataParallel",)),
    "apex.parallel.distributed": (_MOD, ("DistributedDataParallel", "flat_dist_call")),
    "torch._six": ("smp_adapter.compat.apex_fallback.torch_six", ("inf", "nan", "string_classes", "int_classes",
                                                            "container_abcs", "PY3", "PY37", "with_metaclass")),
}
_PACKAGES = {name.rpartition(".")[0] for name in MODULES if "." in name} - {"torch"}
# (apex.amp._amp_state is apex.amp's AmpState object, not a module here: importing a submodule of that name
# would rebind the attribute to the module)

# What each module is, for smp-adapter check's notes
_KINDS = {"amp_C": "apex's multi-tensor kernels in plain PyTorch (torch._foreach_*), apex's semantics",
          "apex_C": "flatten / unflatten (torch's dense-tensor flattening, the same views)",
          "apex.multi_tensor_apply": "multi_tensor_applier calls the plain-PyTorch kernels",
          "apex.optimizers": "FusedAdam / FusedLAMB with apex's update rules in plain PyTorch (smp.optimizers' classes)",
          "apex.normalization": "FusedLayerNorm is torch's LayerNorm",
          "apex.amp": "amp itself is not carried out: initialize(enabled=True) and scale_loss raise, naming the smp "
                      "options; master_params works",
          "apex.parallel": "DistributedDataParallel raises (smp does data parallelism); flat_dist_call works",
          "torch._six": "the names torch 1.x had there (inf, nan, string_classes, ...)"}

AMP_REPLACEMENT = ("in an smp job set fp16: true (or bf16: true) in the smp options, which gives the model fp16 "
                   "parameters and loss scaling (smp.DistributedOptimizer's static_loss_scale / dynamic_loss_scale "
                   "arguments), or use torch.autocast with smp.amp.GradScaler in the step function")
DDP_REPLACEMENT = ("in an smp job smp.DistributedModel does data parallelism (ddp: true in the smp options); "
                   "elsewhere use torch.nn.parallel.DistributedDataParallel")
# names the fallback has but refuses when used (modules.py raises UnsupportedFeatureError with these)
REFUSED = {**{f"apex.amp.{n}": AMP_REPLACEMENT for n in ("initialize", "scale_loss", "state_dict", "load_state_dict")},
           "apex.parallel.DistributedDataParallel": DDP_REPLACEMENT,
           "apex.parallel.distributed.DistributedDataParallel": DDP_REPLACEMENT}


def describe(module: str) -> str:
    """One line on what the fallback's ``module`` is (its closest described package)."""
    while module and module not in _KINDS:
        module = module.rpartition(".")[0]
    return _KINDS.get(module, "plain PyTorch")


def provides(module: str, name: str | None = None) -> bool:
    """Whether the fallback has ``module`` (and the attribute ``name`` in it, or a submodule of that name)."""
    if module not in MODULES:
        return False
    return name is None or name in MODULES[module][1] or f"{module}.{name}" in MODULES


def real_apex(root: str) -> str | None:
    """Where Python's own finders find ``root`` (apex, amp_C or apex_C) on ``sys.path``, else None."""
    spec = importlib.machinery.PathFinder.find_spec(root)
    return (spec.origin or "/".join(spec.submodule_search_locations or ()) or root) if spec else None


def _importer() -> str:
    """The module whose code is importing: the first frame outside importlib's machinery."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(("importlib", "_frozen_importlib")) or name == __name__):
            return name
        frame = frame.f_back
    return ""


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a plain module object

    def exec_module(self, module) -> None:
        implementation, names = MODULES[module.__name__]
        module.__doc__ = (f"smp-adapter's apex fallback for {module.__name__} (NVIDIA apex is not installed): "
                          f"see smp_adapter/compat/apex_fallback; {ENV}=0 turns it off")
        if implementation:
            source = importlib.import_module(implementation)
            for name in names:
                setattr(module, name, getattr(source, name))


_LOADER = _Loader()


class ApexFallbackFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        if fullname.partition(".")[0] in ROOTS:  # (torch._six: torch's own finder found none already)
            if real_apex(fullname.partition(".")[0]) or real_apex("apex"):
                return None
            if "." in fullname and getattr(sys.modules.get("apex"), "__loader__", None) is not _LOADER:
                return None  # a submodule of an apex that is not ours
        if is_library_module(_importer()):
            return None
        return importlib.util.spec_from_loader(fullname, _LOADER, is_package=fullname in _PACKAGES)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def installed() -> bool:
    return any(isinstance(f, ApexFallbackFinder) for f in sys.meta_path)


def install() -> bool:
    """Append the finder to ``sys.meta_path`` (once) unless ``SMP_ADAPTER_APEX_FALLBACK=0``; True when
    it is installed afterwards."""
    if not enabled():
        return False
    if not installed():
        sys.meta_path.append(ApexFallbackFinder())
    return True


def uninstall() -> None:
    """Remove the finder and forget fallback modules already imported (tests)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, ApexFallbackFinder)]
    for name in [n for n, m in sys.modules.items() if getattr(m, "__loader__", None) is _LOADER]:
        del sys.modules[name]


BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")  # on PYTHONPATH of launched ranks
