"""The communication ledger is free when off: without SMP_ADAPTER_COMM_LEDGER nothing is installed
(torch.distributed's functions are the original objects after smp.init), and this program times a
small all_reduce with the ledger off and on, in one process (world size 1, gloo), alternating
rounds off/on so load drift hits both alike. Prints microseconds per call and the on/off ratio.

    PYTHONPATH=adapter .venv/bin/python benchmarks/comm_ledger_overhead.py [--calls 2000] [--rounds 10]
"""

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    os.environ.pop("SMP_ADAPTER_COMM_LEDGER", None)
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor", "isend", "broadcast")}
    import smdistributed.modelparallel.torch as smp
    from smp_adapter.ledger import record as comm_ledger
    from smp_adapter.runtime.state import state

    smp.init({"ddp": True})
    untouched = all(getattr(dist, n) is f and getattr(c10d, n) is f for n, f in originals.items())
    print(f"ledger off after smp.init: torch.distributed functions are the originals: {untouched}")
    tensor = torch.ones(1024)

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            dist.all_reduce(tensor)
        return (time.perf_counter() - start) / args.calls * 1e6

    # on, in a step: counted in memory, written when the step ends; on, outside steps: the phase
    # record is also rewritten on disk after every call (so that os._exit loses nothing)
    times = {"off": [], "on, in a step": [], "on, outside steps": []}
    with tempfile.TemporaryDirectory() as directory:
        for round_ in range(args.rounds):
            modes = list(times) if round_ % 2 == 0 else list(reversed(times))
            for mode in modes:
                if mode == "off":
                    times[mode].append(timed())
                    continue
                os.environ[comm_ledger.ENV] = directory
                comm_ledger.install_if_requested(state.dims, state.rank, state.local_size)
                if mode == "on, in a step":
                    comm_ledger.note_step_call(None)
                times[mode].append(timed())
                comm_ledger.close()
                del os.environ[comm_ledger.ENV]
    off = statistics.median(times["off"])
    print(f"all_reduce of 4 KiB, {args.calls} calls x {args.rounds} rounds: off {off:.2f} us/call, " + ", ".join(
        f"{mode} {statistics.median(v):.2f} us/call ({statistics.median(v) / off:.3f} x)" for mode, v in times.items()
        if mode != "off"))
    from smp_adapter.runtime.init import shutdown

    shutdown()


if __name__ == "__main__":
    main()
