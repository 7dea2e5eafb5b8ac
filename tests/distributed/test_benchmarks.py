"""The benchmark programs, run tiny: they must keep working, and the comparisons they rest on must
hold. No timing is asserted (CI machines are shared; figures live in benchmarks/RESULTS.md), only
what does not depend on speed, nor on how a rank started (their ranks are forked from a job server
that has done the imports: SMP_BENCH_FORK_RANKS, benchmarks/_common.py):

* pipeline.py: smp's pipeline and DeepSpeed's own pipeline engine, same weights and batches, cut the
  MLP into the same stages and give the same loss at every step (an independent reference for PP);
* overhead.py: the adapter and a hand-written DeepSpeed loop give the same losses, and their engine
  configs differ only in DeepSpeed's sample-counting micro batch size;
* checkpoint.py: saving with and without the layout-independent pieces, and resuming each (the
  second under another layout), keep working; so do `--digests`' saves and resumes with and without
  the file digests, hashed either way (as read, on a spare-core thread);
* memory.py: per-rank bytes within the issue's targets (ZeRO-3 and TP within 5 % of the ideal, PP
  stages within 10 %, also with shard_optimizer_state halving each stage's optimizer state);
* launch_overhead.py: its hand-written torch pipelining and FSDP2 jobs give smp's losses through launch;
* gpu_throughput.py --cpu-smoke: the kernel switches' settings run on both sides and --json writes a
  row per side and setting (~15 s of CPU: its device run is too costly to find a broken path in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, *argv, tmp_path: Path, timeout: float = 300) -> dict:
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "OMPI_", "RANK", "LOCAL_", "WORLD_"))}
    env["PYTHONPATH"] = str(ROOT / "adapter")
    env["SMP_BENCH_FORK_RANKS"] = "1"  # ranks forked after the imports (benchmarks/_common.py: _fork_ranks)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *map(str, argv), "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("schedule,held", [("interleaved", [2.0, 1.0]), ("zero_bubble", [2.0, 2.0])])
def test_pipeline_matches_deepspeed_pipeline_engine(tmp_path, schedule, held):
    """smp's 1F1B and ZB-H1 against DeepSpeed's PipelineEngine (1F1B): the same losses; and each rank's
    peak activations, in microbatches, are what the schedule's order keeps between a forward and its
    (weight-)backward at p = 2: 1F1B p - r, ZB-H1 p on every rank (Qi et al. 2023). A step body's
    returned loss holding its microbatch's graph until the step ends made ZB-H1's last rank 3.6."""
    figures = run_benchmark("pipeline", "--model", "mlp", "--pp", 2, "--microbatches", 4, "--steps", 2, "--warmup", 1,
                            "--width", 64, "--layers", 4, "--batch", 32, "--schedule", schedule, tmp_path=tmp_path)
    (f,) = figures
    # 0.05: a rank's microbatch unit is measured on its plain layers, without the loss's own tensors
    assert f["peak_held_microbatches"] == pytest.approx(held, abs=0.05), f["peak_held_microbatches"]
    assert f["same_partition"], (f["smp_parts"], f["deepspeed_parts"])
    assert f["smp_parts"] == [["layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]
    # 1 + warm-up 1 + 2 measured steps per engine, losses compared step by step
    assert f["losses_compared"] == 4
    assert f["loss_max_rel_diff"] <= 1e-6
    assert f["first_loss"] != f["last_loss"]  # the steps did train
    assert 0 < f["median_s"]["smp"] and 0 < f["median_s"]["deepspeed"] and 0 < f["median_s"]["stage"]
    # each rank's compute inside the smp step, its plain stage and the one-way transfer were measured
    assert len(f["busy_ms"]) == len(f["stage_ms"]) == 2 and min(f["busy_ms"] + f["stage_ms"]) > 0
    assert 0 < f["send_recv_ms"] < 1e3 * f["median_s"]["smp"]


def test_pipeline_schedules_side_by_side_gpt(tmp_path):
    """The issue's run: several schedules in one invocation on the GPT-2-style model (embeddings,
    causal attention blocks, LM head): each job's smp losses equal DeepSpeed's PipelineEngine's on the
    same weights and batches (zbv cuts the model into 4 stages in a V, DeepSpeed into 2), and the
    summary compares each schedule with the 1F1B job of its round."""
    figures = run_benchmark("pipeline", "--model", "gpt", "--pp", 2, "--microbatches", 4, "--steps", 1, "--warmup", 0,
                            "--width", 32, "--layers", 4, "--batch", 8, "--seq", 8, "--vocab", 64,
                            "--schedule", "interleaved,zbv", tmp_path=tmp_path)
    assert [f["schedule"] for f in figures] == ["interleaved", "zbv"]
    for f in figures:
        assert f["losses_compared"] == 2 and f["loss_max_rel_diff"] <= 1e-6, f
        assert f["first_loss"] != f["last_loss"]
        assert f["deepspeed_parts"][0][0] == "embed" and f["deepspeed_parts"][-1][-1] == "head"
    # zbv: rank 0 holds the first and the last stage (the V), so the embeddings and the head
    zbv_rank0 = figures[1]["smp_parts"][0]
    assert zbv_rank0[0] == "embed" and zbv_rank0[-1] == "head", figures[1]["smp_parts"]


@pytest.mark.parametrize("mode", ["zero1", "zero3"])
def test_overhead_engines_train_identically(tmp_path, mode):
    figures = run_benchmark("overhead", "--modes", mode, "--no-memory", "--warmup", 1, "--steps", 2, "--repeats", 1,
                            tmp_path=tmp_path)
    t = figures[mode]["timing"]
    assert t["max_rel_loss_diff"] == 0.0
    assert t["config_difference"] == ["train_micro_batch_size_per_gpu: adapter=1 native=2"]
    assert len(t["pair_wall"]) == 2 and all(r > 0 for r in t["pair_wall"])



def test_launch_overhead_hand_written_pipeline_and_fsdp2_train_the_smp_jobs_model(tmp_path):
    """launch_overhead.py's native loops for pp 2 (torch pipelining by hand) and MiCS (FSDP2 by hand) are
    the same jobs as smp's through launch: their losses agree (fp32 rounding: a pipeline's loss scaled
    before backward against torch's gradient scaling after; the last digits of the loss reduction), the
    profile of both sides is recorded, and the jobs step in turns when asked."""
    figures = run_benchmark("launch_overhead", "--sizes", "gpt2_pp2,gpt2_mics", "--rounds", 1, "--warmup", 1,
                            "--steps", 2, "--variants", "smp,native", "--turns", "--profile", 1, tmp_path=tmp_path,
                            timeout=600)
    for size in ("gpt2_pp2", "gpt2_mics"):
        (round_,) = figures[size]["rounds"]
        assert round_["smp_native_loss_rel_diff"] <= 1e-5, (size, round_)
        assert round_["ratios"]["smp/native"] > 0
        assert {"rank 0", "rank 1" if size == "gpt2_pp2" else "rank 3"} == set(figures[size]["profile"])

def test_memory_within_targets(tmp_path):
    # pp2 alone is left to the benchmark itself: pp2_dp2_sos checks the same stages, plus the
    # optimizer state halved by shard_optimizer_state
    figures = run_benchmark("memory", "--cases", "zero3,tp2,pp2_dp2_sos", tmp_path=tmp_path)
    for case, limit in (("zero3", 1.05), ("tp2", 1.05), ("pp2_dp2_sos", 1.10)):
        for category, ratio in figures[case]["ratio"].items():
            assert 0.95 <= ratio <= limit, (case, category, ratio)


def test_checkpoint_saves_and_resumes_both_ways(tmp_path):
    figures = run_benchmark("checkpoint", "--modes", "zero3", "--repeats", 1, "--n-embd", 64, "--n-layer", 1,
                            "--vocab", 512, tmp_path=tmp_path)
    f = figures["zero3"]
    assert f["save_s"]["deepspeed_only"] > 0 and f["save_s"]["with_pieces"] > 0
    assert set(f["resume"]) == {"same", "zero0"}
    assert all(r["s"] > 0 and "anon_per_share" in r for r in f["resume"].values())


@pytest.mark.parametrize("threads", ["0", "1"])
def test_checkpoint_digest_costs_run_both_ways_of_hashing(tmp_path, monkeypatch, threads):
    """`--digests`: saves and resumes with and without the file digests, hashed as read (0) or on a
    spare-core thread (1); the figures name the way the resume hashed."""
    monkeypatch.setenv("SMP_ADAPTER_DIGEST_THREADS", threads)
    figures = run_benchmark("checkpoint", "--digests", "--modes", "dp1", "--repeats", 1, "--n-embd", 64,
                            "--n-layer", 1, "--vocab", 512, tmp_path=tmp_path)
    f = figures["dp1"]
    assert f["hashing_threads"] == int(threads)
    assert all(f["save_s"][k] > 0 for k in ("off", "on")) and all(f["resume_s"][k] > 0 for k in ("off", "on"))
    assert len(f["resume_all"]["on"]) == len(f["resume_all"]["off"]) == 1


def test_gpu_throughput_cpu_smoke_writes_one_row_per_side_and_setting(tmp_path):
    """The GPU benchmark's program on CPU (tiny Llama, one rank): one setting with every switch away
    from its default (compile per block with aot_eager, inductor being tens of seconds on CPU; fused
    AdamW, which torch also has for CPU tensors; activation checkpointing; micro-batch 2): both sides
    run it and --json holds a row per side with the fields the device run's results are read from.
    Without --profile: profiling the compiled step took 118 s of the suite's time on 2 loaded cores
    (15 s without it); the profiler's rows are read on the device run only."""
    out = run_benchmark("gpu_throughput", "--cpu-smoke", "--nprocs", 1, "--compile", "blocks:aot_eager",
                        "--optimizer", "fused", "--checkpointing", "on", "--micro-batch", 2,
                        tmp_path=tmp_path)
    setting = "compile=blocks:aot_eager opt=fused ac=on mb=2"
    assert [(r["setting"], r["side"]) for r in out["rows"]] == [(setting, "adapter"), (setting, "native")]
    for r in out["rows"]:
        assert r["mfu"] is None and r["tokens_per_s"] > 0 and r["per_rank_batch"] == 4  # 2 rows x 2 microbatches
    assert out["meta"]["model"] == "smoke" and out["meta"]["torch"]
