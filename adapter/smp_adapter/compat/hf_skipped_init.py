"""Hugging Face weight initialisation that a script skipped because smp v1's DistributedModel would redo it.

The public AWS GPT templates (``training/distributed_training/pytorch/model_parallel/gpt2/train.py`` and its
siblings), with ``--use_distributed_transformer 1``, set ``PreTrainedModel.init_weights = lambda x: None``
before ``AutoModelForCausalLM.from_config``: "DistributedModel will override those weights anyway". smp v1
replaced the model's blocks and LM head by its own distributed modules, which drew their own weights and tied
the LM head to the word embedding. smp-adapter keeps the Hugging Face modules (parallel/smp_layout.py), so
without this the model would train from what the constructors alone leave: an embedding drawn from N(0, 1),
an LM head that is a second, untied matrix, no scaled residual projections.

Choice (smp v1 documents only that the distributed modules initialise themselves): a model created for tensor
parallelism (inside ``smp.model_creation(tensor_parallelism=True)`` or ``smp.tensor_parallelism()``) is created
with transformers' own ``init_weights`` whatever the script set, so it holds, draw for draw, what the same
script without the shortcut creates: a one-process run's weights and first loss, the LM head tied. The
original function is remembered when ``transformers.modeling_utils`` is first imported (an import hook set at
the first smp import) or, if it already was, at that import. Where it was replaced before smp was imported,
nothing is left to restore: ``smp.DistributedModel`` then runs the family's ``_init_weights`` over the model and
ties its weights (the right distributions and tying, not the same draws). Under delayed initialisation both
happen inside the model's recorded creation and are replayed with it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys

from torch import nn

MODELING_UTILS = "transformers.modeling_utils"
_original_init_weights = None  # transformers' PreTrainedModel.init_weights, once seen


def _from_transformers(function) -> bool:
    return str(getattr(function, "__module__", "") or "").startswith("transformers")


def _remember(modeling_utils) -> None:
    global _original_init_weights
    function = getattr(getattr(modeling_utils, "PreTrainedModel", None), "__dict__", {}).get("init_weights")
    if _original_init_weights is None and function is not None and _from_transformers(function):
        _original_init_weights = function


class _RememberOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when transformers.modeling_utils is imported, it lets the other finders find it
    and remembers ``init_weights`` right after the module ran (then leaves ``sys.meta_path``)."""

    def find_spec(self, name, path=None, target=None):
        if name != MODELING_UTILS:
            return None
        uninstall()
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def run_and_remember(module):
                run(module)
                _remember(module)

            spec.loader.exec_module = run_and_remember
        return spec


def install() -> None:
    """At the first smp import: remember transformers' init_weights now, or when it is first imported."""
    if MODELING_UTILS in sys.modules:
        _remember(sys.modules[MODELING_UTILS])
    elif not any(isinstance(f, _RememberOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RememberOnImport())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RememberOnImport)]


def _base_and_init_weights():
    """(transformers' PreTrainedModel, the init_weights it holds now), or Nones where transformers is not imported."""
    base = getattr(sys.modules.get(MODELING_UTILS), "PreTrainedModel", None)
    return base, (base.__dict__.get("init_weights") if base is not None else None)


@contextlib.contextmanager
def transformers_init_weights():
    """While models are created for tensor parallelism: transformers' init_weights in place of a script's."""
    base, replaced = _base_and_init_weights()
    if _original_init_weights is None or replaced is None or _from_transformers(replaced):
        yield
        return
    base.init_weights = _original_init_weights
    try:
        yield
    finally:
        base.init_weights = replaced


def skipped_init(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers model whose ``init_weights`` is the base class's, replaced by a
    function from outside transformers (the templates' ``lambda x: None``)."""
    base, replaced = _base_and_init_weights()
    if base is None or not isinstance(module, base):
        return False
    if replaced is None or type(module).init_weights is not replaced:
        return False  # the family's own init_weights (or the base's, untouched) runs as written
    return not _from_transformers(replaced)


def initialize_skipped_weights(module: nn.Module) -> bool:
    """At smp.DistributedModel, where transformers' init_weights could not be put back while the model was
    created (replaced before smp's import): the family's initialisation and tying; True if it ran."""
    if _original_init_weights is not None or not skipped_init(module):
        return False
    if hasattr(module, "initialize_weights"):  # transformers >= 4.47: smart_apply of _initialize_weights
        module.initialize_weights()
    else:
        module.apply(module._initialize_weights)
    module.tie_weights()
    return True
