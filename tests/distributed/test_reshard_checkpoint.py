"""Partial checkpoints resumed under another parallel layout (runtime/engines/deepspeed/universal_checkpoint.py): the
ViT script with Adam saves after step 4 at one layout and resumes at another; steps 5-8 must equal
the source run's own steps 5-8 (it ran on uninterrupted). Adam shows lost optimizer state at once
(the step count in the bias correction, the moments in every update).

Global batch 8 in every layout (per-rank batch 8 / data-parallel size), so the runs see the same
samples. Tolerance 1e-5 relative on losses (fp32): the layouts sum gradients in different orders, as
in the data-parallel tests; a lost moment or step count moves step 6's loss by ~5e-2 here."""

import json

import pytest
import torch
from common import tiny_cnn, tiny_vit
from launch_util import ROOT, run_ranks

SCRIPT = ROOT / "tests/distributed/scripts/train_vit.py"
SDP_EXACT = {"sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 0.0}
LAYOUTS = {
    "1 process": ({"ddp": True}, 1),
    "dp 2": ({"ddp": True}, 2),
    "ZeRO-1 2": ({"ddp": True, "shard_optimizer_state": True}, 2),
    "ZeRO-3 2": ({"ddp": True, "sharded_data_parallel_degree": 2, **SDP_EXACT}, 2),
    "ZeRO-3 4": ({"ddp": True, "sharded_data_parallel_degree": 4, **SDP_EXACT}, 4),
    # sdp 2 < rdp 4: smp v1's MiCS (the default engine, FSDP2), or DeepSpeed's ZeRO-3 + hpZ
    "MiCS 2 of 4": ({"ddp": True, "sharded_data_parallel_degree": 2, **SDP_EXACT}, 4),
    "hpZ 2 of 4": ({"ddp": True, "sharded_data_parallel_degree": 2, **SDP_EXACT}, 4),
}
ENGINE_SETTING = {"hpZ 2 of 4": {"SMP_ADAPTER_SDP_ENGINE": "hpz"}}  # the other layouts' engine is their default
# MiCS 2 of 4 -> ZeRO-3 2 (a shrink 4 -> 2) is the elastic-restart test below, through `smp-adapter launch`
PAIRS = [("ZeRO-3 2", "dp 2"), ("ZeRO-1 2", "ZeRO-3 2"), ("ZeRO-3 2", "ZeRO-1 2"), ("1 process", "hpZ 2 of 4"),
         ("MiCS 2 of 4", "ZeRO-3 4"), ("MiCS 2 of 4", "hpZ 2 of 4"), ("MiCS 2 of 4", "dp 2"),
         ("hpZ 2 of 4", "MiCS 2 of 4"), ("ZeRO-3 2", "MiCS 2 of 4")]


@pytest.fixture(scope="module")
def init_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "init.pt"
    torch.save(tiny_vit().state_dict(), path)
    return str(path)


@pytest.fixture(scope="module")
def cnn_init_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("init_cnn") / "init.pt"
    torch.save(tiny_cnn().state_dict(), path)
    return str(path)


def _run(layout, out, init_weights, *args, model="vit"):
    options, nprocs = LAYOUTS[layout]
    return run_ranks(SCRIPT, nprocs, out_dir=out,
                     env={"SM_HP_MP_PARAMETERS": json.dumps(options), **ENGINE_SETTING.get(layout, {})},
                     args=["--model", model, "--init-weights", init_weights, "--optimizer", "adam", "--lr", "1e-3",
                           "--per-rank-batch", 8 // nprocs, *args])


@pytest.fixture(scope="module")
def saved(tmp_path_factory, init_weights, cnn_init_weights):
    """Each source layout (and model) once: 8 uninterrupted steps, a partial checkpoint after step 4."""
    cache = {}

    def get(layout, model="vit"):
        if (layout, model) not in cache:
            root = tmp_path_factory.mktemp(f"{model}_{layout.replace(' ', '_')}")
            weights = cnn_init_weights if model == "cnn" else init_weights
            full = _run(layout, root / "run", weights, "--steps", 8, "--save-at", 4, "--ckpt-dir", root / "ckpt",
                        model=model)
            cache[(layout, model)] = (root / "ckpt", full[0]["losses"], full[0])
        return cache[(layout, model)]

    return get


@pytest.mark.parametrize("source, target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resume_under_another_layout_continues_the_run(tmp_path, saved, init_weights, source, target):
    ckpt, uninterrupted, _ = saved(source)
    resumed = _run(target, tmp_path, init_weights, "--steps", 4, "--first-step", 4, "--resume", "--ckpt-dir", ckpt)
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(uninterrupted[4:]), rtol=1e-5,
                               atol=1e-6)
    for r in resumed:  # every rank of the new layout agrees
        assert r["losses"] == resumed[0]["losses"]


# BatchNorm normalizes over each data-parallel rank's own rows (smp v1 and DDP alike, without
# SyncBatchNorm), so a change of dp size changes what the net computes, checkpoint or not: these
# pairs keep dp 2 and change how parameters and optimizer state are partitioned.
CNN_PAIRS = [("ZeRO-3 2", "ZeRO-1 2"), ("dp 2", "ZeRO-3 2")]


@pytest.mark.parametrize("source, target", CNN_PAIRS, ids=[f"{a}->{b}" for a, b in CNN_PAIRS])
def test_conv_net_resumes_under_another_layout(tmp_path, saved, cnn_init_weights, source, target):
    """A conv net with BatchNorm: 4-D weights cut across ZeRO partitions, and persistent buffers
    (rank 0's running statistics come back: after 4 + 4 steps they equal the uninterrupted run's)."""
    ckpt, uninterrupted, source_rank0 = saved(source, "cnn")
    resumed = _run(target, tmp_path, cnn_init_weights, "--steps", 4, "--first-step", 4, "--resume", "--ckpt-dir", ckpt,
                   model="cnn")
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(uninterrupted[4:]), rtol=1e-5,
                               atol=1e-6)
    buffers = resumed[0]["buffers"]
    assert buffers["features.1.num_batches_tracked"] == 8 and set(buffers) == set(source_rank0["buffers"])
    for name, values in source_rank0["buffers"].items():
        torch.testing.assert_close(torch.tensor(buffers[name]), torch.tensor(values), rtol=1e-5, atol=1e-6, msg=name)


FROZEN_PAIRS = [("ZeRO-3 2", "ZeRO-1 2")]


@pytest.mark.parametrize("source, target", FROZEN_PAIRS, ids=[f"{a}->{b}" for a, b in FROZEN_PAIRS])
def test_frozen_parameters_resume_under_another_layout(tmp_path, saved, init_weights, source, target):
    """The ViT with its embeddings frozen (requires_grad False, as fine-tunes freeze layers): frozen
    parameters have no fp32 master and no optimizer state in DeepSpeed; their values still travel."""
    ckpt, uninterrupted, _ = saved(source, "vit-frozen")
    resumed = _run(target, tmp_path, init_weights, "--steps", 4, "--first-step", 4, "--resume", "--ckpt-dir", ckpt,
                   model="vit-frozen")
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(uninterrupted[4:]), rtol=1e-5,
                               atol=1e-6)


TP_SCRIPT = ROOT / "tests/distributed/scripts/train_tp.py"
TP_LAYOUTS = {"1 process": ({"ddp": True}, 1, 8), "tp 2": ({"ddp": True, "tensor_parallel_degree": 2}, 2, 4),
              "tp 2 x dp 2": ({"ddp": True, "tensor_parallel_degree": 2}, 4, 2),
              # sdp with tp needs prescaled_batch: the batch is read per RDP rank, 2 readers of 4
              "tp 2 x ZeRO-3 2": ({"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2,
                                   "prescaled_batch": True, **SDP_EXACT}, 4, 4)}
TP_PAIRS = [("tp 2", "1 process"), ("1 process", "tp 2 x dp 2"), ("tp 2 x dp 2", "tp 2 x ZeRO-3 2"),
            ("tp 2 x ZeRO-3 2", "tp 2")]


def _run_gpt2(layout, out, *args):
    """Tiny GPT-2 under smp.tensor_parallelism with Adam; per-rank batch = 8 / readers (global 8;
    readers: the dp ranks, or the rdp ranks with prescaled_batch)."""
    options, nprocs, per_rank = TP_LAYOUTS[layout]
    return run_ranks(TP_SCRIPT, nprocs, out_dir=out, env={"SM_HP_MP_PARAMETERS": json.dumps(options)},
                     args=["--model", "gpt2", "--optimizer", "adam", "--per-rank-batch", per_rank, *args])


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    """Each GPT-2 source layout once: 8 uninterrupted steps, a partial checkpoint after step 4."""
    cache = {}

    def get(layout):
        if layout not in cache:
            root = tmp_path_factory.mktemp(f"gpt2_{layout.replace(' ', '_')}")
            full = _run_gpt2(layout, root / "run", "--steps", 8, "--save-at", 4, "--ckpt-dir", root / "ckpt")
            cache[layout] = (root / "ckpt", full[0]["losses"], full[0]["saved_state"])
        return cache[layout]

    return get


@pytest.mark.parametrize("source, target", TP_PAIRS, ids=[f"{a}->{b}" for a, b in TP_PAIRS])
def test_resume_under_another_tensor_parallel_layout(tmp_path, saved_gpt2, source, target):
    """A change of tp degree (each TP shard rebuilt through the full tensor, fused q|k|v and
    GPT-2's transposed Conv1D weights included), also combined with a change of ZeRO stage."""
    ckpt, losses, _ = saved_gpt2(source)
    full = [{"losses": losses}]
    resumed = _run_gpt2(target, tmp_path / "resumed", "--steps", 4, "--first-step", 4, "--resume", "--ckpt-dir", ckpt)
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(full[0]["losses"][4:]), rtol=1e-5,
                               atol=1e-6)



@pytest.mark.parametrize("layout", sorted({source for source, _ in TP_PAIRS}))
def test_export_of_every_tensor_parallel_layout_equals_its_state_dict(tmp_path, saved_gpt2, layout):
    """`smp-adapter checkpoint export --to hf` (no process group) of the GPT-2 checkpoints the TP pairs
    resume (1 process, tp 2, tp 2 x dp 2, tp 2 x ZeRO-3 2): from_pretrained loads it, and every tensor
    equals the run's gathered model.state_dict() at the save bitwise (TP shards joined, fused q|k|v
    and GPT-2's transposed Conv1D included)."""
    from transformers import GPT2LMHeadModel

    from smp_adapter.cli import main

    ckpt, _, saved_state = saved_gpt2(layout)
    out = tmp_path / "hf"
    assert main(["checkpoint", "inspect", str(ckpt), "--json"]) == 0
    assert main(["checkpoint", "export", str(ckpt), "--to", "hf", str(out)]) == 0
    exported = GPT2LMHeadModel.from_pretrained(out).state_dict()
    for name, values in saved_state.items():
        assert torch.equal(exported[name], torch.tensor(values)), name


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "ZeRO-3 4"])  # (a resume target only)
def test_export_of_every_data_parallel_layout_equals_its_state_dict(tmp_path, saved, layout):
    """`checkpoint export --to hf` of the ViT checkpoints the pairs above resume (1 process, dp 2,
    ZeRO-1 2, ZeRO-3 2, MiCS 2 of 4, hpZ 2 of 4): bitwise the gathered model.state_dict() at the save."""
    from transformers import ViTForImageClassification

    from smp_adapter.cli import main

    ckpt, _, rank0 = saved(layout)
    assert main(["checkpoint", "export", str(ckpt), "--to", "hf", str(tmp_path / "hf")]) == 0
    exported = ViTForImageClassification.from_pretrained(tmp_path / "hf").state_dict()
    assert set(rank0["saved_state"]) <= set(exported)
    for name, values in rank0["saved_state"].items():
        assert torch.equal(exported[name], torch.tensor(values)), name


def test_reshard_command_output_resumes_from_its_pieces_alone(tmp_path, saved, init_weights):
    """`checkpoint reshard` of the ZeRO-3 2 ViT checkpoint for 1 process: the rewritten checkpoint holds
    no DeepSpeed files, and the 1-process job resumes it and continues the source run."""
    from smp_adapter.cli import main

    ckpt, uninterrupted, _ = saved("ZeRO-3 2")
    out = tmp_path / "resharded"
    assert main(["checkpoint", "reshard", str(ckpt), "--to", json.dumps({"ddp": True}), "--world-size", "1",
                 str(out)]) == 0
    folder = out / "step4_partial"
    assert sorted(p.name for p in folder.iterdir()) == ["smp_manifest.json", "universal", "user_content.pt"]
    assert json.loads((folder / "smp_manifest.json").read_text())["layout"]["world_size"] == 1
    resumed = _run("1 process", tmp_path / "run", init_weights, "--steps", 4, "--first-step", 4, "--resume",
                   "--ckpt-dir", out)
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(uninterrupted[4:]), rtol=1e-5,
                               atol=1e-6)


def test_reshard_command_cuts_tensor_parallel_shards_per_target_rank(tmp_path, saved_gpt2):
    """tp 2 GPT-2 -> `reshard --to tp 2 --world-size 4`: one file per target TP rank with its shards;
    the tp 2 x dp 2 job resumes it and continues the source run."""
    from safetensors import safe_open

    from smp_adapter.cli import main

    (ckpt, losses, _), out = saved_gpt2("tp 2"), tmp_path / "resharded"
    options, _, _ = TP_LAYOUTS["tp 2 x dp 2"]
    assert main(["checkpoint", "reshard", str(ckpt), "--to", json.dumps(options), "--world-size", "4", str(out)]) == 0
    for t in (0, 1):
        with safe_open(str(out / "step4_partial" / "universal" / f"tp{t}.safetensors"), "pt") as f:
            split = [e for e in json.loads(f.metadata()["index"]) if e["layout"] is not None]
            assert split and all(e["tp_rank"] == t and e["tp_size"] == 2 for e in split)
    resumed = _run_gpt2("tp 2 x dp 2", tmp_path / "resumed", "--steps", 4, "--first-step", 4, "--resume",
                        "--ckpt-dir", out)
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(losses[4:]), rtol=1e-5, atol=1e-6)
    # the rewritten pieces keep the tensors' shapes: both checkpoints export to the same model
    from safetensors.torch import load_file

    assert main(["checkpoint", "export", str(ckpt), "--to", "hf", str(tmp_path / "hf_source")]) == 0
    assert main(["checkpoint", "export", str(out), "--to", "hf", str(tmp_path / "hf_resharded")]) == 0
    source, rewritten = (load_file(tmp_path / d / "model.safetensors") for d in ("hf_source", "hf_resharded"))
    assert set(source) == set(rewritten)
    for name in source:
        assert torch.equal(source[name], rewritten[name]), name


def test_checkpoint_commands_refuse_what_they_cannot_read(tmp_path, capsys):
    from smp_adapter.cli import main

    assert main(["checkpoint", "inspect", str(tmp_path)]) == 2
    assert "is not a complete smp-adapter partial checkpoint (no smp_manifest.json): give the <tag>_partial " \
           "directory" in capsys.readouterr().err
    (tmp_path / "t_partial").mkdir()
    (tmp_path / "t_partial" / "smp_manifest.json").write_text(json.dumps({"tag": "t", "layout": {"pp": 2}}))
    assert main(["checkpoint", "export", str(tmp_path / "t_partial"), "--to", "hf", str(tmp_path / "o")]) == 2
    assert "has no layout-independent pieces (saved by an older smp-adapter or with " \
           "SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS=0)" in capsys.readouterr().err
    reshard = ["checkpoint", "reshard", str(tmp_path / "t_partial"), "--world-size", "2", str(tmp_path / "o")]
    assert main([*reshard, "--to", json.dumps({"ddp": True, "sharded_data_parallel_degree": 4})]) == 2
    assert "sharded_data_parallel_degree = 4: must divide the number of model replicas" in capsys.readouterr().err
    assert main([*reshard, "--to", json.dumps({"ddp": True})]) == 2
    assert "has no layout-independent pieces (saved by an older smp-adapter or with " \
           "SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS=0): nothing to reshard it from" in capsys.readouterr().err


def _launch(nprocs: int, options: dict, out, *script_args) -> tuple[int, str]:
    """``smp-adapter launch --cpu --nproc-per-node N --options ... train_vit.py ARGS``: the command a user
    runs; returns its exit code and output."""
    from launch_util import start_cli

    out.mkdir(parents=True)
    proc = start_cli("launch", "--launcher", "torchrun", "--cpu", "--nproc-per-node", nprocs, "--job-dir", out / "job",
                     "--options", json.dumps(options), SCRIPT, *script_args, cwd=out, env={"SMP_TEST_OUT": str(out)})
    stdout, stderr = proc.communicate(timeout=240)
    return proc.returncode, stdout + stderr


def test_elastic_restart_on_fewer_ranks_after_a_rank_dies(tmp_path, saved, init_weights):
    """docs/checkpoints.md "Elastic restart": a 4-rank MiCS job (sdp 2) checkpoints after step 4 and loses
    rank 3 at step 6; the same launch command on 2 ranks (now plain ZeRO-3 2) with the script's own
    resume continues it: steps 5-8 equal the 4-rank job run uninterrupted."""
    _, uninterrupted, _ = saved("MiCS 2 of 4")
    options, ckpt = LAYOUTS["MiCS 2 of 4"][0], tmp_path / "ckpt"
    script = ["--init-weights", init_weights, "--optimizer", "adam", "--lr", "1e-3", "--ckpt-dir", ckpt]
    code, output = _launch(4, options, tmp_path / "died", *script, "--per-rank-batch", 2, "--steps", 8,
                           "--save-at", 4, "--raise-at-step", 6, "--raise-rank", 3)
    assert code != 0 and "injected failure in rank 3 at step 6" in output, output[-3000:]
    assert (ckpt / "newest").read_text().strip() == "step4"
    code, output = _launch(2, options, tmp_path / "resumed", *script, "--per-rank-batch", 4, "--steps", 4,
                           "--first-step", 4, "--resume")
    assert code == 0, output[-3000:]
    resumed = json.loads((tmp_path / "resumed" / "rank0.json").read_text())
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(uninterrupted[4:]), rtol=1e-5, atol=1e-6)


PP_SCRIPT = ROOT / "tests/distributed/scripts/train_pp.py"
MB = {"ddp": True, "microbatches": 2}  # every layout runs 2 microbatches: the same arithmetic
PP_LAYOUTS = {"1 process": (MB, 1), "tp 2": ({**MB, "tensor_parallel_degree": 2}, 2),
              "ZeRO-3 2": ({**MB, "sharded_data_parallel_degree": 2, **SDP_EXACT}, 2),
              "pp 2": ({**MB, "pipeline_parallel_degree": 2}, 2),
              "pp 2 x tp 2": ({**MB, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, 4),
              "pp 2 x dp 2 ZeRO-1": ({**MB, "pipeline_parallel_degree": 2, "shard_optimizer_state": True}, 4)}
PP_PAIRS = [("pp 2 x tp 2", "tp 2", "gpt2"), ("pp 2 x dp 2 ZeRO-1", "ZeRO-3 2", "gpt2"),
            ("pp 2 x tp 2", "1 process", "net")]


def _run_pp_script(layout, out, model, *args):
    """train_pp.py (GPT-2 with tied embeddings, or the seed's conv net) with Adam; global batch 8.
    smp's dp size counts TP ranks too (without prescaled_batch each TP rank reads its own rows, and a
    TP layer joins them): per-rank batch = 8 / (world / pp)."""
    options, nprocs = PP_LAYOUTS[layout]
    dp = nprocs // options.get("pipeline_parallel_degree", 1)
    return run_ranks(PP_SCRIPT, nprocs, out_dir=out, env={"SM_HP_MP_PARAMETERS": json.dumps(options)},
                     args=["--model", model, "--optimizer", "adam", "--per-rank-batch", 8 // dp, *args])


@pytest.mark.parametrize("source, target, model", PP_PAIRS, ids=[f"{a}->{b} ({m})" for a, b, m in PP_PAIRS])
def test_pipeline_checkpoint_resumes_without_pipeline(tmp_path, source, target, model):
    """A pipeline job's partial checkpoint resumed by a job with pp = 1: stages, GPT-2's embedding tied
    to the LM head over the first and last stage, optimizer state sharded over a stage's replicas, and
    a TP-split layer inside a stage (the seed's conv net marks fc1 for tensor parallelism; train_pp.py
    does not mark GPT-2, so its layers are replicated over the TP ranks there).
    GPT-2's checkpoint also exports (`checkpoint export --to hf`) to the state dict gathered at the
    save, bitwise, and from_pretrained loads it. The index points into the stage files."""
    from transformers import GPT2LMHeadModel

    from smp_adapter.cli import main

    ckpt = tmp_path / "ckpt"
    full = _run_pp_script(source, tmp_path / "full", model, "--steps", 8, "--save-at", 4, "--ckpt-dir", ckpt,
                          "--final-state")
    _assert_index_points_into_the_stage_files(ckpt / "step4_partial")
    if model == "gpt2":
        assert main(["checkpoint", "export", str(ckpt), "--to", "hf", str(tmp_path / "hf")]) == 0
        exported = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()
        for name, values in full[0]["saved_state"].items():
            assert torch.equal(exported[name], torch.tensor(values)), name
    resumed = _run_pp_script(target, tmp_path / "resumed", model, "--steps", 4, "--first-step", 4, "--resume",
                             "--ckpt-dir", ckpt)
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(full[0]["losses"][4:]), rtol=1e-5,
                               atol=1e-6)


def _assert_index_points_into_the_stage_files(folder):
    """Saving writes no value twice: every piece but the buffers is a reference into the stage or
    optimizer files the pipeline engine has just written."""
    from safetensors import safe_open

    for path in (folder / "universal").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            index = json.loads(handle.metadata()["index"])
        assert all("ref" in e and e["ref"]["file"].startswith(("stage_pp", "optimizer_pp"))
                   for e in index if e["kind"] != "buffer"), path


INTO_PP_PAIRS = [("ZeRO-3 2", "pp 2 x dp 2 ZeRO-1", "gpt2"), ("pp 2 x tp 2", "pp 2", "net")]


@pytest.mark.parametrize("source, target, model", INTO_PP_PAIRS, ids=[f"{a}->{b} ({m})" for a, b, m in INTO_PP_PAIRS])
def test_checkpoint_resumes_into_a_pipeline_layout(tmp_path, source, target, model):
    """Resume *into* pp > 1: the model's values are set before the stages are cut (the first step),
    the optimizer state at the first optimizer step, on the rank that steps each parameter:
    GPT-2 from ZeRO-3 (flat fp32 partitions) into two stages with tied embeddings whose optimizer
    state is sharded over the stage's two replicas; the conv net from pp 2 x tp 2 (fc1 split) to
    pp 2 (fc1 whole), through `smp-adapter checkpoint reshard` (its output holds pieces only)."""
    from smp_adapter.cli import main

    ckpt = tmp_path / "ckpt"
    full = _run_pp_script(source, tmp_path / "full", model, "--steps", 8, "--save-at", 4, "--ckpt-dir", ckpt)
    if model == "net":
        options, nprocs = PP_LAYOUTS[target]
        assert main(["checkpoint", "reshard", str(ckpt / "step4_partial"), "--to", json.dumps(options),
                     "--world-size", str(nprocs), str(tmp_path / "resharded")]) == 0
        ckpt = tmp_path / "resharded"
    resumed = _run_pp_script(target, tmp_path / "resumed", model, "--steps", 4, "--first-step", 4, "--resume",
                             "--ckpt-dir", ckpt)
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(full[0]["losses"][4:]), rtol=1e-5,
                               atol=1e-6)
    if "ZeRO-1" in target:  # each parameter's state on exactly one replica of its stage
        for stage in (0, 1):
            ranks = [r for r in resumed if r["pp_rank"] == stage]
            names = [set(r["state_names"]) for r in ranks]
            assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(ranks[0]["local_names"])


def test_fp16_dynamic_loss_scale_continues_under_another_layout(tmp_path):
    """An fp16 pipeline job whose dynamic loss scale fell from 2^24 by overflows in its first steps
    resumes at pp 2 x dp 2: the scale (and the iterations since the last overflow) continue, so the
    resumed steps neither overflow again nor start from the initial scale. Tolerance 2e-3 relative:
    fp16 activations, gradients averaged over another number of ranks."""
    fp16 = {"fp16": True}
    layouts = {"pp 2": ({**MB, "pipeline_parallel_degree": 2, **fp16}, 2),
               "pp 2 x dp 2": ({**MB, "pipeline_parallel_degree": 2, **fp16}, 4)}
    ckpt, scale = tmp_path / "ckpt", ["--loss-scale", f"dynamic:{2.0**24}"]

    def run(layout, out, *args):
        options, nprocs = layouts[layout]
        return run_ranks(PP_SCRIPT, nprocs, out_dir=out, env={"SM_HP_MP_PARAMETERS": json.dumps(options)},
                         args=["--model", "six", "--optimizer", "adam", "--per-rank-batch", 8 // (nprocs // 2),
                               *scale, *args])

    full = run("pp 2", tmp_path / "full", "--steps", 8, "--save-at", 4, "--ckpt-dir", ckpt)[0]
    assert full["overflows"][0] and full["scales"][4] < 2.0**24  # the scale moved before the checkpoint
    _assert_index_points_into_the_stage_files(ckpt / "step4_partial")  # fp32 masters included
    resumed = run("pp 2 x dp 2", tmp_path / "resumed", "--steps", 4, "--first-step", 4, "--resume",
                  "--ckpt-dir", ckpt)[0]
    assert resumed["scales"] == full["scales"][4:] and resumed["overflows"] == full["overflows"][4:]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][4:]), rtol=2e-3,
                               atol=0.0)
