"""cProfile of training steps, and the printout that compares two jobs' profiles function by function
(benchmarks/overhead.py: two engines in one process; benchmarks/launch_overhead.py: two separate jobs).

A profile is {name: {function: [(calls, self seconds) per profiled step]}}; the function's key is its
file's last two path parts, line and name, "[adapter] " first where the file is smp-adapter's own.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

ADAPTER_CODE = (os.sep + "smp_adapter" + os.sep, os.sep + "smdistributed" + os.sep)


def profile_steps(steps: dict, make_batch, first_step: int, n: int, dist) -> dict:
    """Per step function of ``steps`` (name -> callable(batch)) and function: self time and call count of
    each of n steps (one cProfile each, a barrier before each; several names alternate their order)."""
    import cProfile
    import pstats

    names = tuple(steps)
    per = {name: {} for name in names}
    for j in range(n):
        for name in (names if j % 2 == 0 else names[::-1]):
            x = make_batch(first_step + j)
            dist.barrier()
            prof = cProfile.Profile()
            prof.enable()
            steps[name](x)
            prof.disable()
            for (f, line, fn), (_, ncalls, tt, _, _) in pstats.Stats(prof).stats.items():
                key = f"{'/'.join(Path(f).parts[-2:])}:{line}({fn})" if line else fn
                if any(c in f for c in ADAPTER_CODE):
                    key = "[adapter] " + key
                slots = per[name].setdefault(key, [(0, 0.0)] * n)
                slots[j] = (slots[j][0] + ncalls, slots[j][1] + tt)  # same key twice: sum
    return per


def print_profile(prof: dict, names: tuple[str, str], top: int = 10, where: str = "rank 0") -> None:
    """Per-step profiles of ``names`` (ours first, the reference second): medians over the profiled steps,
    so a single preempted step does not dominate."""
    med = statistics.median
    ours, ref = names
    steps = len(next(iter(prof[ours].values())))

    def per_step(name, pick):
        return med(sum(pick(v[j]) for v in prof[name].values()) for j in range(steps))

    total = {n: per_step(n, lambda slot: slot[1]) for n in names}
    calls = {n: per_step(n, lambda slot: slot[0]) for n in names}
    own = med(sum(v[j][1] for k, v in prof[ours].items() if k.startswith("[adapter]")) for j in range(steps))
    print(f"  profile ({where}, cProfile around each of {steps} steps per job, medians over steps):")
    print(f"    step under cProfile: {ours} {total[ours] * 1e3:.1f} ms, {ref} {total[ref] * 1e3:.1f} ms; "
          f"Python function calls: {ours} {calls[ours]:.0f}, {ref} {calls[ref]:.0f}")
    print(f"    self time of smp_adapter/smdistributed functions: {own * 1e3:.3f} ms per step "
          f"({own / total[ours] * 100:.2f}% of the {ours} step, cProfile-inflated)")
    mine = sorted(((med(t for _, t in v), med(c for c, _ in v), k) for k, v in prof[ours].items()
                   if k.startswith("[adapter]")), reverse=True)
    print(f"    {ours}'s own functions by self time per step:")
    for t, c, k in mine[:top]:
        print(f"      {t * 1e3:8.3f} ms  calls {c:5.0f}  {k}")
    for name in names:
        fork = prof[name].get("<built-in method _posixsubprocess.fork_exec>")
        if fork:
            print(f"    subprocesses started inside the {name} step: {med(c for c, _ in fork):.0f} per step, "
                  f"{med(t for _, t in fork) * 1e3:.2f} ms (DeepSpeed's CPU accelerator runs `numactl --hardware` "
                  f"in device_count() when LOCAL_SIZE is unset)")
    rows = []
    for k in set(prof[ours]) | set(prof[ref]):
        a = prof[ours].get(k, [(0, 0.0)] * steps)
        b = prof[ref].get(k, [(0, 0.0)] * steps)
        ta, tb = med(t for _, t in a), med(t for _, t in b)
        ca, cb = med(c for c, _ in a), med(c for c, _ in b)
        rows.append((ta - tb, ca - cb, ca, cb, ta, tb, k))
    print(f"    largest differences in self time per step ({ours} - {ref}, median over steps):")
    for d, _, ca, cb, ta, tb, k in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        print(f"      {d * 1e3:+8.3f} ms  self {ta * 1e3:7.3f} vs {tb * 1e3:7.3f} ms  calls {ca:5.0f} vs {cb:5.0f}  {k}")
    print("    largest differences in call count per step (deterministic):")
    for d, dc, ca, cb, ta, tb, k in sorted(rows, key=lambda r: (-abs(r[1]), -abs(r[0])))[:top]:
        print(f"      {dc:+6.0f} calls ({ca:.0f} vs {cb:.0f})  self {ta * 1e3:7.3f} vs {tb * 1e3:7.3f} ms  {k}")
