"""Partial checkpoints: save and resume time, and peak memory per rank, with and without the
layout-independent pieces (runtime/engines/deepspeed/universal_checkpoint.py, docs/checkpoints.md).

For each mode (the overhead benchmark's GPT-2-style model, fp32, AdamW, 2 steps so Adam's state
exists) one job saves twice, alternating, with SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS=0 (today's
DeepSpeed-only files) and =1, --repeats times each; the time of a save is the slowest rank's. Then:

  resume, same layout    a job of the same mode resumes the checkpoint (DeepSpeed's files)
  resume, other layout   a job of --resume-mode resumes it (the universal pieces)

Per resume: seconds (slowest rank) and two peak memory growths of a rank during the resume, each
divided by that rank's share of the checkpoint. RSS: Linux's VmHWM, reset just before the resume; it
counts the file-backed pages of a memory-mapped checkpoint file the rank has read. anon: anonymous
RSS (RssAnon) sampled every millisecond: the memory the resume really allocates, the figure that
decides whether a rank runs out of memory. The share is the part of the fp32
params and Adam moments the rank holds in its layout (all of it under ZeRO 0, the params and 1/N of
the moments under ZeRO 1, 1/N of both under ZeRO 3). The model is the overhead benchmark's GPT-2
widened (--n-embd, --n-layer, --vocab) so the files, not fixed costs, dominate. The targets (issue 15): saving
with the pieces within 1.1x of DeepSpeed-only, resume memory per rank within 1.2x of its share.

    PYTHONPATH=adapter .venv/bin/python benchmarks/checkpoint.py [--modes zero3 zero1 pp2] [--repeats 3]

pp2 (two pipeline stages): "DS only" is then the pipeline engine's own stage files.

--digests (issue 30): each mode's job saves alternately without and with the file digests
(runtime/checkpoint/integrity/saving.py), --repeats times each; a second job resumes the checkpoint in the
same layout alternately without (SMP_ADAPTER_SKIP_CHECKPOINT_VERIFY=1) and with the check, after one
untimed resume (--cold: the checkpoint's pages dropped from the page cache before each resume, so it
is read from the disk as after a copy). Medians, slowest rank. Targets: both within 1.05x. Beside the
resume's wall time: its CPU seconds (every thread of the rank); from further checked resumes, timed
inside (timers left out of the resumes above: ~1.5 us each, they would count themselves), the main
thread's seconds in the check ("checking") and the CPU seconds spent hashing (the bytes torch.load
reads, hashed as read, and the files checked by plain reads or a memory map), and the MB one
rank's share of the digests would cover if no file were read (chunks of a large
file split among the ranks; SMP_ADAPTER_DIGEST_CHUNK_BYTES=1073741824 records whole files, as before
chunks). Where the ranks use every core, the hashing's CPU seconds over the resume's are the least
the check can cost. --hash-speed: MB/s of the candidate hashes.

    PYTHONPATH=adapter .venv/bin/python benchmarks/checkpoint.py --digests --modes zero3 zero0 pp2 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (LR, MODES, batch, build_model, current_rss_bytes, lm_train_step, peak_rss_bytes, quiet,  # noqa: E402
                     run_ranks, write_result)

SWITCH = "SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS"


def _share_bytes(options: dict, world: int, params: int) -> float:
    """Bytes of fp32 params + two Adam moments that one rank of this layout holds (pp > 1: its
    stage's, taken as 1/pp of the model)."""
    sharded_params = options.get("sharded_data_parallel_degree", 1) > 1
    sharded_moments = sharded_params or options.get("shard_optimizer_state", False)
    stage = 1 / options.get("pipeline_parallel_degree", 1)
    return 4 * params * stage * ((1 / world if sharded_params else 1) + 2 * (1 / world if sharded_moments else 1))


def _size(args) -> dict:
    return dict(n_embd=args.n_embd, n_layer=args.n_layer, vocab_size=args.vocab)


def _job(options: dict, size: dict):
    import torch

    import smdistributed.modelparallel.torch as smp

    smp.init(options)
    quiet()
    model = smp.DistributedModel(build_model(**size))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    train_step = lm_train_step(smp)

    return smp, model, optimizer, train_step


def _slowest(smp, seconds: float) -> float:
    return max(smp.allgather(seconds, smp.WORLD))


def save_worker(args) -> None:
    options = json.loads(args.options)
    smp, model, optimizer, train_step = _job(options, _size(args))
    for step in range(2):
        optimizer.zero_grad()
        train_step(model, batch(step, smp.dp_rank(), vocab=args.vocab))
        optimizer.step()
    times = {"0": [], "1": []}
    for i in range(args.repeats):
        for switch in ("0", "1") if i % 2 == 0 else ("1", "0"):
            os.environ[SWITCH] = switch
            smp.barrier()
            start = time.perf_counter()
            smp.save_checkpoint(args.ckpt, tag=f"s{switch}", partial=True, user_content={"step": 2})
            times[switch].append(_slowest(smp, time.perf_counter() - start))
    write_result({"times": times})


def resume_worker(args) -> None:
    options = json.loads(args.options)
    smp, model, optimizer, _ = _job(options, _size(args))
    import gc

    gc.collect()
    before, anon_before = current_rss_bytes(), _status_bytes("RssAnon")
    with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak RSS (VmHWM) to the current RSS
        f.write("5")
    sampler = _PeakAnon()
    start = time.perf_counter()
    smp.resume_from_checkpoint(args.ckpt, tag=args.tag)
    seconds = _slowest(smp, time.perf_counter() - start)
    anon_peak = sampler.stop()
    write_result({"seconds": seconds, "rss_growth": _status_bytes("VmHWM") - before,
                  "anon_growth": anon_peak - anon_before, "world": smp.size()})


# -- digests (runtime/checkpoint/integrity/saving.py, resume_check.py): save and resume with and without them --
def _digests_at_save(on: bool) -> None:
    """Off: the save writes and records as before digests existed: torch.save to the path (not through
    the hashing file object), nothing digested afterwards; the gather that replaces the barrier still
    runs, with nothing in it. Every caller looks these up on the module when it calls them."""
    from smp_adapter.runtime.checkpoint.integrity import saving as digests

    if not hasattr(digests, "_bench_originals"):
        digests._bench_originals = (digests.write_hashed, digests.digest_written, digests.complete)
    hashed, written, complete = digests._bench_originals

    def unhashed(path, write, algorithm=None):
        write(str(path))  # torch.save(obj, path) / DeepSpeed's checkpoint engine given the path, as before
        return None

    digests.write_hashed = hashed if on else unhashed
    digests.digest_written = written if on else (lambda *a: {})
    digests.complete = complete if on else (lambda *a: {})


def _timed(owner, name: str, spent: list, clock=time.perf_counter) -> None:
    """Wrap ``owner.name`` so that its seconds add up in ``spent[0]``. Wall seconds by default: the
    digest work itself, a figure the disk's write-back does not blur as it blurs the ratio of whole
    saves; with ``clock=time.thread_time`` the CPU seconds of the thread running it: the hashing's own
    cost, whatever else runs on the cores."""
    original = getattr(owner, name)

    def timed(*a, **k):
        start = clock()
        try:
            return original(*a, **k)
        finally:
            spent[0] += clock() - start

    setattr(owner, name, timed)


def digest_save_worker(args) -> None:
    smp, model, optimizer, train_step = _job(json.loads(args.options), _size(args))
    for step in range(2):
        optimizer.zero_grad()
        train_step(model, batch(step, smp.dp_rank(), vocab=args.vocab))
        optimizer.step()
    from smp_adapter.runtime.checkpoint.integrity import saving as digests

    _digests_at_save(True)
    spent = [0.0]
    for name in ("digest_written", "complete"):  # what is hashed after the writes (the hashing while writing is
        _timed(digests, name, spent)             # in the save's time only)
    digests._bench_originals = (digests.write_hashed, digests.digest_written, digests.complete)
    times, work = {"off": [], "on": []}, []
    for i in range(args.repeats):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            _digests_at_save(mode == "on")
            smp.barrier()
            spent[0], start = 0.0, time.perf_counter()
            smp.save_checkpoint(args.ckpt, tag=f"d{mode}", partial=True, user_content={"step": 2})
            times[mode].append(_slowest(smp, time.perf_counter() - start))
            if mode == "on":
                work.append(_slowest(smp, spent[0]))
    write_result({"times": times, "digest_work": work})


def digest_resume_worker(args) -> None:
    """The same-layout resume of the checkpoint with digests, checked (on) or not (off: the user's
    opt-out), alternating; the first resume (cold pages) is left out. The timed resumes run the code
    as it is; the check's own figures come from further checked resumes, with the timers (a timer
    around each hashed piece costs ~1.5 us, about 1 ms of a resume: it would count itself)."""
    from smp_adapter.runtime.checkpoint.integrity.manifest import SKIP_ENV

    from smp_adapter.runtime.checkpoint import dirs as checkpoint_dirs

    smp, model, optimizer, _ = _job(json.loads(args.options), _size(args))
    smp.resume_from_checkpoint(args.ckpt, tag="don")
    folder = Path(args.ckpt) / "don_partial"
    files = [p for p in folder.rglob("*") if p.is_file()]
    recorded = json.loads((folder / checkpoint_dirs.digests.MANIFEST).read_text())["files"]
    share = checkpoint_dirs.digests.shares(recorded, smp.size())[smp.rank()]
    share_mb = max(smp.allgather(sum(checkpoint_dirs.digests.unit_bytes(recorded[n], i) for n, i in share) / 1e6,
                                 smp.WORLD))

    def resume(mode: str) -> tuple[float, float]:
        """(wall, CPU seconds of every thread of the rank), slowest rank."""
        os.environ[SKIP_ENV] = "1" if mode == "off" else "0"
        if args.cold:  # the checkpoint's pages out of the page cache: read from the disk, as after a copy
            smp.barrier()
            for path in files:
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        smp.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        smp.resume_from_checkpoint(args.ckpt, tag="don")
        return (_slowest(smp, time.perf_counter() - start), _slowest(smp, time.process_time() - start_cpu))

    times, cpu = {"off": [], "on": []}, {"off": [], "on": []}
    for i in range(args.repeats):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            wall, seconds = resume(mode)
            times[mode].append(wall)
            cpu[mode].append(seconds)
    spent, work, hashing, hash_cpu = [0.0], [], [0.0], []
    # the main thread's time in the check: the size pass and the small files, and the verdict at the end
    _timed(checkpoint_dirs.resume_check, "start_check", spent)
    _timed(checkpoint_dirs.resume_check.Check, "finish", spent)
    # the hashing's own CPU seconds: of the bytes torch.load reads (HashingReader), and of the files
    # checked otherwise (damaged_units: the small files before the load, what no rank read after it)
    from smp_adapter.runtime.checkpoint.integrity import hashing_io
    from smp_adapter.runtime.checkpoint.integrity import spare_cores as spare_core_hashing
    _timed(hashing_io.HashingReader, "_feed", hashing, time.thread_time)
    _timed(checkpoint_dirs.digests, "damaged_units", hashing, time.thread_time)
    _timed(spare_core_hashing, "damaged_units", hashing, time.thread_time)  # the threads' (hashing on spare cores)
    for _ in range(max(3, args.repeats // 2)):
        spent[0], hashing[0] = 0.0, 0.0
        resume("on")
        work.append(_slowest(smp, spent[0]))
        hash_cpu.append(_slowest(smp, hashing[0]))
    write_result({"times": times, "digest_work": work, "cpu": cpu, "hash_cpu": hash_cpu, "share_mb": share_mb,
                  "threads": spare_core_hashing.hashing_threads(smp.local_size())})


def hash_speed() -> None:
    """MB/s of each candidate hash over 64 MiB in memory, one core (best of 3)."""
    import hashlib

    data = memoryview(os.urandom(64 << 20))
    candidates = {"blake2b": lambda: hashlib.blake2b(digest_size=16)}
    try:
        import xxhash

        candidates.update({"xxh3_128": xxhash.xxh3_128, "xxh3_64": xxhash.xxh3_64})
    except ImportError:
        print("xxhash: not installed")
    try:
        import blake3

        candidates["blake3"] = blake3.blake3
    except ImportError:
        print("blake3: not installed")
    for name, make in candidates.items():
        best = float("inf")
        for _ in range(3):
            start, h = time.perf_counter(), make()
            for i in range(0, len(data), 8 << 20):
                h.update(data[i:i + (8 << 20)])
            h.digest()
            best = min(best, time.perf_counter() - start)
        print(f"hash {name:9} {len(data) / best / 1e6:8.0f} MB/s")
    _cache_vs_map()


def _cache_vs_map() -> None:
    """xxh3_128 over bytes still in the CPU's cache (a 256 KiB piece just read, as the resume's reader
    hashes) against the same bytes hashed again through a memory map of a file in the page cache
    (what checking a file after it was read costs). Best of 5."""
    import mmap

    from smp_adapter.runtime.checkpoint.integrity.records import hasher

    piece, total = memoryview(os.urandom(256 << 10)), 256 << 20
    best = float("inf")
    for _ in range(5):
        start, h = time.perf_counter(), hasher("xxh3_128")
        for _ in range(total // len(piece)):
            h.update(piece)
        best = min(best, time.perf_counter() - start)
    print(f"xxh3_128 of a 256 KiB piece in the CPU's cache   {total / best / 1e6:8.0f} MB/s")
    with tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(total))
        f.flush()
        best = float("inf")
        for _ in range(5):
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                start, h = time.perf_counter(), hasher("xxh3_128")
                h.update(mapped)
                best = min(best, time.perf_counter() - start)
    print(f"xxh3_128 of a 256 MiB file in the page cache, mapped {total / best / 1e6:8.0f} MB/s")


def _paired(seconds: dict) -> float:
    """The median of on / off over the resumes run back to back (the i-th of each): what else runs on
    the machine moves both of a pair alike, so this ratio drifts less than the ratio of the medians."""
    return statistics.median(on / off for on, off in zip(seconds["on"], seconds["off"]))


def _hashing_way(threads: int) -> str:
    return f"hashed on {threads} spare-core thread{'s' if threads > 1 else ''}" if threads else "hashed as read"


def digests_main(args, me: Path, size: list) -> None:
    print(f"{'mode':8} {'checkpoint':>10} {'save off':>9} {'save on':>8} {'ratio':>6} {'digesting':>9} | "
          f"{'resume off':>10} {'resume on':>9} {'ratio':>6} {'checking':>8} | {'cpu off':>8} {'cpu on':>7} {'ratio':>6} "
          f"{'hashing':>8} {'share':>8} | {'paired':>6} {'cpu':>5}   (medians of {args.repeats}, slowest rank; cpu: the "
          "resume's CPU seconds, all threads; hashing: CPU seconds hashing; share: MB one rank would hash with no "
          "file read; paired: median of on/off over back-to-back resumes, wall and cpu; then how the resume hashed: "
          "SMP_ADAPTER_DIGEST_THREADS or the cores each local rank has, runtime/checkpoint/integrity/spare_cores.py)")
    figures = {}
    for mode in args.modes:
        options, nprocs, _ = MODES[mode]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            saves = run_ranks(me, nprocs, ["--digest-save-worker", "--options", json.dumps(options), "--ckpt",
                                           tmp / "ckpt", "--repeats", args.repeats, *size], tmp / "save")
            folder = tmp / "ckpt" / "don_partial"
            mb = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
            resumes = run_ranks(me, nprocs, ["--digest-resume-worker", "--options", json.dumps(options), "--ckpt",
                                             tmp / "ckpt", "--repeats", args.repeats, *size,
                                             *(["--cold"] if args.cold else [])], tmp / "resume")
        save = {k: statistics.median(saves[0]["times"][k]) for k in ("off", "on")}
        resume = {k: statistics.median(resumes[0]["times"][k]) for k in ("off", "on")}
        save["digesting"] = statistics.median(saves[0]["digest_work"])
        resume["checking"] = statistics.median(resumes[0]["digest_work"])
        cpu = {k: statistics.median(resumes[0]["cpu"][k]) for k in ("off", "on")}
        cpu["hash"] = statistics.median(resumes[0]["hash_cpu"])
        print(f"{mode:8} {mb:8.0f}MB {save['off']:8.3f}s {save['on']:7.3f}s {save['on'] / save['off']:6.2f} "
              f"{save['digesting']:8.3f}s | {resume['off']:9.3f}s {resume['on']:8.3f}s "
              f"{resume['on'] / resume['off']:6.2f} {resume['checking']:7.3f}s | {cpu['off']:7.3f}s {cpu['on']:7.3f}s "
              f"{cpu['on'] / cpu['off']:6.2f} {cpu['hash']:7.3f}s {resumes[0]['share_mb']:6.0f}MB | "
              f"{_paired(resumes[0]['times']):6.2f} {_paired(resumes[0]['cpu']):5.2f}   "
              f"{_hashing_way(resumes[0]['threads'])}")
        figures[mode] = {"checkpoint_mb": mb, "save_s": save, "resume_s": resume, "resume_cpu_s": cpu,
                         "paired_ratio": {"wall": _paired(resumes[0]["times"]), "cpu": _paired(resumes[0]["cpu"])},
                         "hashing_threads": resumes[0]["threads"],
                         "save_all": saves[0]["times"], "resume_all": resumes[0]["times"],
                         "resume_cpu_all": resumes[0]["cpu"]}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return peak_rss_bytes()


class _PeakAnon:
    """Peak anonymous RSS (RssAnon), sampled every millisecond: unlike VmHWM it leaves out the
    clean, file-backed pages of a memory-mapped checkpoint file, which the kernel can drop at will."""

    def __init__(self):
        import threading

        self.peak, self._done = _status_bytes("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _status_bytes("RssAnon"))

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, _status_bytes("RssAnon"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["zero3", "zero1"], choices=sorted(MODES))
    p.add_argument("--resume-mode", default="zero0", choices=sorted(MODES), help="the other layout resumed into")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--digests", action="store_true",
                   help="instead: save and same-layout resume with and without the file digests (issue 30)")
    p.add_argument("--hash-speed", action="store_true", help="instead: MB/s of the candidate hashes")
    p.add_argument("--cold", action="store_true",
                   help="--digests: drop the checkpoint's pages from the page cache before each resume")
    p.add_argument("--digest-save-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--digest-resume-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--options", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.save_worker:
        return save_worker(args)
    if args.resume_worker:
        return resume_worker(args)
    if args.digest_save_worker:
        return digest_save_worker(args)
    if args.digest_resume_worker:
        return digest_resume_worker(args)
    if args.hash_speed:
        return hash_speed()
    me = Path(__file__).resolve()
    size = ["--n-embd", args.n_embd, "--n-layer", args.n_layer, "--vocab", args.vocab]
    if args.digests:
        return digests_main(args, me, size)
    params = sum(t.numel() for t in build_model(**_size(args)).parameters())
    checkpoint_bytes = params * 4 * 3  # fp32 params + two Adam moments
    print(f"model: {params / 1e6:.2f} M parameters; fp32 params + Adam moments = {checkpoint_bytes / 2**20:.1f} MiB")
    print(f"{'mode':8} {'save DS only':>13} {'save + pieces':>14} {'ratio':>6} | {'resume same':>11} {'RSS/share':>9} "
          f"{'anon/share':>10} | resume into {args.resume_mode:6} {'RSS/share':>9} {'anon/share':>10}")
    figures = {}
    for mode in args.modes:
        options, nprocs, _ = MODES[mode]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            saves = run_ranks(me, nprocs, ["--save-worker", "--options", json.dumps(options), "--ckpt", tmp / "ckpt",
                                           "--repeats", args.repeats, *size], tmp / "save")
            ds_only, with_pieces = (statistics.median(saves[0]["times"][k]) for k in ("0", "1"))
            rows = []
            for resume_mode, tag in ((mode, "s0"), (args.resume_mode, "s1")):
                r_options, r_nprocs, _ = MODES[resume_mode]
                res = run_ranks(me, r_nprocs, ["--resume-worker", "--options", json.dumps(r_options), "--ckpt",
                                               tmp / "ckpt", "--tag", tag, *size], tmp / f"resume_{resume_mode}_{tag}")
                share = _share_bytes(r_options, res[0]["world"], params)
                rows.append((res[0]["seconds"], max(r["rss_growth"] for r in res) / share,
                             max(r["anon_growth"] for r in res) / share))
        print(f"{mode:8} {ds_only:12.3f}s {with_pieces:13.3f}s {with_pieces / ds_only:6.2f} | {rows[0][0]:10.3f}s "
              f"{rows[0][1]:9.2f} {rows[0][2]:10.2f} | {rows[1][0]:22.3f}s {rows[1][1]:9.2f} {rows[1][2]:10.2f}")
        figures[mode] = {"save_s": {"deepspeed_only": ds_only, "with_pieces": with_pieces},
                         "resume": {name: {"s": r[0], "rss_per_share": r[1], "anon_per_share": r[2]}
                                    for name, r in zip(("same", args.resume_mode), rows)}}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
