import os

import pytest

# DeepSpeed picks its accelerator at import time; tests run on CPU unless a test says otherwise.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


# set by pytest itself, by torch when it first imports its compiler, and by DeepSpeed's first
# import (its accelerator probe), and by an OpenMP-linked package of the GPU image's on its first import
# (KMP_*, seen there with torch 2.11+cu130, 2026-11-27): not a test's doing
_NOT_LEAKS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", "KMP_DUPLICATE_LIB_OK",
              "KMP_INIT_AT_FORK"}


@pytest.fixture(autouse=True)
def isolated_smp_state():
    """Every test starts without smp state and must leave the environment as it found it.

    After the test: smp is shut down if the test left it initialised (its process group, TP context,
    marking contexts and cached DeepSpeed groups go with it), and any environment variable the test
    added, removed or changed is restored and reported as a failure: a leaked variable (a
    MASTER_PORT, an SM_HP_MP_PARAMETERS) silently changes what later tests run. Tests that need
    variables set them with ``monkeypatch.setenv``, which restores them before this check."""
    before = {k: v for k, v in os.environ.items() if k not in _NOT_LEAKS}
    yield
    import sys

    init = sys.modules.get("smp_adapter.runtime.init")
    state = sys.modules.get("smp_adapter.runtime.state")
    if init is not None and state is not None and (state.state.initialized or state.state.model is not None):
        init.shutdown()
    after = {k: v for k, v in os.environ.items() if k not in _NOT_LEAKS}
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        for name in changed:
            if name in before:
                os.environ[name] = before[name]
            else:
                del os.environ[name]
        pytest.fail(f"the test leaked environment variables {changed}: set them with monkeypatch.setenv "
                    "(or restore them) so later tests do not inherit them", pytrace=False)
