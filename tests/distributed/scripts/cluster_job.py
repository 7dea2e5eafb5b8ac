"""A small job for the namespaced-cluster tests (test_cluster.py): every step one gloo all-reduce of --numel
floats among all ranks, nothing heavy (torch.distributed, and the smp import every smp v1 script starts with,
which also starts the rank's watch on its launch process). What a drill needs: a rank that raises at a step,
a rank that spends seconds without any collective (a long checkpoint save), a file written when training
runs (so a test knows when to cut a link), and a run until killed. Each rank writes
$SMP_TEST_OUT/rank<R>.json at the end: its sums, MASTER_ADDR, the host it was told it is on."""

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import smdistributed.modelparallel.torch  # noqa: F401  (the first import of every smp v1 script)
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5, help="0: until killed")
parser.add_argument("--numel", type=int, default=1 << 16)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--raise-rank", type=int, default=-1)
parser.add_argument("--raise-at-step", type=int, default=1)
parser.add_argument("--busy-rank", type=int, default=-1, help="this rank spends --busy-s without a collective")
parser.add_argument("--busy-at-step", type=int, default=1)
parser.add_argument("--busy-s", type=float, default=0.0)
parser.add_argument("--ready-file", default=None, help="written by each rank after its first step (<file>.<rank>)")
args, _ = parser.parse_known_args()

if "RANK" not in os.environ:  # started by srun or mpirun, not torchrun: smp.init's rules (launch/rank_env.py)
    from smp_adapter.launch.rank_env import LaunchEnv, rendezvous

    started = LaunchEnv.from_environ(os.environ)
    addr, port = rendezvous(started, None, os.environ, lambda: 0)
    os.environ.update(RANK=str(started.rank), WORLD_SIZE=str(started.world_size), LOCAL_RANK=str(started.local_rank),
                      MASTER_ADDR=addr, MASTER_PORT=str(port))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("SMP_ADAPTER_TIMEOUT", 600))))
rank, world = dist.get_rank(), dist.get_world_size()
sums = []
step = 0
while args.steps == 0 or step < args.steps:
    if rank == args.raise_rank and step == args.raise_at_step:
        raise RuntimeError(f"injected failure in rank {rank} at step {step}")
    if rank == args.busy_rank and step == args.busy_at_step:
        time.sleep(args.busy_s)  # e.g. writing a large checkpoint: no collective meanwhile
    t = torch.full((args.numel,), float(rank + step))
    dist.all_reduce(t)
    sums.append(t[0].item())
    if step == 0 and args.ready_file:
        Path(f"{args.ready_file}.{rank}").write_text(str(os.getpid()))
    time.sleep(args.step_sleep)
    step += 1
dist.barrier()
out = Path(os.environ.get("SMP_TEST_OUT", "."))
(out / f"rank{rank}.json").write_text(json.dumps({
    "sums": sums, "world": world, "master_addr": os.environ.get("MASTER_ADDR"),
    "current_host": os.environ.get("SM_CURRENT_HOST"), "local_rank": int(os.environ.get("LOCAL_RANK", -1))}))
dist.destroy_process_group()
