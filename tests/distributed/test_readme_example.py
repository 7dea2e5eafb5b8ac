"""The README's first example runs as the README says: its launch command, as written (here from the
repository root, with this interpreter's smp-adapter), trains examples/smp_v1_train.py as a 2-stage
pipeline on two CPU processes with the losses of the same script's model, data and optimizer in one
plain PyTorch process (to the 4 decimals it prints), and the loss falls."""

import re
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from launch_util import ROOT, base_env

sys.path.insert(0, str(ROOT / "tests/unit"))
from test_readme import readme_launch_command  # noqa: E402


def _single_process_losses(steps: int) -> list[float]:
    """examples/smp_v1_train.py without smp: the same seeds, model, optimizer and batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        data = torch.randn(32, 32, generator=g)
        target = data[:, :4].argmax(1)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_readme_command_trains_the_readme_script(tmp_path):
    cmd = readme_launch_command()
    out = subprocess.run([sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())", "launch",
                          "--job-dir", str(tmp_path / "job"), *cmd[2:]], cwd=ROOT, env=base_env(),
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", text)]
    reference = _single_process_losses(20)
    assert len(losses) == 20, text[-3000:]
    # printed with 4 decimals; the pipeline sums the 4 microbatch losses in another order (float rounding)
    assert all(abs(got - want) <= 1e-4 + 1e-5 for got, want in zip(losses, reference)), (losses, reference)
    assert losses[-1] < 0.7 * losses[0], losses
