"""smdistributed.modelparallel, as provided by smp-adapter (an open-source stand-in for
SageMaker's model parallelism library v1). ``__version__`` reports the last v1 release whose API
smp-adapter follows, so scripts that check ``>= 1.x`` keep working."""

__version__ = "1.15.0"
ADAPTER = "smp-adapter"

# Ranks on other hosts of a multi-node deepspeed launch get the job's environment as one variable
# (smp_adapter/launch/env_bundle.py): unpacked first, so what follows (and the script) sees it
from smp_adapter.launch.env_bundle import unpack_into as _unpack_job_environment  # noqa: E402

_unpack_job_environment()

# a rank launched by `smp-adapter launch` ends when that process dies, even by SIGKILL (the OOM killer's way):
# no orphaned rank (smp_adapter/launch/rank_watch.py)
from smp_adapter.launch.rank_watch import watch_if_launched as _watch_the_launch_process  # noqa: E402

_watch_the_launch_process()

# NVIDIA apex's names in plain PyTorch where apex is not installed (smp_adapter/compat/apex_fallback): here for
# bare mpirun/torchrun runs of scripts that import smp before apex (smp-adapter launch installs it
# before the script starts); SMP_ADAPTER_APEX_FALLBACK=0 turns it off
from smp_adapter.compat.apex_fallback import install as _install_apex_fallback  # noqa: E402

_install_apex_fallback()

# transformers' PreTrainedModel.init_weights, remembered before a GPT template replaces it (it counts on smp's
# distributed modules to draw the weights): models created for tensor parallelism get it back
# (smp_adapter/compat/hf_skipped_init.py)
from smp_adapter.compat.hf_skipped_init import install as _remember_transformers_init  # noqa: E402

_remember_transformers_init()

# `smp-adapter launch` on a machine without GPUs asks for CUDA on CPU ranks (docs/launch.md): done
# here, at the first smp import, before the script's own torch.cuda calls
from smp_adapter.compat.cuda_on_cpu import install_if_requested as _install_cuda_on_cpu  # noqa: E402

_install_cuda_on_cpu()

# torch's SDPA wrapped once per process (smp_adapter/runtime/attention.py): CPU attention of the dtypes
# whose torch kernel raises on this CPU (probed here) on the math kernel, and from smp.init the backend recorded
from smp_adapter.runtime.attention import install as _install_attention  # noqa: E402

_install_attention()
