import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "scripts"))

# The single-process references computed in this process use the ranks' thread count (launch_util and spawn.py
# give each rank one thread): some CPU kernels sum per-thread partials in an order set by the thread count (bf16
# LayerNorm backward's weight and bias gradients differ by an ulp between 1 and 2 threads on an Intel Xeon with
# AMX), and the bf16 comparisons are exact up to the ranks' fp32 reduction order
torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.distributed)
