"""Delayed parameter initialisation under sharded data parallel, then a full-state-dict load (the
fine-tune pattern: create under smp.model_creation(), wrap, model.load_state_dict(smp.load(...))).
Reports, per rank, the dtype of every parameter shard and whether the gathered parameters equal the
file bitwise.

``--accelerator-without-fp16`` makes DeepSpeed's accelerator answer ``is_fp16_supported()`` as it
does on CPUs without AVX512-FP16/AMX (e.g. AMD EPYC): ``None``. That answer used to turn every fp32
parameter created under zero.Init into bfloat16 (runtime/engines/deepspeed/groups.py says why), so
the test reproduces such a machine on any machine."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import tiny_vit  # noqa: E402
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--init-weights", required=True)
parser.add_argument("--accelerator-without-fp16", action="store_true")
args = parser.parse_args()

if args.accelerator_without_fp16:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: None  # the singleton every DeepSpeed module asks

smp.init({"ddp": True})
with smp.model_creation():
    model = tiny_vit()
model = smp.DistributedModel(model)
created_dtypes = sorted({str(p.ds_tensor.dtype) for p in model.parameters()})
expected = torch.load(args.init_weights, weights_only=True)
model.load_state_dict(smp.load(args.init_weights, partial=False))
shard_dtypes = sorted({str(p.ds_tensor.dtype) for p in model.parameters()})
gathered = model.state_dict()  # collective under ZeRO-3: every rank gathers
differing = [name for name, value in expected.items()
             if gathered[name].dtype != value.dtype or not torch.equal(gathered[name], value)]
write_result({"zero_stage": 3 if all(hasattr(p, "ds_id") for p in model.parameters()) else 0,
              "created_dtypes": created_dtypes, "shard_dtypes": shard_dtypes,
              "gathered_dtypes": sorted({str(v.dtype) for v in gathered.values()}),
              "differing": differing, "compared": len(expected)})
smp.barrier()
