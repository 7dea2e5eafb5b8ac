"""The disk-full drill (issue 63, docs/failures.md): a job saving partial checkpoints every 2 steps onto a 3 MiB
tmpfs, through `smp-adapter launch`, until a save meets the full disk and the script (which does not catch the
error) ends. Run N times per engine; a run counts as named when the job ends non-zero, the launcher's last lines
(its own `smp-adapter launch:` lines after the ranks' output) name `SMPCheckpointError` with the checkpoint
directory and "No space left on device", no rank of the job is left running, and nothing is half-published (no
`.tmp` entry, `newest` names a checkpoint with its manifest). Before the fix, some runs ended in a gloo abort
(SIGABRT) with the cause printed nowhere. Not in CI (each run is ~30-80 s on 2 cores; CI runs the ZeRO-3 case
3 times: tests/distributed/test_long_jobs.py). Root needed (mount).

    .venv/bin/python scripts/failure_drill.py --runs 10 [--engine zero3 --engine mics] [--smp-adapter PATH]
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
# engine -> (ranks, options, extra environment); MiCS is chosen for 1 < sdp < rdp (docs/translation.md)
ENGINES = {"zero3": (2, {"ddp": True, "sharded_data_parallel_degree": 2}, {}),
           "mics": (4, {"ddp": True, "sharded_data_parallel_degree": 2}, {"SMP_ADAPTER_SDP_ENGINE": "mics"})}
DISK_MB = 3
WIDTH = 8192  # ~0.4 MiB per save: the 3 MiB disk fills at the 4th to 8th save, inside a file of some rank


def one_run(cli: str, engine: str, work: Path, timeout: float) -> dict:
    ranks, options, extra = ENGINES[engine]
    disk = work / "disk"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)], check=True, timeout=30)
    try:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "SMP_ADAPTER_TIMEOUT": "60", **extra}
        command = [cli, "launch", "--nproc-per-node", str(ranks), "--job-dir", str(work / "job"),
                   "--options", json.dumps(options), str(SCRIPT), "--steps", "40", "--save-every", "2",
                   "--ckpt-dir", str(disk), "--width", str(WIDTH), "--raise-save-errors"]
        start = time.monotonic()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
            rc, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:  # a hang: the worst outcome, counted as not named
            rc, output = 124, f"{exc.stdout or ''}{exc.stderr or ''}"
            output = output if isinstance(output, str) else output.decode("utf-8", "replace")
        return {"engine": engine, "rc": rc, "seconds": round(time.monotonic() - start, 1),
                **_judge(output, disk), "left_running": _left_running(disk)}
    finally:
        subprocess.run(["umount", "-l", str(disk)], timeout=30)


def _judge(output: str, disk: Path) -> dict:
    lines = output.splitlines()
    own = [i for i, t in enumerate(lines) if t.startswith("smp-adapter launch: ") and "failed" in t]
    last = "\n".join(lines[own[0]:]) if own else ""  # the launcher's report and what follows it
    named = ("SMPCheckpointError" in last and f"checkpoint save to {disk} failed writing {disk}/" in last
             and "No space left on device" in last and "free space on that file system" in last)
    entries = sorted(p.name for p in disk.iterdir())
    newest = (disk / "newest").read_text().strip() if (disk / "newest").exists() else None
    published = newest is not None and (disk / f"{newest}_partial" / "smp_manifest.json").exists()
    return {"named": named, "aborted": "gloo::EnforceNotMet" in output or "SIGABRT" in output,
            "half_published": any(e.endswith(".tmp") or ".tmp." in e for e in entries) or not published,
            "summary": (lines[own[0]] if own else (lines[-1] if lines else ""))[:240]}


def _left_running(disk: Path) -> bool:
    """A process of this run's job still alive (its ranks carry the run's own disk path in their arguments)."""
    time.sleep(1)
    found = subprocess.run(["pgrep", "-f", f"--ckpt-dir {disk}"], capture_output=True, text=True)
    return bool(found.stdout.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES), help="default: zero3 and mics")
    parser.add_argument("--smp-adapter", default=str(Path(sys.executable).with_name("smp-adapter")),
                        help="the CLI to drill (another checkout's, for a before/after comparison)")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--json", default=None, help="write every run's record here")
    args = parser.parse_args()
    records = []
    for engine in args.engine or ["zero3", "mics"]:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix=f"drill-{engine}-") as work:
                record = one_run(args.smp_adapter, engine, Path(work), args.timeout)
            records.append(record)
            print(json.dumps(record), flush=True)
    print("\n| engine | runs | non-zero exit | named SMPCheckpointError (path, cause, free space) | gloo abort | "
          "half-published | left running |\n|---|---|---|---|---|---|---|")
    for engine in dict.fromkeys(r["engine"] for r in records):
        rs = [r for r in records if r["engine"] == engine]
        print(f"| {engine} | {len(rs)} | {sum(r['rc'] != 0 for r in rs)} | {sum(r['named'] for r in rs)} | "
              f"{sum(r['aborted'] for r in rs)} | {sum(r['half_published'] for r in rs)} | "
              f"{sum(r['left_running'] for r in rs)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    ok = all(r["rc"] != 0 and r["named"] and not r["half_published"] and not r["left_running"] for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
