"""What SageMaker's training toolkit runs for an smp v1 estimator ``distribution`` (pure; runs nothing).

The line is the one sagemaker-training 5.1.x (``sagemaker_training.mpi.MasterRunner``) builds on the
leader host, started through SageMaker's PyTorch layer (sagemaker-pytorch-training 3.0.x, which
sets ``SM_DLC_TORCH_VERSION`` and so the model-parallel NCCL flags). tests/distributed/
test_sagemaker_toolkit.py runs the real toolkit and checks that it runs exactly this line.

  mpirun --host algo-1:N,... -np <hosts x N> --allow-run-as-root --display-map --tag-output
    -mca btl_tcp_if_include IF -mca oob_tcp_if_include IF -mca plm_rsh_no_tree_spawn 1
    -bind-to none -map-by slot -mca pml ob1 -mca btl ^openib -mca orte_abort_on_non_zero_status 1
    -mca btl_vader_single_copy_mechanism none -x NCCL_MIN_NRINGS=4 -x NCCL_SOCKET_IFNAME=IF
    -x NCCL_DEBUG=<--NCCL_DEBUG of custom_mpi_options, else INFO> -x LD_LIBRARY_PATH -x PATH
    -x LD_PRELOAD=<the toolkit's gethostname shim>  <custom_mpi_options, less --NCCL_DEBUG>
    [EFA flags by instance type] -x SM_... (every training variable) -x PYTHONPATH
    -x NCCL_PROTO=simple [-x NCCL_ALGO=ring: torch >= 2]  python -m mpi4py SCRIPT <hyperparameters>

(``-x NAME`` for AWS credentials in the toolkit's environment and the ``smddpmprun`` prefix, present
only where SageMaker's data-parallel library is installed, are left out.) What it needs from the
image: Open MPI 4 (``-bind-to`` with one dash is read as the program name by Open MPI 5's
prterun, and worker hosts wait for an ``orted`` process), mpi4py, and /usr/sbin/sshd.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence

from smp_adapter.config.distribution import JobSpec
from smp_adapter.launch.launchers import BASE_MCA

TOOLKIT = "sagemaker-training 5.1.x with sagemaker-pytorch-training 3.0.x"
# the toolkit's own lists (sagemaker_training/__init__.py)
EFA_NCCL_INSTANCES = ("ml.g4dn.8xlarge", "ml.g4dn.12xlarge", "ml.g5.48xlarge", "ml.p3dn.24xlarge", "ml.p4d.24xlarge",
                      "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.trn1.32xlarge", "ml.p6e-gb200.36xlarge")
EFA_RDMA_INSTANCES = ("ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.trn1.32xlarge",
                      "ml.p6e-gb200.36xlarge")
# the training variables the toolkit exports with -x, in its order (Environment.to_env_vars)
TRAINING_VARIABLES = (
    "SM_HOSTS", "SM_NETWORK_INTERFACE_NAME", "SM_HPS", "SM_USER_ENTRY_POINT", "SM_FRAMEWORK_PARAMS",
    "SM_RESOURCE_CONFIG", "SM_INPUT_DATA_CONFIG", "SM_OUTPUT_DATA_DIR", "SM_CHANNELS", "SM_CURRENT_HOST",
    "SM_CURRENT_INSTANCE_TYPE", "SM_CURRENT_INSTANCE_GROUP", "SM_CURRENT_INSTANCE_GROUP_HOSTS", "SM_INSTANCE_GROUPS",
    "SM_INSTANCE_GROUPS_DICT", "SM_DISTRIBUTION_INSTANCE_GROUPS", "SM_IS_HETERO", "SM_MODULE_NAME", "SM_LOG_LEVEL",
    "SM_FRAMEWORK_MODULE", "SM_INPUT_DIR", "SM_INPUT_CONFIG_DIR", "SM_OUTPUT_DIR", "SM_NUM_CPUS", "SM_NUM_GPUS",
    "SM_NUM_NEURONS", "SM_MODEL_DIR", "SM_MODULE_DIR", "SM_TRAINING_ENV", "SM_USER_ARGS", "SM_OUTPUT_INTERMEDIATE_DIR")
GETHOSTNAME_SHIM = "<site-packages>/gethostname.cpython-<version>.so"


@dataclass(frozen=True)
class ToolkitCommand:
    command: tuple[str, ...]
    notes: tuple[str, ...]

    def shell(self) -> str:
        return SAGEMAKER_TOOLKIT.shell({}, self.command)


def _hp_value(value) -> str:
    """A hyperparameter on the toolkit's command line (sagemaker_training.mapping.to_cmd_args)."""
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return value if isinstance(value, str) else str(value)


class SageMakerToolkit:
    """The toolkit's mpirun, which SageMaker runs on the leader host: translate shows its line beside the
    four smp-adapter launch runs (launch/launchers.py); the training variables reach the ranks by ``-x``.
    Not a ``Launcher``: smp-adapter never runs this line, it only prints it."""

    name = "sagemaker-toolkit"

    def shell(self, env: Mapping[str, str], command: Sequence[str]) -> str:
        """The line as a shell runs it (the toolkit's line holds no ${NODE_RANK} for the shell to expand)."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *(shlex.quote(a) for a in command)])

    def command(self, job: JobSpec, script: str, nprocs_per_host: int, hosts: Sequence[str] | None = None,
                hyperparameters: Mapping[str, object] | None = None, channels: Sequence[str] = (),
                instance_type: str = "ml.p3.16xlarge", network_interface: str = "eth0", python: str = "python",
                gethostname_shim: str = GETHOSTNAME_SHIM, torch_major: int = 2) -> ToolkitCommand:
        """The toolkit's mpirun line for ``job``. ``hyperparameters`` are the estimator's own (not the
        sagemaker_* ones); ``mp_parameters`` is added as SageMaker adds it. ``hosts`` default to
        algo-1..algo-<instance_count>."""
        hosts = list(hosts) if hosts else [f"algo-{i + 1}" for i in range(job.instance_count)]
        hps = dict(hyperparameters or {})
        if job.options:
            hps["mp_parameters"] = dict(job.options)
        # the toolkit reads custom_mpi_options with argparse: --NCCL_DEBUG is its own, the rest is passed on
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--NCCL_DEBUG", default="INFO", type=str)
        known, extra = parser.parse_known_args(job.custom_mpi_options.split())
        host_list = hosts if nprocs_per_host == 1 else [f"{h}:{nprocs_per_host}" for h in hosts]
        cmd = ["mpirun", "--host", ",".join(host_list), "-np", str(nprocs_per_host * len(hosts)), "--allow-run-as-root",
               "--display-map", "--tag-output", "-mca", "btl_tcp_if_include", network_interface,
               "-mca", "oob_tcp_if_include", network_interface, "-mca", "plm_rsh_no_tree_spawn", "1",
               "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib",
               "-mca", "orte_abort_on_non_zero_status", "1", "-mca", "btl_vader_single_copy_mechanism", "none",
               "-x", "NCCL_MIN_NRINGS=4", "-x", f"NCCL_SOCKET_IFNAME={network_interface}",
               "-x", f"NCCL_DEBUG={known.NCCL_DEBUG}",
               "-x", "LD_LIBRARY_PATH", "-x", "PATH", "-x", f"LD_PRELOAD={gethostname_shim}", *extra]
        if instance_type in EFA_NCCL_INSTANCES:
            cmd += ["-x", "FI_PROVIDER=efa", "-x", "NCCL_PROTO=simple"]
        if instance_type in EFA_RDMA_INSTANCES:
            cmd += ["-x", "FI_EFA_USE_DEVICE_RDMA=1"]
        names = [*TRAINING_VARIABLES, *(f"SM_CHANNEL_{c.upper()}" for c in channels),
                 *(f"SM_HP_{k.upper()}" for k in hps), "PYTHONPATH"]
        for name in names:
            cmd += ["-x", name]
        if job.options:  # model parallel: SM_HP_MP_PARAMETERS is set and not {}
            cmd += ["-x", "NCCL_PROTO=simple"] + (["-x", "NCCL_ALGO=ring"] if torch_major > 1 else [])
        cmd += [python, "-m", "mpi4py", script]
        for key in sorted(hps):
            cmd += [f"--{key}" if len(key) > 1 else f"-{key}", _hp_value(hps[key])]
        return ToolkitCommand(tuple(cmd), tuple(_notes(extra)))


SAGEMAKER_TOOLKIT = SageMakerToolkit()


def _notes(extra: Sequence[str]) -> list[str]:
    notes = [f"needs Open MPI 4 in the image ({TOOLKIT} writes -bind-to/-map-by with one dash, which Open MPI 5 "
             "reads as the program name), mpi4py, and /usr/sbin/sshd (started on every host)"]
    base = {name for name, _ in BASE_MCA} | {"btl_tcp_if_include", "oob_tcp_if_include"}
    for i, flag in enumerate(extra[:-1]):
        if flag in ("-mca", "--mca") and extra[i + 1] in base:
            notes.append(f"custom_mpi_options repeats the MCA parameter {extra[i + 1]}, already on the toolkit's line: "
                         "Open MPI 4 refuses to start ('MCA parameters can only be listed once'), so the job fails "
                         f"before any rank runs; remove '{flag} {extra[i + 1]} ...' from custom_mpi_options")
    return notes
