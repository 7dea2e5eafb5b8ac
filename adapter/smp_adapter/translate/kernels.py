"""smp v1's kernel switches and what each becomes: the one home of their wording and of the adapter
setting that compiles a model's blocks. Pure (no torch): ``translate --explain``, ``smp-adapter check``,
the runtime's warnings (runtime/memory.py) and docs/runtime.md's table all say what is written here.

smp v1 scripts ask for fused kernels by name (smp-api.md §2.10-2.12): ``smp.model_creation(...,
flash_attention=, fused_softmax=, fused_bias_gelu=, fused_dropout=)``, ``smp.nn.FlashAttentionLayer``,
``smp.nn.FusedLayerNorm``, ``smp.optimizers.FusedAdam`` / ``FusedLAMB`` / ``FusedNovoGrad``. smp's own
kernels were apex's and its Triton/CUDA extensions; smp-adapter carries each out with the fastest
correct kernel the installed torch has (runtime/kernel_switches.py and runtime/attention.py do it; the
optimizers: compat/fused_optimizers.py), and says where it cannot.

The compile setting ``SMP_ADAPTER_COMPILE`` (an environment variable of the launching shell, like
``SMP_ADAPTER_SDP_ENGINE``; not an smp key): ``off`` (default) or ``blocks`` (``blocks:<backend>`` names
a torch.compile backend; inductor otherwise). ``blocks`` compiles each repeated block of the model (every
parameter-holding element of an ``nn.ModuleList``, the units MiCS shards) with ``torch.compile`` on its
own, as torchtitan does: one small graph compiled once and reused by every layer, the gathers and hooks
of the engine staying outside it. Off by default: it has not been measured on a GPU yet (issue 52), and
compiling costs tens of seconds at the first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from smp_adapter.config.problems import ConfigProblem, raise_if_any

COMPILE_ENV = "SMP_ADAPTER_COMPILE"
COMPILE_MODES = ("off", "blocks")
DEFAULT_COMPILE_BACKEND = "inductor"


@dataclass(frozen=True)
class CompileSetting:
    mode: str = "off"  # COMPILE_MODES
    backend: str = DEFAULT_COMPILE_BACKEND

    @property
    def on(self) -> bool:
        return self.mode == "blocks"

    def __str__(self) -> str:
        return "off" if not self.on else "blocks" if self.backend == DEFAULT_COMPILE_BACKEND else f"blocks:{self.backend}"


def compile_setting_from(environ: Mapping[str, str]) -> CompileSetting:
    """The SMP_ADAPTER_COMPILE setting of ``environ`` (off when unset); a bad value is refused."""
    raw = environ.get(COMPILE_ENV, "").strip()
    mode, _, backend = raw.partition(":")
    mode = mode.lower() or "off"
    if mode not in COMPILE_MODES or (backend and mode != "blocks") or (_ and not backend):
        raise_if_any([ConfigProblem(COMPILE_ENV, f"must be one of {', '.join(COMPILE_MODES)} (or blocks:<backend>)",
                                    f"set {COMPILE_ENV}=blocks (torch.compile per transformer block, inductor) or "
                                    f"{COMPILE_ENV}=off, or unset it", raw)])
    return CompileSetting(mode, backend or DEFAULT_COMPILE_BACKEND)


def compile_refusal(dims) -> str | None:
    """Why ``SMP_ADAPTER_COMPILE=blocks`` cannot run on this layout (``dims``: a ParallelDims), with
    what to use instead; None where it runs. Refused where it has not been shown to train the same
    numbers: each refusal names the reason."""
    if dims.pp > 1:
        return (f"{COMPILE_ENV}=blocks with pipeline_parallel_degree {dims.pp}: pipeline stages are cut from an "
                f"exported graph of the whole model (torch.export), which a compiled block cannot enter; unset "
                f"{COMPILE_ENV} (or {COMPILE_ENV}=off) for pipeline jobs")
    if dims.tp > 1:
        return (f"{COMPILE_ENV}=blocks with tensor_parallel_degree {dims.tp}: the Megatron-core layers' collectives "
                f"inside each block are not traced by torch.compile here (untested: graph breaks at every split "
                f"layer); unset {COMPILE_ENV} for tensor-parallel jobs, or use sharded data parallelism instead")
    if dims.engine == "deepspeed" and dims.zero_stage == 3:
        return (f"{COMPILE_ENV}=blocks with DeepSpeed ZeRO-3 (sharded_data_parallel_degree = rdp size {dims.rdp}): "
                f"ZeRO-3 gathers each layer's parameters in hooks inside the block, where torch.compile breaks the "
                f"graph at every layer; use sharded_data_parallel_degree < rdp size (MiCS on FSDP2, whose gathers "
                f"stay outside each compiled block), shard_optimizer_state (ZeRO-1), or unset {COMPILE_ENV}")
    return None


@dataclass(frozen=True)
class Switch:
    name: str  # as a script writes it
    cuda: str  # what it becomes on a CUDA device
    cpu: str  # what it becomes on CPU ranks
    carried_out: bool = True  # False: accepted, not carried out unless SMP_ADAPTER_COMPILE=blocks

    def note(self) -> str:
        return f"CUDA and CPU: {self.cuda}" if self.cuda == self.cpu else f"CUDA: {self.cuda}; CPU: {self.cpu}"


_SDPA = ("torch scaled_dot_product_attention; the backend that ran (flash, efficient, cudnn or math) is "
         "recorded and said once on rank 0")
_COMPILED = f"fused by inductor with {COMPILE_ENV}=blocks (off by default: then not carried out)"
SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("model_creation(flash_attention=)",
           "Hugging Face attention switched to 'sdpa' (flash / memory-efficient kernel); " + _SDPA,
           "the same switch; SDPA's CPU flash kernel or math (numerics as eager attention within the dtype's "
           "rounding)"),
    Switch("model_creation(fused_softmax=)",
           "the softmax runs inside SDPA's fused attention kernel: eager Hugging Face attention switched "
           "to 'sdpa', as for flash_attention (torch has no fused softmax outside it)",
           "the same switch; SDPA's CPU kernel"),
    Switch("model_creation(fused_bias_gelu=)", _COMPILED, _COMPILED, carried_out=False),
    Switch("model_creation(fused_dropout=)", _COMPILED, _COMPILED, carried_out=False),
    Switch("nn.FlashAttentionLayer", _SDPA, "SDPA's CPU flash kernel or math; use_alibi is refused"),
    Switch("nn.FusedLayerNorm",
           "torch's layer_norm: one fused CUDA kernel per call (forward and backward), as apex's",
           "torch's CPU layer_norm kernel"),
    Switch("optimizers.FusedAdam",
           "torch AdamW (Adam with adam_w_mode=False) with fused=True: one kernel for all parameters",
           "torch AdamW's default implementation (its fused CPU kernel is not chosen: the switch is for CUDA, "
           "where torch's own default is foreach)"),
    Switch("optimizers.FusedLAMB",
           "apex LAMB's update on torch's multi-tensor _foreach ops (torch has no fused LAMB): a few kernels "
           "per parameter group and step", "the same code"),
    Switch("optimizers.FusedNovoGrad",
           "apex NovoGrad's update on torch's multi-tensor _foreach ops (torch has no fused NovoGrad); the "
           "per-layer division one op per tensor", "the same code"),
    Switch("torch.optim.AdamW / Adam",
           "fused=True when every parameter is a floating CUDA tensor and the script chose neither fused nor "
           "foreach (torch's own default there is foreach); the same update within float32 rounding",
           "left as the script built it"),
    Switch(COMPILE_ENV,
           "off by default; blocks: torch.compile of each repeated block (inductor), refused by name with "
           "pipeline or tensor parallelism and DeepSpeed ZeRO-3",
           "the same (inductor needs a C++ compiler; compiling takes tens of seconds)"),
)}


def model_creation_switch(keyword: str) -> Switch | None:
    return SWITCHES.get(f"model_creation({keyword}=)")


def explain_rows(dims, setting: CompileSetting) -> list[tuple]:
    """(key, value, engine key, engine value, status, note) rows for ``translate --explain``: the compile
    setting on this layout, then what each kernel switch a script may use becomes."""
    refusal = compile_refusal(dims) if setting.on else None
    compiled = setting.on and not refusal
    rows = [(f"(adapter) {COMPILE_ENV}", str(setting), "torch.compile per repeated block",
             "refused" if refusal else str(setting),
             "refused" if refusal else "exact" if setting.on else "default",
             refusal or (f"blocks compiled with backend {setting.backend}" if setting.on else
                         "off (default); blocks: torch.compile of each transformer block, as torchtitan"))]
    for s in SWITCHES.values():
        if s.name != COMPILE_ENV:
            status = "exact" if s.carried_out or compiled else "ignored"
            rows.append((f"(kernel) {s.name}", "-", "kernel", "see note", status, s.note()))
    return rows
