"""CUDA on CPU ranks (smp_adapter/compat/cuda_on_cpu.py), in a fresh interpreter each time: the
shim changes torch for the whole process."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT_SIDE = """
import json, time, torch
import smdistributed.modelparallel.torch as smp
from torch.cuda.amp import autocast

# a library's view: code whose module name is deepspeed.* gets the real answers
library = {"__name__": "deepspeed.fake_probe"}
exec("import torch\\nanswer = (torch.cuda.is_available(), torch.cuda.device_count())", library)

out = {"available": torch.cuda.is_available(), "count": torch.cuda.device_count(), "library": library["answer"]}
torch.cuda.set_device(1)
out["current"] = torch.cuda.current_device()
device = torch.device("cuda", smp.local_rank() if smp.is_initialized() else 0)
x = torch.ones(2, 3).to(device)
out["to"] = str(x.device)
out["factory"] = str(torch.zeros(2, device="cuda:1").device)
out["cuda"] = str(torch.ones(1).cuda().device)
layer = torch.nn.Linear(3, 3).cuda()
out["module"] = str(layer.weight.device)
out["module_to"] = str(torch.nn.Linear(3, 3).to("cuda").weight.device)
torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
out["memory"] = [torch.cuda.memory_allocated() > 0, torch.cuda.max_memory_allocated(device=0) > 0,
                 torch.cuda.get_device_properties(0).total_memory > 0, torch.cuda.mem_get_info()[1] > 0]
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); time.sleep(0.01); end.record(); end.synchronize()
out["elapsed_ms"] = start.elapsed_time(end)
with autocast(True):
    out["autocast_dtype"] = str(layer(x).dtype)
scaler = torch.cuda.amp.GradScaler()
out["scaled"] = scaler.scale(torch.tensor(1.0)).item()
out["legacy_type"] = isinstance(torch.cuda.FloatTensor([1.0]), torch.cuda.FloatTensor)
# a move to the GPU copies: a strided slice arrives contiguous, a dense transposed matrix keeps its strides
rows = torch.arange(24).view(6, 4)
every_other, transposed = rows[0::2], rows.t()
moved, moved_t = every_other.to(device), transposed.cuda()
out["moved"] = [moved.is_contiguous(), torch.equal(moved, every_other), moved.data_ptr() != rows.data_ptr(),
                list(moved_t.stride()) == list(transposed.stride()), torch.equal(moved_t, transposed),
                x.to(device) is x]
print("RESULT " + json.dumps(out))
"""


def _run(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SMP_ADAPTER_CUDA_ON_CPU"}
    env.update({"PYTHONPATH": str(ROOT / "adapter"), "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu",
                "LOCAL_WORLD_SIZE": "4", **env_extra})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def _result(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_gpu_calls_of_a_script_run_on_the_cpu():
    out = _result(_run(SCRIPT_SIDE, {"SMP_ADAPTER_CUDA_ON_CPU": "1"}))
    assert (out["available"], out["count"], out["current"]) == (True, 4, 1)  # one GPU per local rank
    assert out["library"] == [False, 0]  # DeepSpeed & co. keep seeing the CPU machine
    assert {out[k] for k in ("to", "factory", "cuda", "module", "module_to")} == {"cpu"}
    assert out["memory"] == [True, True, True, True]
    assert 5.0 <= out["elapsed_ms"] < 5000.0
    assert out["autocast_dtype"] == "torch.bfloat16"  # torch.cuda.amp.autocast -> CPU autocast
    assert out["scaled"] == 65536.0 and out["legacy_type"] is True
    assert out["moved"] == [True, True, True, True, True, True]  # as a copy to a GPU (contiguous: no copy)


def test_not_installed_unless_asked():
    proc = _run("""
        import torch
        import smdistributed.modelparallel.torch as smp
        from smp_adapter.compat import cuda_on_cpu
        print("RESULT", __import__("json").dumps([torch.cuda.is_available(), cuda_on_cpu._installed]))
    """, {})
    assert _result(proc) == [False, False]


def test_without_the_shim_the_script_fails_as_on_a_cpu_machine():
    """What the shim prevents: the first CUDA call of the script dies (a CPU build of torch has no CUDA
    bindings; a CUDA build, as the support matrix's torch points install, finds no driver)."""
    proc = _run(SCRIPT_SIDE, {"SMP_ADAPTER_CUDA_ON_CPU": "0"})
    assert proc.returncode != 0
    assert ("module 'torch._C' has no attribute '_cuda_setDevice'" in proc.stderr
            or "Found no NVIDIA driver on your system" in proc.stderr), proc.stderr[-2000:]


CUDA_INSIDE_THE_STEP = """
import json, torch
import smdistributed.modelparallel.torch as smp


class Net(torch.nn.Module):
    '''Hard-codes its device inside forward, as GPU model code does; device=None is the reference.'''

    def __init__(self, device):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head, self.device = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16), device

    def forward(self, ids):
        where = self.device or "cpu"
        positions = torch.arange(ids.shape[1], device=where)  # a factory with device="cuda"
        bias = torch.zeros(8, device=torch.device(where, 0) if self.device else where)
        h = self.embed(ids) + positions[None, :, None].float() * 0.01 + bias
        h = h + h.new_ones(h.shape, device=where) * 0.1
        with torch.autocast(where, dtype=torch.bfloat16):  # autocast("cuda") inside the step
            logits = self.head(h)
        return logits.float().to(where)


def run(device, use_smp):
    model = Net(device)
    ids = torch.arange(32).view(4, 8) % 16
    if not use_smp:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]
    smp.init({"microbatches": 1})
    model = smp.DistributedModel(model.to(torch.device("cuda", 1)))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, ids):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        model.backward(loss)
        return loss

    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        losses.append(train_step(model, ids.to("cuda")).reduce_mean().item())
        optimizer.step()
    return losses, [p.detach().clone() for p in model.parameters()]


got, got_params = run("cuda", True)
want, want_params = run(None, False)
torch.save({"w": torch.ones(2)}, "ckpt.pt")
print("RESULT " + json.dumps({
    "got": got, "want": want,
    "params": max((a - b).abs().max().item() for a, b in zip(got_params, want_params)),
    "load": str(torch.load("ckpt.pt", map_location=torch.device("cuda", 1))["w"].device),
    "load_str": str(torch.load("ckpt.pt", map_location="cuda:0")["w"].device),
    "modes": len(torch.overrides._get_current_function_mode_stack()),
    "add_untouched": torch.add is torch._C._VariableFunctions.add}))
"""


def test_cuda_tensors_created_inside_the_step_and_no_per_call_cost(tmp_path):
    """A model whose forward hard-codes device="cuda" (factories, new_ones, .to, autocast("cuda"))
    trains inside @smp.step as the same model on the CPU does without smp; and no torch call outside
    the wrapped device-taking ones goes through Python (no TorchFunctionMode, torch.add is torch's).
    Tolerance: the same float ops in one process; only the engine's gradient path differs (1e-6)."""
    proc = subprocess.run([sys.executable, "-c", CUDA_INSIDE_THE_STEP], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**{k: v for k, v in os.environ.items() if k not in _RANK_ENV},
                                             "PYTHONPATH": str(ROOT / "adapter"), "CUDA_VISIBLE_DEVICES": "",
                                             "DS_ACCELERATOR": "cpu", "SMP_ADAPTER_CUDA_ON_CPU": "1"})
    out = _result(proc)
    assert all(abs(g - w) <= 1e-6 * abs(w) for g, w in zip(out["got"], out["want"])), out
    assert out["got"][1] < out["got"][0] and out["params"] < 1e-6, out
    assert out["load"] == out["load_str"] == "cpu"
    assert out["modes"] == 0 and out["add_untouched"] is True


_RANK_ENV = ("SM_HP_MP_PARAMETERS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT",
             "MASTER_ADDR", "OMPI_COMM_WORLD_RANK")


def test_every_torch_call_that_takes_a_device_is_wrapped():
    """The wrapped calls are the ones whose aten schema has a device argument: a torch that adds one
    fails here until cuda_on_cpu.py lists it (wrapped, or _NOT_WRAPPED with its reason)."""
    import torch

    from smp_adapter.compat import cuda_on_cpu

    listed = {*cuda_on_cpu._FACTORIES, *cuda_on_cpu._TENSOR_FACTORIES, *cuda_on_cpu._NOT_WRAPPED, "to"}
    taking = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas()
              if s.name.startswith("aten::") and any(a.name == "device" for a in s.arguments)}
    public = {n for n in taking if not n.startswith("_") and (hasattr(torch, n) or hasattr(torch.Tensor, n))}
    assert public - listed == set()
    assert {f"fft_{n}" for n in cuda_on_cpu._FFT_FACTORIES} <= taking
