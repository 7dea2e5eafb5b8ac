"""Run by scripts/gpu_device_run.sh on a GPU machine: the versions there (its image's torch may be older than
the 2.13 this project pins), whether the torch pipelining names the runtime uses exist, and an import of
every smp_adapter / smdistributed module. Prints, never raises."""
import importlib, importlib.metadata as md, pkgutil, sys, time, traceback
t0 = time.time()
print("python", sys.version.split()[0], sys.executable)
for n in ("torch", "transformers", "deepspeed", "megatron-core", "pydantic", "pydantic_core", "typing_extensions",
          "packaging", "numpy", "xxhash", "hjson", "accelerate", "safetensors", "huggingface_hub", "ninja", "psutil",
          "py-cpuinfo", "msgpack", "einops", "tqdm", "pytest", "pytest-timeout", "nvidia-ml-py", "triton"):
    try:
        d = md.distribution(n)
        print(f"dist {n:18} {d.version:14} {d.locate_file('')}")
    except Exception as e:
        print(f"dist {n:18} MISSING ({type(e).__name__})")
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "count", torch.cuda.device_count())
import torch.distributed as dist
import torch.distributed.pipelining as P
import torch.distributed.pipelining.schedules as S
for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
             "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "_ScheduleForwardOnly", "_PipelineScheduleRuntime",
             "_Action", "FORWARD", "_add_send_recv", "_add_unshard_reshard"):
    print(f"pipelining.schedules.{name}: {hasattr(S, name)}")
print("pipelining.pipeline/SplitPoint:", hasattr(P, "pipeline"), hasattr(P, "SplitPoint"))
try:
    from torch.distributed.pipelining.stage import build_stage  # noqa: F401 - whether it exists
    print("pipelining.stage.build_stage: True")
except Exception as e:
    print("pipelining.stage.build_stage: FAIL", e)
print("torch.compiler.is_exporting:", hasattr(torch.compiler, "is_exporting"),
      "dist.all_gather_single:", hasattr(dist, "all_gather_single"),
      "dist.all_gather_into_tensor:", hasattr(dist, "all_gather_into_tensor"))
try:
    from deepspeed.accelerator import get_accelerator
    print("deepspeed accelerator:", get_accelerator()._name)
except Exception:
    traceback.print_exc()
bad = 0
for pkg in ("smp_adapter", "smdistributed"):
    try:
        root = importlib.import_module(pkg)
    except Exception:
        print("IMPORT FAIL", pkg); traceback.print_exc(limit=3); bad += 1; continue
    for m in pkgutil.walk_packages(root.__path__, pkg + "."):
        try:
            importlib.import_module(m.name)
        except Exception as e:
            bad += 1
            print("IMPORT FAIL", m.name, type(e).__name__, str(e)[:300])
print(f"module import failures: {bad}; probe {time.time() - t0:.1f}s")
