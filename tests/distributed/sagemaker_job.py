"""A SageMaker training job on this machine, for SageMaker's own training toolkit to run unchanged.

* ``toolkit_env()``: an environment holding the toolkit, made once and cached: a virtual
  environment layered over the one running the tests (its packages stay visible, so torch,
  DeepSpeed and smp-adapter are the project's own), into which ``docker/install.sh`` (the script the
  Dockerfile runs) installs Open MPI 4, mpi4py, sagemaker-training and sagemaker-pytorch-training.
* ``write_job()``: /opt/ml as SageMaker lays it out for one host (hyperparameters.json written the
  way the SageMaker Python SDK writes an estimator's ``distribution``, resourceconfig.json,
  inputdataconfig.json, the code and a ``train`` channel) in a temporary directory.
* ``run_toolkit()``: the toolkit's ``train`` entry point, as SageMaker's PyTorch images start it
  (SAGEMAKER_TRAINING_MODULE=sagemaker_pytorch_container.training:main), with SAGEMAKER_BASE_DIR
  pointing at that directory.

Container pieces the toolkit takes for granted are given to it in private Linux namespaces (root
only, as a container runtime would): its gethostname shim, LD_PRELOADed into every rank, reads the
hard-coded /opt/ml/input/config/resourceconfig.json, so the job directory is also mounted at /opt/ml;
it starts /usr/sbin/sshd even for one host (it is used only to reach other hosts), so a stand-in
that just waits is put there; ``algo-1`` resolves through /etc/hosts; and a network namespace of
its own keeps SageMaker's fixed MASTER_PORT 7777 (and sshd's 22) from meeting other jobs. A PID
namespace ends everything the job left behind (the toolkit never stops its sshd) when it exits.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = ROOT / "docker/install.sh"
# SageMaker's PyTorch training images set this; the toolkit's `train` imports it and calls main()
TRAINING_MODULE = "sagemaker_pytorch_container.training:main"


def namespaces_unavailable() -> str | None:
    """Why the private namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root for private mount/network namespaces (as a container runtime has)"
    for tool in ("unshare", "mount", "ip"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command (util-linux / iproute2)"
    probe = subprocess.run(["unshare", "--mount", "--net", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here ({probe.stderr.strip()[:200]})"
    return None


def toolkit_env() -> Path:
    """The cached environment with the toolkit (made on first use, under a lock so that parallel
    test workers make it once). Keyed by the install script and the interpreter, so editing
    docker/install.sh makes a new one."""
    key = hashlib.sha256(INSTALL_SCRIPT.read_bytes() + sys.executable.encode() + sys.version.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "smp-adapter"
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / f"sagemaker-toolkit-{key}"
    with open(cache / f"sagemaker-toolkit-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / "ready").exists():
            return venv
        _remove_envs_of_removed_test_envs(cache)
        shutil.rmtree(venv, ignore_errors=True)
        # the base interpreter, not the test venv's python: `venv` refuses to nest otherwise cleanly
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = Path(subprocess.check_output([str(venv / "bin/python"), "-c",
                                             "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
        # the test environment's packages, after the toolkit's own (site.addsitedir also reads its .pth files)
        (site / "_smp_adapter_test_env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        env = {**os.environ, "PYTHON": str(venv / "bin/python"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"docker/install.sh failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        (venv / "ready").write_text(proc.stdout[-2000:])
    return venv


def _remove_envs_of_removed_test_envs(cache: Path) -> None:
    """Each checkout's test environment gets its own toolkit environment (about 250 MB): remove
    those whose test environment is gone (a deleted clone), so the cache does not pile up. One is
    recognised by the site directory its .pth file adds; one that is locked (being made) is left."""
    for pth in cache.glob("sagemaker-toolkit-*/lib/python*/site-packages/_smp_adapter_test_env.pth"):
        match = re.search(r"addsitedir\((['\"])(.+?)\1\)", pth.read_text())
        if match is None or Path(match.group(2)).exists():
            continue
        venv = pth.parents[3]
        with open(venv.with_name(venv.name + ".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(venv, ignore_errors=True)


def sdk_hyperparameters(distribution: dict, program: str, submit_dir: str, instance_type: str,
                        user_hyperparameters: dict) -> dict[str, str]:
    """hyperparameters.json as the SageMaker Python SDK writes it for a PyTorch estimator with
    ``distribution={"smdistributed": {"modelparallel": ...}, "mpi": ...}``: every value JSON-encoded
    into a string, the mpi dict as sagemaker_mpi_*, the smp parameters as ``mp_parameters``; the
    estimator's own hyperparameters first (the SDK adds the distribution's after them)."""
    mpi = distribution["mpi"]
    hp = {
        **user_hyperparameters,
        "sagemaker_program": program,
        "sagemaker_submit_directory": submit_dir,
        "sagemaker_container_log_level": 20,
        "sagemaker_job_name": "smp-adapter-toolkit-test",
        "sagemaker_region": "us-west-2",
        "sagemaker_mpi_enabled": mpi["enabled"],
        "sagemaker_mpi_num_of_processes_per_host": mpi["processes_per_host"],
        "sagemaker_mpi_custom_mpi_options": mpi.get("custom_mpi_options", ""),
        "mp_parameters": distribution["smdistributed"]["modelparallel"]["parameters"],
        "sagemaker_distributed_dataparallel_enabled": False,
        "sagemaker_instance_type": instance_type,
    }
    return {k: json.dumps(v) for k, v in hp.items()}


def write_job(base: Path, distribution: dict, script: Path, hyperparameters: dict, train_data: dict,
              instance_type: str = "ml.p3.16xlarge", hosts: tuple[str, ...] = ("algo-1",), current_host: str = "algo-1",
              network_interface: str = "lo") -> Path:
    """Lay out /opt/ml for ``current_host`` of a job on ``hosts`` under ``base``; returns ``base``. One host:
    its network namespace has only ``lo`` (SageMaker's interface is eth0, which the two-host nodes have)."""
    config = base / "input/config"
    config.mkdir(parents=True)
    code = base / "code"
    code.mkdir()
    shutil.copy(script, code / script.name)
    train = base / "input/data/train"
    train.mkdir(parents=True)
    import torch  # the channel's file, as a user's S3 prefix would hold it

    torch.save(train_data, train / "data.pt")
    (config / "hyperparameters.json").write_text(json.dumps(
        sdk_hyperparameters(distribution, script.name, str(code), instance_type, hyperparameters)))
    (config / "resourceconfig.json").write_text(json.dumps({
        "current_host": current_host, "hosts": list(hosts), "current_group_name": "homogeneousCluster",
        "current_instance_type": instance_type,
        "instance_groups": [{"instance_group_name": "homogeneousCluster", "instance_type": instance_type,
                             "hosts": list(hosts)}],
        "network_interface_name": network_interface}))
    (config / "inputdataconfig.json").write_text(json.dumps({
        "train": {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated", "RecordWrapperType": "None"}}))
    for d in ("model", "output/data"):
        (base / d).mkdir(parents=True, exist_ok=True)
    return base


_CONTAINER = r"""
set -e
ip link set lo up
mount -t overlay smp-opt -o "lowerdir=/opt,upperdir=$NS/opt.up,workdir=$NS/opt.work" /opt
mkdir -p /opt/ml
mount --bind "${SMP_JOB_DIR:-$SAGEMAKER_BASE_DIR}" /opt/ml
mount -t overlay smp-sbin -o "lowerdir=/usr/sbin,upperdir=$NS/sbin.up,workdir=$NS/sbin.work" /usr/sbin
mount --bind "$NS/hosts" /etc/hosts
if [ -n "$SMP_TEST_HOSTS" ]; then
  # a host of several: what else a container has of its own. /tmp (the toolkit's /tmp/done status file) and
  # /root (the image's /root/.ssh: key, client configuration) as overlays whose changes live on a tmpfs;
  # /etc/environment (the worker toolkit appends its environment to it)
  mount -t tmpfs smp-private /mnt
  mkdir -p /mnt/tmp.up /mnt/tmp.work /mnt/root.up /mnt/root.work
  mount -t overlay smp-tmp -o "lowerdir=/tmp,upperdir=/mnt/tmp.up,workdir=/mnt/tmp.work" /tmp
  mount -t overlay smp-root -o "lowerdir=/root,upperdir=/mnt/root.up,workdir=/mnt/root.work" /root
  mkdir -p -m 700 /root/.ssh
  cp "$NS"/ssh/* /root/.ssh/
  mount --bind "$NS/environment" /etc/environment
fi
# /proc of this PID namespace: with the machine's, a process's own pid names another process or none
# (DeepSpeed's CPU accelerator reads psutil.Process() at import: "NoSuchProcess: pid=43" whenever the
# machine had no pid 43); the worker toolkit of a two-host job looks for a process named orted in it
mount -t proc proc /proc
exec "$@"
"""


def run_toolkit(base: Path, venv: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``train`` for the job under ``base``, in its private namespaces; stdout and stderr together."""
    ns = container_dir(base, "127.0.0.1 localhost algo-1\n",
                       "#!/bin/sh\n# stand-in: one host needs no ssh; the toolkit only starts sshd\nexec sleep 86400\n")
    cmd = ["unshare", "--mount", "--propagation", "private", "--net", "--pid", "--fork", "--kill-child",
           "sh", "-c", _CONTAINER, "container", str(venv / "bin/train")]
    return subprocess.run(cmd, env=toolkit_env_vars(base, ns, venv, env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def container_dir(base: Path, hosts: str, sshd: str) -> Path:
    """The container's own files beside ``base``: overlay layers, /etc/hosts, /usr/sbin/sshd (a script)."""
    ns = base.parent / (base.name + ".ns")
    for d in ("opt.up", "opt.work", "sbin.up", "sbin.work"):
        (ns / d).mkdir(parents=True, exist_ok=True)
    (ns / "sbin.up/sshd").write_text(sshd)
    (ns / "sbin.up/sshd").chmod(0o755)
    (ns / "hosts").write_text(hosts)
    return ns


def container_argv(venv: Path) -> list[str]:
    """``train`` in private mount and PID namespaces (the network namespace is the caller's: a node's)."""
    return ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
            "sh", "-c", _CONTAINER, "container", str(venv / "bin/train")]


def toolkit_env_vars(base: Path, ns: Path, venv: Path, env: dict | None = None) -> dict:
    """The environment ``train`` starts with, as a CPU image's container has it."""
    bin_dir = str(venv / "bin")
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "OMPI_", "PMIX_", "RANK", "LOCAL_", "WORLD_"))}
    run_env.update({
        "SAGEMAKER_BASE_DIR": str(base), "SAGEMAKER_TRAINING_MODULE": TRAINING_MODULE, "NS": str(ns),
        "PATH": os.pathsep.join([bin_dir, run_env.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT / "adapter"), run_env.get("PYTHONPATH", "")] if p),
        # what a CPU image would set in its environment (ENV lines of a Dockerfile)
        "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
        **(env or {}),
    })
    run_env.pop("MASTER_ADDR", None)
    run_env.pop("MASTER_PORT", None)
    return run_env


if __name__ == "__main__":  # scripts/test.sh builds the environment beside the unit tier: --prepare
    if sys.argv[1:] == ["--prepare"] and namespaces_unavailable() is None:
        print(f"toolkit environment ready: {toolkit_env()}")
