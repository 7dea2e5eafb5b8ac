"""The README's first example runs as the README says: its launch command, as written (here from the
repository root, with this interpreter's smp-adapter), trains examples/smp_v1_train.py as a 2-stage
pipeline on two CPU processes with the losses of the same script's model, data and optimizer in one
plain PyTorch process (to the 4 decimals it prints), and the loss falls.

Around that one launch, a newcomer's first hour: the output carries no warning and no traceback (no
torch FutureWarning, no DeepSpeed runner noise about hostfiles or CUDA_VISIBLE_DEVICES on a --cpu
run); then translate with bad input, check on the example and on a typo of it, plan with the README's
options, and report on what the launch left (its job directory, its communication ledger) each end
with their documented status, without a traceback or a Python warning."""

import json
import re
import subprocess
import sys
import warnings

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


# what a normal run must not print: Python warnings and tracebacks, DeepSpeed's runner lines
NOISE = re.compile(r"Warning:|Traceback|\[WARNING\]|Unable to find hostfile|CUDA_VISIBLE_DEVICES")


def test_the_readme_command_trains_the_readme_script(tmp_path):
    cmd = readme_launch_command()
    # --comm-ledger: what `report` reads afterwards (the newcomer path below); the README's command otherwise
    out = subprocess.run([sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())", "launch",
                          "--job-dir", str(tmp_path / "job"), "--comm-ledger", str(tmp_path / "ledger"), *cmd[2:]],
                         cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    assert not NOISE.findall(text), [line for line in text.splitlines() if NOISE.search(line)]
    # rank 0's partition lines name the script's modules by their path in the nn.Sequential, not as bare indexes
    assert re.findall(r"^\[rank 0\]   (\S+) -> \d$", text, re.M) == ["model.0", "model.2", "model.4"], text[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", text)]
    reference = _single_process_losses(20)
    assert len(losses) == 20, text[-3000:]
    # printed with 4 decimals; the pipeline sums the 4 microbatch losses in another order (float rounding)
    assert all(abs(got - want) <= 1e-4 + 1e-5 for got, want in zip(losses, reference)), (losses, reference)
    assert losses[-1] < 0.7 * losses[0], losses
    _newcomer_path(tmp_path, json.loads(cmd[cmd.index("--options") + 1]))


def _cli(*argv: str) -> tuple[int, str]:
    """One smp-adapter command in this process: (exit status, stdout + stderr); a traceback raises, and
    any Python warning it gives fails the test."""
    import contextlib
    import io

    from smp_adapter.cli import main

    buffer = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(buffer), \
            contextlib.redirect_stderr(buffer):
        warnings.simplefilter("always")
        code = main(list(argv))
    assert not caught, [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]
    return code, buffer.getvalue()


def _newcomer_path(tmp_path, options: dict) -> None:
    """After the README's launch: the other front doors, as a new user tries them."""
    code, text = _cli("translate", json.dumps({"pipline_parallel_degree": 2, "microbatches": "four",
                                               "tensor_parallel_degree": 3}), "--world-size", "4")
    assert code == 2 and "(4 problems)" in text and "does not divide" in text, text
    code, text = _cli("translate", '{"pipeline_parallel_degree": 2', "--world-size", "2")
    assert code == 2 and "end the JSON with '}'" in text, text
    code, text = _cli("translate", json.dumps(options), "--world-size", "2", "--explain")
    assert code == 0 and "torch.distributed.pipelining" in text, text[-2000:]
    code, text = _cli("check", str(ROOT / "examples/smp_v1_train.py"))
    assert code == 0 and "verdict: runs as-is" in text, text
    typo = tmp_path / "typo.py"
    typo.write_text((ROOT / "examples/smp_v1_train.py").read_text().replace(".reduce_mean()", ".reduce_meen()"))
    code, text = _cli("check", str(typo))
    assert code == 1 and "did you mean 'reduce_mean'?" in text, text
    code, text = _cli("plan", json.dumps(options), "--model", str(ROOT / "configs/plan/llama2-7b.json"),
                      "--batch-size", "8", "--instance-type", "ml.p4d.24xlarge", "--instance-count", "1")
    assert code == 0 and "step time" in text, text[-2000:]
    code, text = _cli("report", str(tmp_path / "job"))
    assert code == 2 and "rank-logs" in text and "--comm-ledger" in text, text
    code, text = _cli("report", str(tmp_path / "ledger"))
    assert code == 0 and "pp" in text, text
