"""SageMaker's own training toolkit (sagemaker-training + sagemaker-pytorch-training, from PyPI,
unchanged) runs smp v1 jobs on smp-adapter, as it would inside a SageMaker job whose image_uri is
an smp-adapter image (docker/Dockerfile): a simulated /opt/ml for host algo-1, hyperparameters as
the SageMaker SDK writes an estimator's ``distribution`` (seed 001), the toolkit's ``train`` entry
point with SAGEMAKER_TRAINING_MODULE as SageMaker's PyTorch images set it. The toolkit builds its
own mpirun line (Open MPI 4), starts the ranks with ``python -m mpi4py``, and reports the outcome
in /opt/ml/output (success, or failure with the error), classifying errors with the exception
classes it imports from smdistributed.modelparallel.

The toolkit and Open MPI 4 are installed on first use by docker/install.sh (the script the
Dockerfile runs) into a cached environment layered over the test environment (sagemaker_job.py).
One host here; the toolkit's multi-host path (sshd on every host, mpirun over ssh, workers waiting
for `orted`) runs in test_sagemaker_two_hosts.py, on two namespaced nodes algo-1 and algo-2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from launch_util import MAIN, cli_env
from sagemaker_job import ROOT, namespaces_unavailable, run_toolkit, toolkit_env, write_job

from smp_adapter.config.distribution import job_from_mapping
from smp_adapter.launch.sagemaker_toolkit import SAGEMAKER_TOOLKIT

SCRIPT = ROOT / "tests/fixtures/sagemaker_toolkit/train_seed_style.py"
STEPS = 3
# seed 001's tip for EFA instances: harmless here, and it shows custom options reach the ranks
EFA_OPTIONS = "-x FI_EFA_USE_DEVICE_RDMA=1 -x FI_PROVIDER=efa -x RDMAV_FORK_SAFE=1"
# seed 001's own example, which the page itself warns the toolkit's line already carries
SEED_001_OPTIONS = "--mca btl_vader_single_copy_mechanism none"
SDP2 = {"ddp": True, "sharded_data_parallel_degree": 2}
PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}

_UNAVAILABLE = namespaces_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"the toolkit's container setting {_UNAVAILABLE}")


def distribution(parameters: dict, custom_mpi_options: str = EFA_OPTIONS) -> dict:
    """An estimator's distribution argument, as in seed 001 (2 processes per host here)."""
    return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
            "mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": custom_mpi_options}}


def train_data() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(STEPS, 16, 8, generator=g), "y": torch.randint(0, 4, (STEPS, 16), generator=g)}


@pytest.fixture(scope="module")
def toolkit():
    return toolkit_env()


def toolkit_job(tmp_path: Path, name: str, dist: dict, hps: dict) -> Path:
    return write_job(tmp_path / name / "opt_ml", dist, SCRIPT, hps, train_data())


def launch_losses(tmp_path: Path, dist: dict) -> list[list[float]]:
    """Each rank's losses for the same script under `smp-adapter launch` with the same distribution."""
    job = tmp_path / "launch"
    job.mkdir(exist_ok=True)
    (job / "train").mkdir(exist_ok=True)
    torch.save(train_data(), job / "train/data.pt")
    (job / "dist.json").write_text(json.dumps(dist))
    jobdir = job / json.dumps(dist["smdistributed"]["modelparallel"]["parameters"], sort_keys=True).replace('"', "")[:40]
    proc = subprocess.run([sys.executable, "-c", MAIN, "launch", "--launcher", "torchrun", "--cpu", "--distribution",
                           str(job / "dist.json"), "--channel", f"train={job / 'train'}", "--job-dir", str(jobdir),
                           "--hp", f"steps={STEPS}", str(SCRIPT)], cwd=job, env=cli_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((jobdir / f"output/data/rank{r}.json").read_text())["losses"] for r in range(2)]


def invoked_command(output: str) -> list[str]:
    match = re.search(r"Invoking script with the following command:\n\n(.+)\n", output)
    assert match, output[-3000:]
    return match.group(1).split(" ")


def test_toolkit_runs_sdp_and_pp_jobs_with_the_losses_of_smp_adapter_launch(toolkit, tmp_path):
    jobs = {"sdp2": toolkit_job(tmp_path, "sdp2", distribution(SDP2), {"steps": STEPS}),
            "pp2": toolkit_job(tmp_path, "pp2", distribution(PP2), {"steps": STEPS})}
    # the two jobs run side by side: each has its own network namespace (SageMaker's fixed
    # MASTER_PORT 7777 does not collide), and the toolkit's 30 s wait after a successful mpirun
    # (for worker hosts; there are none) then overlaps with the launch references below
    results: dict[str, subprocess.CompletedProcess] = {}
    threads = [threading.Thread(target=lambda n=n, b=b: results.__setitem__(n, run_toolkit(b, toolkit)))
               for n, b in jobs.items()]
    for t in threads:
        t.start()
    expected = {"sdp2": launch_losses(tmp_path, distribution(SDP2)), "pp2": launch_losses(tmp_path, distribution(PP2))}
    for t in threads:
        t.join()
    for name, base in jobs.items():
        proc = results[name]
        assert proc.returncode == 0, proc.stdout[-5000:]
        assert "Reporting training SUCCESS" in proc.stdout
        assert (base / "output/success").exists() and not (base / "output/failure").exists()
        # the job's model, saved by rank 0 with smp.save into SM_MODEL_DIR
        state = torch.load(base / "model/model.pt", weights_only=False)
        assert sum(v.numel() for v in state.values()) == 8 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4
        ranks = [json.loads((base / f"output/data/rank{r}.json").read_text()) for r in range(2)]
        for r, res in enumerate(ranks):
            assert res["rank"] == r and res["size"] == 2 and res["hosts"] == ["algo-1"] and res["current_host"] == "algo-1"
            assert res["rdmav_fork_safe"] == "1"  # custom_mpi_options' -x reached the ranks
        assert (ranks[0]["pp_size"], ranks[0]["dp_size"]) == ((2, 1) if name == "pp2" else (1, 2))
        # same script, data and options: the same arithmetic, whichever launcher started the ranks
        assert [res["losses"] for res in ranks] == expected[name]
        assert len(expected[name][0]) == STEPS
        # the line the toolkit ran is the one `smp-adapter translate` prints for this distribution
        cmd = invoked_command(proc.stdout)
        job = job_from_mapping(distribution(SDP2 if name == "sdp2" else PP2))
        ours = SAGEMAKER_TOOLKIT.command(job, SCRIPT.name, 2, hosts=["algo-1"], hyperparameters={"steps": STEPS},
                                         channels=["train"], network_interface="lo", python=cmd[cmd.index("-m") - 1],
                                         gethostname_shim=next(a[len("LD_PRELOAD="):] for a in cmd
                                                               if a.startswith("LD_PRELOAD=")))
        assert cmd == list(ours.command)


def test_failures_are_reported_as_sagemaker_reports_them(toolkit, tmp_path):
    """A rank raising an smp error, and seed 001's custom_mpi_options (which the toolkit's line
    already carries): non-zero exit, /opt/ml/output/failure with the error, as SageMaker's
    FailureReason shows it (its first 1024 characters)."""
    raising = toolkit_job(tmp_path, "raising", distribution(SDP2), {"steps": STEPS, "fail_rank": 1})
    seed_options = toolkit_job(tmp_path, "seed", distribution(SDP2, SEED_001_OPTIONS), {"steps": STEPS})
    results: dict[str, subprocess.CompletedProcess] = {}
    threads = [threading.Thread(target=lambda n=n, b=b: results.__setitem__(n, run_toolkit(b, toolkit)))
               for n, b in (("raising", raising), ("seed", seed_options))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    proc = results["raising"]
    assert proc.returncode == 1, proc.stdout[-5000:]
    assert "Reporting training FAILURE" in proc.stdout and not (raising / "output/success").exists()
    reason = (raising / "output/failure").read_text()[:1024]
    # the toolkit names the error after the smp exception class it found in the ranks' output
    # (smdistributed.modelparallel.backend.exceptions / .torch.exceptions list it)
    # ExitCode is what mpirun reports: the status of the first rank Open MPI sees end, the raising
    # rank (1) or its partner, whose gloo connection drops and which ends with SIGABRT (128 + 6)
    # when Open MPI notices that one first (seen once in a full-suite run)
    assert re.match(r"UnsupportedFeatureError:\nExitCode (1|134)\n", reason), reason
    assert "DistributedModel.join (uneven inputs) is not supported" in reason
    assert "No exception classes found in smdistributed.modelparallel" not in proc.stdout
    assert not (raising / "model/model.pt").exists()

    proc = results["seed"]
    assert proc.returncode == 1, proc.stdout[-5000:]
    assert "MCA parameters can only be listed once" in proc.stdout  # Open MPI 4, before any rank starts
    assert (seed_options / "output/failure").read_text().startswith("ExecuteUserScriptError:\nExitCode 1\n")
    assert not list((seed_options / "output/data").glob("rank*.json"))


def _layered_env(base_purelib: str, where: Path) -> Path:
    """A new environment that sees this test environment's packages (torch included) after its own, as
    a PyTorch image's Python is seen by the image's install step; pip installs into the new one."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = Path(subprocess.check_output([str(where / "bin/python"), "-c",
                                         "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (site / "_base_image.pth").write_text(f"import site; site.addsitedir({(base_purelib or sysconfig.get_paths()['purelib'])!r})\n")
    return where / "bin/python"


def _torch_of(python: Path) -> list[str]:
    return subprocess.check_output([str(python), "-c", "import torch; print(torch.__version__); print(torch.__file__)"],
                                   text=True).split()


def _project_copy(where: Path, torch_requirement: str | None = None) -> Path:
    """The files `pip install` of the project reads (built out of the clone, which it leaves untouched)."""
    import shutil

    shutil.copytree(ROOT / "adapter", where / "adapter", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "README.md", where / "README.md")
    pyproject = (ROOT / "pyproject.toml").read_text()
    if torch_requirement is not None:
        pyproject = re.sub(r'"torch[^"]*"', f'"{torch_requirement}"', pyproject, count=1)
    (where / "pyproject.toml").write_text(pyproject)
    return where


def test_image_install_step_keeps_the_base_torch(tmp_path):
    """docker/install.sh --adapter (the Dockerfile's smp-adapter step) into an environment whose torch
    is this test environment's (in the support matrix: the lowest torch, a CUDA build): smp-adapter
    installs and the environment's torch is the same release from the same place. A project whose
    torch range excludes that torch stops with pip's ResolutionImpossible naming torch instead of
    replacing it (without the step's torch constraint, -c "$KEEP_TORCH", pip would fetch another torch
    release of several GB there; that mutation has not been run)."""
    import sysconfig

    base = sysconfig.get_paths()["purelib"]
    before = _torch_of(Path(sys.executable))
    python = _layered_env(base, tmp_path / "image")
    env = {**os.environ, "PYTHON": str(python), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env["SMP_ADAPTER_SRC"] = str(_project_copy(tmp_path / "src"))
    proc = subprocess.run(["bash", str(ROOT / "docker/install.sh"), "--adapter"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Successfully installed smp-adapter" in proc.stdout, proc.stdout[-3000:]
    assert _torch_of(python) == before
    installed = subprocess.check_output([str(python), "-c", "import smp_adapter; print(smp_adapter.__file__)"], text=True)
    assert installed.startswith(str(tmp_path / "image")), installed

    newer = before[0].split("+")[0]
    env["SMP_ADAPTER_SRC"] = str(_project_copy(tmp_path / "src_excluding", f"torch>{newer}"))
    proc = subprocess.run(["bash", str(ROOT / "docker/install.sh"), "--adapter"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "ResolutionImpossible" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    assert f"torch>{newer}" in proc.stdout + proc.stderr
    assert _torch_of(python) == before
