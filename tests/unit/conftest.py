"""Fixtures shared by the unit tier."""

import pytest


@pytest.fixture
def fresh(monkeypatch):
    """smp in this process as a new script finds it: no launcher or SageMaker variables, nothing
    initialised before the test, torn down after it."""
    from smp_adapter.runtime.init import shutdown

    for key in ("SM_HP_MP_PARAMETERS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    shutdown()
    yield
    shutdown()
