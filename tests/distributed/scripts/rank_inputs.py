"""Writes what this rank was given to <--out>/rank<RANK>.json: its arguments, working directory and
the environment variables `smp-adapter launch` sets for a job (test_launch.py compares ranks started
by the launcher with ranks started by launch_util.run_as_launched). Imports nothing heavy."""

import json
import os
import sys

# what launch sets (its --dry-run's exports) and the launcher's rank coordinates; not the rendezvous
# port (each start picks its own), the launch process's identity (SMP_ADAPTER_LAUNCH_PROCESS, which a forked
# rank has no launch process to name) nor launcher-private variables (TORCHELASTIC_*, CROSS_RANK, ...)
KEPT = ("PYTHONPATH", "DS_ACCELERATOR", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "RANK", "WORLD_SIZE", "LOCAL_RANK",
        "MASTER_ADDR")
out = sys.argv[sys.argv.index("--out") + 1]
seen = {"argv": sys.argv[1:], "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items()
                if (k.startswith(("SM_", "SMP_ADAPTER_")) or k in KEPT) and k != "SMP_ADAPTER_LAUNCH_PROCESS"}}
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f, sort_keys=True)
