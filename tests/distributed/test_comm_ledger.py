"""The communication ledger (ledger/record.py) against an independent count of the same
traffic: scripts/ledger_job.py wraps torch.distributed's functions itself (its own payload rules)
before smp.init installs the ledger, and counts per training step. One job per layout: data
parallel, ZeRO-1, ZeRO-3, hpZ, tensor parallel, pipeline parallel and TP x PP, a tiny GPT-2, Adam
(ZeRO-3, hpZ and the pipeline: a second job with activation checkpointing, see CHECKPOINTING).
The same jobs check `smp-adapter plan`'s bytes per step (5%; ZeRO-3's calls of its gathers and
reduce-scatters too) and memory (10%) against the ledger and the measured peak of live tensor bytes
(check_plan).

Tolerance: 1% on bytes per step and op (the issue's bound); calls must be equal. Both counts see
the same calls, so in practice they agree exactly; the margin is for nothing but rounding.
"""

import json

import pytest
from launch_util import ROOT, run_ranks

from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.options import SMPConfig
from smp_adapter.plan import costs
from smp_adapter.plan.accuracy import compare, cpu_cluster, ledger_bytes_per_group, plan_bytes_per_group
from smp_adapter.plan.model_spec import model_spec

SCRIPT = ROOT / "tests/distributed/scripts/ledger_job.py"
GPT2 = {"vocab_size": 64, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
ZERO3 = {"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}
LIVE = 12704  # the elements of one block of GPT2 above: 2 LayerNorms (4 x 32), c_attn 32 x 96 + 96, attn c_proj
# 32 x 32 + 32, c_fc 32 x 128 + 128, mlp c_proj 128 x 32 + 32
LAYOUTS = {  # name -> (smp options, processes)
    "ddp": ({"ddp": True}, 2),
    "zero1": ({"ddp": True, "shard_optimizer_state": True}, 2),
    # persistence threshold 0: every parameter is gathered for use (the tiny model's tensors are all
    # below the 1e6-element default, which would leave ZeRO-3 nothing to gather)
    "zero3": ({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}, 2),
    "zero3_ac": ({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}, 2),
    "hpz": ({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}, 4),
    "hpz_ac": ({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}, 4),
    # sdp_max_live_parameters one block of the tiny GPT-2 (LIVE: 12704 elements, 45% of the model's 28032)
    # sets DeepSpeed's reuse distance and its live bound: the first block and the embeddings come back
    # in backward after more elements of the trace than that, so they are released after their forward
    # and gathered again; what lies within reach of the turn to backward (ln_f, the tied head, most of
    # the last block) stays. The tied wte is gathered three times a step (embedding, head, embedding's
    # backward); in the _ac jobs each block's recompute is a third use of its parameters (216192 B of
    # gathers a step against 194304: plan/zero3.py)
    "zero3_live": ({**ZERO3, "sdp_max_live_parameters": LIVE}, 2),
    "zero3_live_ac": ({**ZERO3, "sdp_max_live_parameters": LIVE}, 2),
    "hpz_live": ({**ZERO3, "sdp_max_live_parameters": LIVE}, 4),
    "hpz_live_ac": ({**ZERO3, "sdp_max_live_parameters": LIVE}, 4),
    "mics": ({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}, 4),
    "tp2": ({"ddp": True, "tensor_parallel_degree": 2}, 2),
    "pp2": ({"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2}, 2),
    "pp2_ac": ({"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2}, 2),
    # prescaled_batch (the AWS templates' setting): without it the TP ranks exchange their rows inside the
    # stages torch.export traces, and export maps torch.distributed's functions to functional collectives
    # by identity: with them wrapped (the ledger, this count) it does not recognise them and fails
    "tp2xpp2": ({"ddp": True, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
                 "prescaled_batch": True}, 4),
    "tp2xpp2_ac": ({"ddp": True, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
                    "prescaled_batch": True}, 4),
}
STEPS = 4  # the first step holds one-time traffic; the plan is checked against later ones
# Plan is checked with and without activation checkpointing, in one job where it can be: ddp, ZeRO-1
# and tp2 turn it on before step 2, so step 1 runs without and step 3 with (the ledger and the memory
# are per step). ZeRO-3 cannot: it records the order its parameters are used in during the first
# steps, and a recompute appearing later makes it gather everything again in every later step (step 3
# moved 421392 B, not 224256), which no job with checkpointing from the start does: zero3 and hpz
# (ZeRO-3 with hpZ) run without it, zero3_ac and hpz_ac with it from the start. The pipeline engine
# applies it when it cuts the stages, at the first step: pp2 never, pp2_ac from the start. With
# checkpointing ZeRO-3 gathers again for the recompute (when it released the parameters) and TP's
# recompute repeats its exchanges.
CHECKPOINTING = {"zero3": "never", "zero3_ac": "always", "hpz": "never", "hpz_ac": "always", "zero3_live": "never",
                 "zero3_live_ac": "always", "hpz_live": "never", "hpz_live_ac": "always", "pp2": "never",
                 "pp2_ac": "always", "tp2xpp2": "never", "tp2xpp2_ac": "always"}
CHECKPOINT_FROM = 2  # the others: "from" this step


def checkpointed(name: str, step: int) -> bool:
    mode = CHECKPOINTING.get(name, "from")
    return mode == "always" or (mode == "from" and step >= CHECKPOINT_FROM)


def plan_steps(name: str) -> tuple:
    return (1, 3) if CHECKPOINTING.get(name, "from") == "from" else (1,)


def job_args(name: str) -> list:
    mode = CHECKPOINTING.get(name, "from")
    ac = {"always": ["--checkpoint-activations"], "never": [],
          "from": ["--checkpoint-activations-from", CHECKPOINT_FROM]}[mode]
    return ac + ["--track-memory", ",".join(map(str, plan_steps(name)))]


# plan's memory against the peak of live tensor bytes the job measured (scripts/live_tensor_bytes.py)
# in the checked steps, the largest rank (plan predicts the largest rank: the pipeline's last stage holds
# the head, under checkpointing more than stage 0). Tolerance 10% (the bound). Why it holds and
# what the error is made of (docs/plan.md): plan counts every gradient alongside every activation, the
# run frees a layer's activations as its gradients appear (over by up to the gradients' share: +8.5%
# for ddp); backward's temporaries (the logits' gradients) and small buffers (the pipeline's receive
# buffers) are not counted (under by a few %).
MEMORY_TOLERANCE = 0.10


def sdp_engine(name: str) -> str:
    """sdp 2 of 4 runs on MiCS (the default) or, for the hpz layouts, on DeepSpeed's ZeRO-3 + hpZ."""
    return "hpz" if name.startswith("hpz") else "mics"


def run_layout(tmp_path, name):
    options, nprocs = LAYOUTS[name]
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps(GPT2))
    ledger = tmp_path / "ledger"
    results = run_ranks(SCRIPT, nprocs, args=["--config", config, "--steps", STEPS, *job_args(name)], out_dir=tmp_path,
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options), "SMP_ADAPTER_COMM_LEDGER": str(ledger),
                             "SMP_ADAPTER_SDP_ENGINE": sdp_engine(name)})
    records = {r: [json.loads(line) for line in (ledger / f"rank{r}.jsonl").read_text().splitlines()]
               for r in range(nprocs)}
    return results, records


def by_op(ops):
    out = {}
    for o in ops:
        calls, nbytes = out.get(o["op"], (0, 0))
        out[o["op"]] = (calls + o["calls"], nbytes + o["bytes"])
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ledger_equals_an_independent_count(tmp_path, name):
    results, records = run_layout(tmp_path, name)
    if LAYOUTS[name][0].get("pipeline_parallel_degree", 1) == 1:  # the initial broadcasts (the pipeline
        # engine sets its stages up in the first step)
        assert all(any(r["step"] is None and r["phase"] == "init" for r in rows) for rows in records.values())
    for result in results:
        rank = result["rank"]
        # the job's last call, smp.barrier() after the steps, is on disk although the rank ends with
        # os._exit (the test launcher forks ranks): no atexit flush is needed
        assert records[rank][-1]["phase"] == "between_steps", records[rank][-1]
        assert any(o["op"] == "barrier" for o in records[rank][-1]["ops"]), records[rank][-1]
        steps = [r for r in records[rank] if r["step"] is not None]
        assert [r["step"] for r in steps] == list(range(STEPS))
        for step, (record, counted) in enumerate(zip(steps, result["per_step"])):
            ledger = {op: v for op, v in by_op(record["ops"]).items() if op != "barrier"}
            counted = {op: tuple(v) for op, v in counted.items()}
            assert set(ledger) == set(counted), (name, rank, step, ledger, counted)
            for op, (calls, nbytes) in counted.items():
                print(f"{name} rank {rank} step {step} {op}: ledger {ledger[op]} counted {(calls, nbytes)}")
                assert ledger[op][0] == calls
                assert ledger[op][1] == pytest.approx(nbytes, rel=0.01)
            assert sum(v[1] for v in ledger.values()) > 0  # every layout moves bytes every step
            for o in record["ops"]:  # one node here (LOCAL_WORLD_SIZE = all ranks)
                assert o["intra_node"] is True and o["group"] != "other", o
            if LAYOUTS[name][0].get("pipeline_parallel_degree", 1) > 1:  # the rank's schedule time and its
                # compute part, for the idle fraction (runtime/engines/pipeline/idle_time.py)
                timing = record["pipeline"]
                assert 0 < timing["busy_s"] < timing["wall_s"], timing
                assert timing["schedule"] == "interleaved" and timing["bubble"] == "(2-1)(F+B)"

    for step in plan_steps(name):
        check_plan(name, step, results, records)


def check_plan(name, step, results, records):
    """plan's prediction for the largest rank against the job's step ``step``: bytes per group of rank 0
    (pipeline stage 0, which plan's traffic describes) within 5%, memory within MEMORY_TOLERANCE."""
    options, nprocs = LAYOUTS[name]
    ac = checkpointed(name, step)
    dims = ParallelDims.from_config(SMPConfig.from_dict(options), nprocs, sdp_engine(name))
    predicted = costs.plan(model_spec(dict(GPT2, model_type="gpt2")), dims, cpu_cluster(nprocs),
                           costs.Job(4, activation_checkpointing=ac))
    tag = f"{name} step {step}{' checkpointed' if ac else ''}"
    ledger = [r for r in records[0] if r["step"] == step]
    rows = compare(ledger_bytes_per_group(ledger, skip_first=False), plan_bytes_per_group(predicted))
    for group, (measured, planned, error) in rows.items():
        print(f"{tag} {group}: ledger {measured:.0f} B/step, plan {planned:.0f} B/step ({error:+.1%})")
        assert abs(error) <= 0.05, (tag, group, measured, planned)
    if dims.zero_stage == 3 and dims.mics_group_size == 1:  # ZeRO-3's calls too, of the ops plan counts
        # (its gathers and reduce-scatters; not DeepSpeed's overflow scalar nor smp's small broadcasts)
        ops = {(t.group, t.op) for t in predicted.comm}
        kept = [dict(r, ops=[o for o in r["ops"] if (o["group"], o["op"]) in ops]) for r in ledger]
        rows = compare(ledger_bytes_per_group(kept, skip_first=False, quantity="calls"),
                       plan_bytes_per_group(predicted, "calls"))
        for group, (measured, planned, error) in rows.items():
            print(f"{tag} {group}: ledger {measured:.0f} calls/step, plan {planned:.0f} calls/step ({error:+.1%})")
            assert abs(error) <= 0.05, (tag, "calls", group, measured, planned)

    measured = max(r["memory"]["peak_live_bytes"][str(step)] for r in results)
    error = (predicted.tensor_bytes - measured) / measured
    # ZeRO-1/3 allocate DeepSpeed's whole reduce bucket (2 GB at the default): the rest is checked on its own too
    bucket = predicted.memory.get("gradient_buckets", 0) if predicted.overlap == 0 else 0
    rest_error = (predicted.tensor_bytes - measured) / (measured - bucket)
    print(f"{tag} memory: measured peak {measured} B, plan {predicted.tensor_bytes} B ({error:+.1%}; "
          f"without the reduce bucket {rest_error:+.1%})")
    assert abs(error) <= MEMORY_TOLERANCE and abs(rest_error) <= MEMORY_TOLERANCE, (tag, predicted.memory)


def test_pipeline_x_tensor_parallel_without_prescaled_batch_names_the_ledger(tmp_path):
    """Without prescaled_batch the TP exchanges run inside the traced stages, and torch.export cannot
    trace them through the ledger's counting wrappers: the error must name the ledger and the two ways
    out, not blame the model (it said "make its forward traceable ... use_cache=False")."""
    options = dict(LAYOUTS["tp2xpp2"][0], prescaled_batch=False)
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps(GPT2))
    with pytest.raises(AssertionError) as failed:
        run_ranks(SCRIPT, 4, args=["--config", config, "--steps", 1], out_dir=tmp_path,
                  env={"SM_HP_MP_PARAMETERS": json.dumps(options), "SMP_ADAPTER_COMM_LEDGER": str(tmp_path / "ledger")})
    message = str(failed.value)
    assert ("UnsupportedFeatureError: pipeline parallelism could not split GPT2LMHeadModel while the communication "
            "ledger is on (SMP_ADAPTER_COMM_LEDGER): torch.export cannot trace the tensor-parallel exchanges") in message
    assert "Run this layout without the ledger (unset the variable, no --comm-ledger), or with prescaled_batch: true" in message
