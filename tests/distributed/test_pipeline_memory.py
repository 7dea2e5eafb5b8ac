"""Pipeline parallelism divides memory (issue: "each rank materialises and keeps only its own stage").

A deep MLP whose parameters dominate memory (16 x 1536^2 fp32, 144 MiB), created under
smp.delay_param_initialization() and trained with SGD through `smp-adapter launch` at pp 1, 2 and
4 (scripts/pipeline_memory.py says what each rank measures): every rank's resident memory growth
over its own baseline taken before the model exists (the kernel's count between steps, and its
peak) is at most 0.62 x (pp 2) and 0.40 x (pp 4) of the pp 1 run's (see the bound below), and the losses equal pp 1's.
Measured here: between steps 157 MiB at pp 1, 84-85 at pp 2 (0.54), 47-49 at pp 4 (0.31); peaks
473 / 202-210 (0.44) / 120-139 (0.29). The pp > 1 ranks also run their whole step on the same
weights: the losses are equal to the last bit (the same operations on the same values; microbatches
are summed in the same order), checked to 1e-7 relative.

Without delayed initialisation (the model built whole on each rank's host), after the first step a
pp 2 rank holds half the model's parameter storage and every other parameter is meta."""

import json
import subprocess
import sys

from launch_util import ROOT, base_env, run_ranks

SCRIPT = ROOT / "tests/distributed/scripts/pipeline_memory.py"
SIZE = ["--layers", "16", "--width", "1536", "--steps", "3"]


def _launch(pp: int, tmp_path) -> subprocess.Popen:
    options = {"pipeline_parallel_degree": pp, "microbatches": 4, "ddp": True}
    cmd = [sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())", "launch", "--cpu",
           "--launcher", "torchrun", "--nproc-per-node", str(pp), "--job-dir", str(tmp_path / f"job{pp}"),
           "--timeout", "360", "--options", json.dumps(options), str(SCRIPT), "--results", str(tmp_path / f"pp{pp}"),
           *SIZE]
    return subprocess.Popen(cmd, env=base_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _results(tmp_path, pp: int) -> list[dict]:
    return [json.loads((tmp_path / f"pp{pp}" / f"rank{r}.json").read_text()) for r in range(pp)]


def test_delayed_init_pipeline_ranks_hold_their_stage_only(tmp_path):
    # the three jobs at once: memory is counted per process, and the 2 cores are shared anyway
    jobs = {pp: _launch(pp, tmp_path) for pp in (1, 2, 4)}
    for pp, job in jobs.items():
        out, _ = job.communicate(timeout=400)
        assert job.returncode == 0, f"pp {pp}:\n{out[-5000:]}"
    (single,) = _results(tmp_path, 1)
    # the "~0.6 x" and "~0.35 x": measured alone 0.54 and 0.31; in the whole suite's fresh-clone run
    # (two pytest workers) the pp 1 process and the last pp 4 stage both grow ~12 MiB more (0.362 there,
    # twice; cause not found: not the allocator's mmap threshold, not bytecode compilation). Keeping one
    # more stage would add 0.5 / 0.25; held_parameter_bytes below pins one parameter more.
    for pp, bound in ((2, 0.62), (4, 0.40)):
        for r in _results(tmp_path, pp):
            where = f"pp {pp} rank {r['rank']}"
            for got, want in zip(r["losses"], single["losses"]):
                assert abs(got - want) <= 1e-7 * abs(want), f"{where}: losses {r['losses']} != {single['losses']}"
            assert r["held_parameter_bytes"] <= 1.02 * r["model_bytes"] / pp + 2**16, where
            assert r["rss_growth"] <= bound * single["rss_growth"], (where, r, single)
            assert r["peak_rss_growth"] <= bound * single["peak_rss_growth"], (where, r, single)
            assert r["rss_growth_after_wrap"] <= 0.1 * r["model_bytes"], f"{where}: nothing is held before the cut"


def test_without_delayed_init_a_pp2_rank_keeps_half_the_parameters(tmp_path):
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}
    results = run_ranks(SCRIPT, 2, args=["--layers", "8", "--width", "256", "--steps", "2", "--delayed", "0",
                                         "--results", tmp_path], env={"SM_HP_MP_PARAMETERS": json.dumps(options)},
                        out_dir=tmp_path)
    for r in results:
        half = r["model_bytes"] / 2
        assert 0.9 * half <= r["held_parameter_bytes"] <= 1.1 * half, r
