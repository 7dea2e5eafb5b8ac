"""Partial checkpoints resumed under another parallel layout (runtime/universal_checkpoint.py): the
ViT script with Adam saves after step 4 at one layout and resumes at another; steps 5-8 must equal
the source run's own steps 5-8 (it ran on uninterrupted). Adam shows lost optimizer state at once
(the step count in the bias correction, the moments in every update).

Global batch 8 in every layout (per-rank batch 8 / data-parallel size), so the runs see the same
samples. Tolerance 1e-5 relative on losses (fp32): the layouts sum gradients in different orders, as
in the data-parallel tests; a lost moment or step count moves step 6's loss by ~5e-2 here."""

import json

import pytest
import torch
from common import tiny_vit
from launch_util import ROOT, run_ranks

SCRIPT = ROOT / "tests/distributed/scripts/train_vit.py"
SDP_EXACT = {"sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 0.0}
LAYOUTS = {
    "1 process": ({"ddp": True}, 1),
    "dp 2": ({"ddp": True}, 2),
    "ZeRO-1 2": ({"ddp": True, "shard_optimizer_state": True}, 2),
    "ZeRO-3 2": ({"ddp": True, "sharded_data_parallel_degree": 2, **SDP_EXACT}, 2),
    "hpZ 2 of 4": ({"ddp": True, "sharded_data_parallel_degree": 2, **SDP_EXACT}, 4),
}
PAIRS = [("ZeRO-3 2", "dp 2"), ("dp 2", "ZeRO-3 2"), ("ZeRO-1 2", "ZeRO-3 2"), ("ZeRO-3 2", "ZeRO-1 2"),
         ("hpZ 2 of 4", "ZeRO-3 2"), ("ZeRO-3 2", "1 process"), ("1 process", "hpZ 2 of 4"), ("ZeRO-1 2", "1 process")]


@pytest.fixture(scope="module")
def init_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "init.pt"
    torch.save(tiny_vit().state_dict(), path)
    return str(path)


def _run(layout, out, init_weights, *args):
    options, nprocs = LAYOUTS[layout]
    return run_ranks(SCRIPT, nprocs, out_dir=out, env={"SM_HP_MP_PARAMETERS": json.dumps(options)},
                     args=["--init-weights", init_weights, "--optimizer", "adam", "--lr", "1e-3",
                           "--per-rank-batch", 8 // nprocs, *args])


@pytest.fixture(scope="module")
def saved(tmp_path_factory, init_weights):
    """Each source layout once: 8 uninterrupted steps, a partial checkpoint after step 4."""
    cache = {}

    def get(layout):
        if layout not in cache:
            root = tmp_path_factory.mktemp(layout.replace(" ", "_"))
            full = _run(layout, root / "run", init_weights, "--steps", 8, "--save-at", 4, "--ckpt-dir", root / "ckpt")
            cache[layout] = (root / "ckpt", full[0]["losses"])
        return cache[layout]

    return get


@pytest.mark.parametrize("source, target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resume_under_another_layout_continues_the_run(tmp_path, saved, init_weights, source, target):
    ckpt, uninterrupted = saved(source)
    resumed = _run(target, tmp_path, init_weights, "--steps", 4, "--first-step", 4, "--resume", "--ckpt-dir", ckpt)
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(uninterrupted[4:]), rtol=1e-5,
                               atol=1e-6)
    for r in resumed:  # every rank of the new layout agrees
        assert r["losses"] == resumed[0]["losses"]


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


@pytest.mark.parametrize("source, target", TP_PAIRS, ids=[f"{a}->{b}" for a, b in TP_PAIRS])
def test_resume_under_another_tensor_parallel_layout(tmp_path, source, target):
    """A change of tp degree (each TP shard rebuilt through the full tensor, fused q|k|v and
    GPT-2's transposed Conv1D weights included), also combined with a change of ZeRO stage."""
    ckpt = tmp_path / "ckpt"
    full = _run_gpt2(source, tmp_path / "full", "--steps", 8, "--save-at", 4, "--ckpt-dir", ckpt)
    resumed = _run_gpt2(target, tmp_path / "resumed", "--steps", 4, "--first-step", 4, "--resume", "--ckpt-dir", ckpt)
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(full[0]["losses"][4:]), rtol=1e-5,
                               atol=1e-6)



def test_export_to_hugging_face_equals_the_gathered_state_dict(tmp_path):
    """`smp-adapter checkpoint export --to hf` of a tp 2 x ZeRO-3 2 checkpoint (no process group):
    from_pretrained loads it, and every tensor equals the run's gathered model.state_dict() bitwise."""
    from transformers import GPT2LMHeadModel

    from smp_adapter.cli import main

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    run = _run_gpt2("tp 2 x ZeRO-3 2", tmp_path / "run", "--steps", 4, "--save-at", 4, "--ckpt-dir", ckpt)
    assert main(["checkpoint", "inspect", str(ckpt), "--json"]) == 0
    assert main(["checkpoint", "export", str(ckpt), "--to", "hf", str(out)]) == 0
    model = GPT2LMHeadModel.from_pretrained(out)
    exported = model.state_dict()
    for name, values in run[0]["final_state"].items():
        assert torch.equal(exported[name], torch.tensor(values)), name


def test_checkpoint_commands_refuse_what_they_cannot_read(tmp_path, capsys):
    from smp_adapter.cli import main

    assert main(["checkpoint", "inspect", str(tmp_path)]) == 2
    assert "is not a complete smp-adapter partial checkpoint (no smp_manifest.json): give the <tag>_partial " \
           "directory" in capsys.readouterr().err
    (tmp_path / "t_partial").mkdir()
    (tmp_path / "t_partial" / "smp_manifest.json").write_text(json.dumps({"tag": "t", "layout": {"pp": 2}}))
    assert main(["checkpoint", "export", str(tmp_path / "t_partial"), "--to", "hf", str(tmp_path / "o")]) == 2
    assert "has no layout-independent pieces (saved with pp > 1 or by an older smp-adapter)" in capsys.readouterr().err
