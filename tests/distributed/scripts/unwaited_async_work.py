"""Ends right after starting asynchronous all-reduces it never waits for and whose tensors only the
operations hold (what a ZeRO-3 prefetch or a dropped reduce-scatter handle leaves at the end of a
script). Before smp-adapter drained and quieted gloo at exit, most runs of this aborted a finished
rank: "terminate called without an active exception", exit status 134."""

import torch
import torch.distributed as dist

import smdistributed.modelparallel.torch as smp

smp.init({"ddp": True})
group = dist.new_group(list(range(smp.size())))  # the script's own group: drained too
for _ in range(8):
    dist.all_reduce(torch.ones(4_000_000), group=group, async_op=True)  # 16 MB each, handle dropped
print(f"rank {smp.rank()} finished its script", flush=True)
