"""The failure drill (issue 63, docs/failures.md): each failure of the long-jobs set, on each layout, through
`smp-adapter launch --cpu`, run N times. The job (tests/distributed/scripts/long_job.py) does not catch the error,
as a user's script does not. Cases:

* ``disk``: partial checkpoints every 2 steps onto a 3 MiB tmpfs, until a save meets the full disk (root: mount);
* ``damage``: a first job saves one partial checkpoint (step 4); a byte of its largest engine file (.pt) is flipped;
  a second job resumes from the directory (no tag: the fallback finds no intact checkpoint);
* ``nan``: rank 1's batch holds a NaN at optimizer step 2 (the NaN guard, default policy "stop"), saving every step;
* ``raise``: rank 1 raises RuntimeError in its step 3 (the user's bug), saving every step.

A run counts as named when the job ends non-zero and the launcher's last lines (from its first
`smp-adapter launch: ... failed` line on) name the cause: `SMPCheckpointError` with the checkpoint directory
("No space left on device" for disk, the damaged file for damage), the NaN guard's `optimizer step 2 ... not
finite`, or the user's RuntimeError message. "half-published": a `.tmp` entry is left, or `newest` is not the
checkpoint expected (the last one written before the failure, with its manifest). "left running": a process of
the job is alive after the launcher ended. Not in CI (~30-80 s a run on 2 cores).

    .venv/bin/python scripts/failure_drill.py --runs 3 [--cases disk,damage,nan,raise]
        [--layouts ddp,zero3,mics,pp2] [--smp-adapter PATH] [--json FILE]
    .venv/bin/python scripts/failure_drill.py --table-from FILE   # the table of rounds appended to one --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests/distributed/scripts/long_job.py"
# layout -> (ranks, options, extra environment); MiCS is chosen for 1 < sdp < rdp (docs/translation.md)
LAYOUTS = {"ddp": (2, {"ddp": True}, {}),
           "zero3": (2, {"ddp": True, "sharded_data_parallel_degree": 2}, {}),
           "mics": (4, {"ddp": True, "sharded_data_parallel_degree": 2}, {"SMP_ADAPTER_SDP_ENGINE": "mics"}),
           "pp2": (2, {"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2}, {})}
CASES = ("disk", "damage", "nan", "raise")
DISK_MB = 3
WIDTH = 8192  # ~0.4 MiB per save: the 3 MiB disk fills at the 4th to 8th save, inside a file of some rank
LR = 0.001  # at WIDTH, long_job's default 0.05 diverges (an inf loss at step 10 on ddp) before the disk fills
RAISED = "RuntimeError: the user's code failed on rank 1 in its step 3 (failure drill)"


def launch(cli: str, layout: str, job: Path, args: list, timeout: float) -> tuple[int, str]:
    """One `smp-adapter launch --cpu` of long_job.py: (exit code, everything it printed); 124 for a hang."""
    ranks, options, extra = LAYOUTS[layout]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "SMP_ADAPTER_TIMEOUT": "60",
           "SMP_TEST_OUT": str(job.parent), **extra}  # a job that ends writes its ranks' results there, not in cwd
    command = [cli, "launch", "--cpu", "--nproc-per-node", str(ranks), "--job-dir", str(job),
               "--options", json.dumps(options), str(SCRIPT), *map(str, args)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:  # a hang: the worst outcome, counted as not named
        output = f"{exc.stdout or ''}{exc.stderr or ''}"
        return 124, output if isinstance(output, str) else output.decode("utf-8", "replace")


def run_disk(cli: str, layout: str, work: Path, timeout: float) -> dict:
    disk = work / "ckpt"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)], check=True, timeout=30)
    try:
        rc, output = launch(cli, layout, work / "job", ["--steps", 40, "--save-every", 2, "--ckpt-dir", disk,
                                                        "--width", WIDTH, "--lr", LR, "--raise-save-errors"], timeout)
        named = [f"SMPCheckpointError: checkpoint save to {disk} failed writing {disk}/", "No space left on device",
                 "free space on that file system"]
        return judge(rc, output, disk, named, expected_newest=None)
    finally:
        subprocess.run(["umount", "-l", str(disk)], timeout=30)


def run_damage(cli: str, layout: str, work: Path, timeout: float) -> dict:
    ckpt = work / "ckpt"
    rc, output = launch(cli, layout, work / "first", ["--steps", 4, "--save-every", 2, "--keep", 1,
                                                      "--ckpt-dir", ckpt], timeout)
    if rc != 0:
        return {"rc": rc, "named": False, "aborted": False, "half_published": False,
                "summary": f"the first job (the save) failed: {output.splitlines()[-1:]}"}
    engine_files = [p for p in (ckpt / "step4_partial").rglob("*.pt") if "universal" not in p.parts
                    and not p.name.startswith(("rng_", "user_content"))]  # the engine's own files
    damaged = max(engine_files, key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    rc, output = launch(cli, layout, work / "resumed", ["--steps", 2, "--resume", "--ckpt-dir", ckpt], timeout)
    named = ["SMPCheckpointError", str(damaged.relative_to(ckpt / "step4_partial"))]
    return {**judge(rc, output, ckpt, named, expected_newest="step4"), "damaged": damaged.name}


def run_in_training(case: str, cli: str, layout: str, work: Path, timeout: float) -> dict:
    """nan: optimizer step 2 (batch 1) on rank 1; raise: rank 1 at the top of its step 3; one save a step."""
    ckpt = work / "ckpt"
    how = ["--nan-at-step", 1, "--nan-rank", 1] if case == "nan" else ["--raise-rank", 1, "--raise-at-step", 3]
    rc, output = launch(cli, layout, work / "job", ["--steps", 6, "--save-every", 1, "--ckpt-dir", ckpt, *how],
                        timeout)
    named = ["optimizer step 2 (call 2 of optimizer.step()): the loss given to model.backward is not finite"] \
        if case == "nan" else [RAISED]
    return judge(rc, output, ckpt, named, expected_newest="step1" if case == "nan" else "step3")


def judge(rc: int, output: str, ckpt: Path, named: list[str], expected_newest: str | None) -> dict:
    """``expected_newest`` None: any complete checkpoint (where the disk filled varies from run to run)."""
    lines = output.splitlines()
    own = [i for i, t in enumerate(lines) if t.startswith("smp-adapter launch: ") and "failed" in t]
    last = "\n".join(lines[own[0]:]) if own else ""  # the launcher's report and what follows it
    entries = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []
    newest = (ckpt / "newest").read_text().strip() if (ckpt / "newest").exists() else None
    complete = newest is not None and (ckpt / f"{newest}_partial" / "smp_manifest.json").exists()
    expected = complete and expected_newest in (None, newest)
    return {"rc": rc, "named": rc != 0 and all(n in last for n in named),
            "aborted": "gloo::EnforceNotMet" in output or "SIGABRT" in output,
            "half_published": any(".tmp" in e for e in entries) or not expected, "newest": newest,
            "summary": (lines[own[0]] if own else (lines[-1] if lines else ""))[:300]}


def left_running(work: Path) -> bool:
    """A process of this run's job still alive (its ranks carry the run's own folder in their arguments)."""
    time.sleep(1)
    found = subprocess.run(["pgrep", "-f", f"{work}/"], capture_output=True, text=True)
    if found.returncode not in (0, 1):  # 1: none found; else pgrep itself failed, which must not read as "none"
        raise RuntimeError(f"pgrep failed (exit {found.returncode}): {found.stderr.strip()}")
    return bool(found.stdout.strip())


def one_run(case: str, cli: str, layout: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"drill-{case}-{layout}-") as folder:
        work = Path(folder)
        start = time.monotonic()
        if case == "disk":
            record = run_disk(cli, layout, work, timeout)
        elif case == "damage":
            record = run_damage(cli, layout, work, timeout)
        else:
            record = run_in_training(case, cli, layout, work, timeout)
        return {"case": case, "layout": layout, "seconds": round(time.monotonic() - start, 1), **record,
                "left_running": left_running(work)}


def table(records: list[dict]) -> str:
    rows = ["| case | layout (ranks) | runs | non-zero exit | cause named | gloo abort | half-published | "
            "left running | mean s |", "|---|---|---|---|---|---|---|---|---|"]
    cells = sorted(dict.fromkeys((r["case"], r["layout"]) for r in records),
                   key=lambda cell: (CASES.index(cell[0]), list(LAYOUTS).index(cell[1])))
    for case, layout in cells:
        rs = [r for r in records if (r["case"], r["layout"]) == (case, layout)]
        rows.append(f"| {case} | {layout} ({LAYOUTS[layout][0]}) | {len(rs)} | {sum(r['rc'] != 0 for r in rs)} | "
                    f"{sum(r['named'] for r in rs)} | {sum(r['aborted'] for r in rs)} | "
                    f"{sum(r['half_published'] for r in rs)} | {sum(r['left_running'] for r in rs)} | "
                    f"{sum(r['seconds'] for r in rs) / len(rs):.0f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--smp-adapter", default=str(Path(sys.executable).with_name("smp-adapter")),
                        help="the CLI to drill (another checkout's, for a before/after comparison)")
    parser.add_argument("--timeout", type=float, default=400, help="seconds for one launch")
    parser.add_argument("--json", default=None, help="append every run's record here, one JSON line each")
    parser.add_argument("--table-from", default=None, help="print the table of the records in this --json file, "
                        "running nothing (several rounds of the drill appended to one file)")
    args = parser.parse_args()
    if args.table_from:
        print(table([json.loads(line) for line in Path(args.table_from).read_text().splitlines() if line.strip()]))
        return 0
    cases, layouts = args.cases.split(","), args.layouts.split(",")
    unknown = sorted(set(cases) - set(CASES)) + sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown case or layout {', '.join(unknown)}: cases are {', '.join(CASES)}; layouts "
                     f"{', '.join(LAYOUTS)}")
    records = []
    for case in cases:
        for layout in layouts:
            for _ in range(args.runs):
                records.append(one_run(case, args.smp_adapter, layout, args.timeout))
                print(json.dumps(records[-1]), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(records[-1]) + "\n")
    print("\n" + table(records))
    ok = all(r["rc"] != 0 and r["named"] and not r["half_published"] and not r["left_running"] for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
