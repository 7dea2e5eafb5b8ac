"""The smp runtime in one process (world size 1): API misuse errors, @smp.step semantics,
StepOutput, checkpoints. Multi-process behaviour lives in tests/distributed."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smdistributed.modelparallel.torch as smp
from smp_adapter.cli import main
from smp_adapter.errors import NotInitializedError, SMPCheckpointError, SMPUsageError
from smp_adapter.runtime.init import shutdown


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_api_before_init_names_the_fix(fresh):
    with pytest.raises(NotInitializedError, match=r"smp.rank\(\) was called before smp.init\(\)"):
        smp.rank()
    with pytest.raises(NotInitializedError, match="DistributedModel"):
        smp.DistributedModel(_mlp())
    with pytest.raises(NotInitializedError, match="smp.state.cfg is only available after smp.init"):
        smp.state.cfg.fp16
    assert smp.is_initialized() is False


def test_init_reads_environment_over_script_dict(fresh, monkeypatch):
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"microbatches": 2}')
    smp.init({"microbatches": 4, "ddp": True})
    assert smp.state.cfg.microbatches == 2 and smp.state.cfg.ddp is True
    assert (smp.rank(), smp.size(), smp.dp_size(), smp.tp_size(), smp.pp_size(), smp.rdp_size()) == (0, 1, 1, 1, 1, 1)
    assert smp.get_dp_group() == [0] and smp.get_mp_group() == [0]
    smp.init({"microbatches": 4, "ddp": True})  # same effective options: no-op
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"microbatches": 1}')
    with pytest.raises(SMPUsageError, match="called again with different options"):
        smp.init({})


def test_step_splits_batches_and_averages_gradients(fresh):
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(_mlp())
    reference = _mlp()
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    @smp.step
    def train_step(model, x, y, scale):
        out = model(x)
        loss = F.cross_entropy(out, y) * scale
        model.backward(loss)
        return loss, out, x.shape[0]

    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    optimizer.zero_grad()
    loss_mb, out_mb, sizes = train_step(model, x, y, 1.0)
    optimizer.step()
    assert isinstance(loss_mb, smp.StepOutput) and len(loss_mb.outputs) == 2
    assert sizes == [3, 3]  # non-tensor returns: one entry per microbatch
    assert out_mb.concat().shape == (6, 3) and out_mb.stack().shape == (2, 3, 3)
    assert isinstance(loss_mb.detach(), smp.StepOutput)  # tensor methods forwarded
    # reference: one full-batch step (mean of microbatch means == full mean for equal sizes)
    ref_loss = F.cross_entropy(reference(x), y)
    ref_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert loss_mb.reduce_mean().item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_step_splits_mappings_that_are_not_dicts(fresh):
    """transformers' collators return a BatchEncoding (a UserDict, not a dict): each microbatch gets its
    share of every value, in the same mapping type (once it went whole to every microbatch: twice the
    rows out of an evaluation, found by the SageMaker-MP GLUE script with per-batch padding)."""
    from collections import UserDict

    from transformers import BatchEncoding

    smp.init({"microbatches": 2})
    model = smp.DistributedModel(_mlp())
    seen = []

    @smp.step
    def forward(model, inputs):
        seen.append((type(inputs), tuple(inputs["x"].shape)))
        return model(inputs["x"])

    x = torch.randn(6, 4)
    for kind in (UserDict, BatchEncoding):
        seen.clear()
        out = forward(model, kind({"x": x}))
        assert seen == [(kind, (3, 4)), (kind, (3, 4))], seen
        torch.testing.assert_close(out.concat(), model(x).detach())


def test_step_misuse_errors(fresh):
    smp.init({"microbatches": 4})
    model = smp.DistributedModel(_mlp())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        optimizer.step()  # wrong place
        return loss

    with pytest.raises(SMPUsageError, match=r"has 6 samples on axis 0, which does not divide into microbatches=4"):
        train_step(model, torch.randn(6, 4))
    with pytest.raises(SMPUsageError, match=r"optimizer.step\(\) was called inside an @smp.step"):
        train_step(model, torch.randn(8, 4))
    with pytest.raises(SMPUsageError, match="not an argument of"):
        smp.step(non_split_inputs=["nope"])(lambda model, x: x)
    with pytest.raises(SMPUsageError, match="only one smp.DistributedModel per script"):
        smp.DistributedModel(_mlp())
    with pytest.raises(SMPUsageError, match="already an smp.DistributedModel"):
        smp.DistributedModel(model)
    with pytest.raises(SMPUsageError, match=r"smp.partition\(-1\): the partition index must be an integer >= 0"):
        with smp.partition(-1):
            pass


def test_partition_marks_ignored_at_pp1_under_auto_partition(fresh):
    """A pipeline script debugged at pipeline_parallel_degree 1: its smp.partition(1) is ignored."""
    smp.init({})
    with smp.partition(1):
        layer = torch.nn.Linear(2, 2)
    smp.set_partition(layer, 3)
    model = smp.DistributedModel(torch.nn.Sequential(layer))
    assert model(torch.ones(1, 2)).shape == (1, 2)


def test_partition_index_checked_when_marks_place_modules(fresh):
    smp.init({"auto_partition": False, "default_partition": 0})
    with pytest.raises(SMPUsageError, match=r"smp.set_partition\(1\): the partition index must be between 0 and "
                                            r"pipeline_parallel_degree - 1 = 0 \(auto_partition is false"):
        smp.set_partition(torch.nn.Linear(2, 2), 1)


def test_optimizer_before_model_is_rejected(fresh):
    smp.init({})
    with pytest.raises(SMPUsageError, match="create smp.DistributedModel first"):
        smp.DistributedOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1))


def test_plain_style_training_matches_reference(fresh):
    smp.init({})
    model = smp.DistributedModel(_mlp())
    reference = _mlp()
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3):
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        ref_opt.zero_grad()
        ref = F.cross_entropy(reference(x), y)
        ref.backward()
        ref_opt.step()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_checkpoint_round_trip_and_bad_files(fresh, tmp_path):
    smp.init({})
    model = smp.DistributedModel(_mlp())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    smp.save_checkpoint(str(tmp_path), tag="t1", partial=True, user_content={"epoch": 3})
    smp.save_checkpoint(str(tmp_path), tag="full.pt", partial=False)
    assert (tmp_path / "newest").read_text().strip() == "full.pt"
    assert set(torch.load(tmp_path / "full.pt", weights_only=True)) == set(_mlp().state_dict())
    assert smp.resume_from_checkpoint(str(tmp_path), tag="t1") == {"epoch": 3}
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SMPCheckpointError, match="is not a loadable checkpoint"):
        smp.load(str(tmp_path / "junk.pt"), partial=False)
    with pytest.raises(SMPCheckpointError, match="no partial checkpoint file for this rank"):
        smp.load(str(tmp_path / "absent.pt"))
    partial = model.local_state_dict()
    partial["_smp_layout"] = dict(partial["_smp_layout"], tp=2)
    with pytest.raises(SMPCheckpointError, match=r"saved with another parallel layout \(tp: saved 2 vs now 1\)"):
        model.load_state_dict(partial)
    smp.save(model.local_state_dict(), str(tmp_path / "m.pt"), partial=True)
    model.load_state_dict(smp.load(str(tmp_path / "m.pt")))
    (tmp_path / "t2_partial").mkdir()
    with pytest.raises(SMPCheckpointError, match="not a complete smp-adapter partial checkpoint"):
        smp.resume_from_checkpoint(str(tmp_path), tag="t2")
    # a pipeline checkpoint of an older smp-adapter (per-stage files only, no pieces): refused, said why
    manifest_file = tmp_path / "t1_partial" / "smp_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["layout"]["pp"] = 2
    for key in ("universal", "files", "digest_algorithm", "manifest_digest"):  # older: no pieces, no digests
        del manifest[key]
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(SMPCheckpointError, match=r"was saved with another parallel layout \(pp: saved 2 vs now 1\) "
                                                 r"and without layout-independent pieces .*: resume it with the saved "
                                                 r"layout \(\{.*'pp': 2"):
        smp.resume_from_checkpoint(str(tmp_path), tag="t1")


def test_resume_without_tag_names_the_damaged_files_of_the_checkpoint_it_passes_over(fresh, tmp_path):
    """resume_from_checkpoint(tag=None) over a damaged newest checkpoint: the warning names each damaged
    file and what is wrong with it, as `smp-adapter checkpoint verify` does, not only how many there are."""
    smp.init({})
    model = smp.DistributedModel(_mlp())
    smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    smp.save_checkpoint(str(tmp_path), tag="t1", partial=True, user_content={"epoch": 1})
    smp.save_checkpoint(str(tmp_path), tag="t2", partial=True, user_content={"epoch": 2})
    damaged = next(p for p in sorted((tmp_path / "t2_partial").rglob("*.pt")) if p.stat().st_size > 1000)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="resuming from the next newest one, 't1'") as caught:
        assert smp.resume_from_checkpoint(str(tmp_path)) == {"epoch": 1}
    message = next(str(w.message) for w in caught if "next newest" in str(w.message))
    assert str(damaged.relative_to(tmp_path / "t2_partial")) in message, message


def test_full_checkpoint_digests_and_a_deepspeed_file_cut_short_read_unchecked(fresh, tmp_path, monkeypatch, capsys):
    """A full checkpoint (partial=False) records each file's digest beside it and a resume refuses a
    damaged one, naming it; a partial checkpoint read unchecked (the opt-out) whose DeepSpeed file is
    cut short names that file instead of torch's bare error."""
    from smp_adapter.runtime.checkpoint.integrity import manifest as digests
    from smp_adapter.runtime.checkpoint.integrity.manifest import SKIP_ENV
    from smp_adapter.runtime.checkpoint.integrity.sidecars import SIDECAR

    smp.init({})
    model = smp.DistributedModel(_mlp())
    smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    smp.save_checkpoint(str(tmp_path), tag="full.pt", partial=False, user_content={"epoch": 3})
    assert (tmp_path / f"full.pt{SIDECAR}").is_file() and (tmp_path / f"user_content_full.pt{SIDECAR}").is_file()
    assert smp.resume_from_checkpoint(str(tmp_path), partial=False) == {"epoch": 3}
    assert main(["checkpoint", "verify", str(tmp_path)]) == 0  # DIR's newest tag: the model file and user content
    assert capsys.readouterr().out == f"{tmp_path}: 2 files match their {SIDECAR} records\n"
    intact = (tmp_path / "full.pt").read_bytes()
    damaged = bytearray(intact)
    damaged[len(damaged) // 2] ^= 0x10
    (tmp_path / "full.pt").write_bytes(bytes(damaged))
    (tmp_path / "user_content_full.pt").unlink()
    with pytest.raises(SMPCheckpointError) as refused:
        smp.resume_from_checkpoint(str(tmp_path), partial=False)
    assert str(refused.value).startswith(
        f"{tmp_path} is damaged; refusing to resume from it (2 problems):\n"
        f"  {tmp_path / 'full.pt'}: content differs from the save ({digests.default_algorithm()} digest): damaged bytes\n"
        f"  {tmp_path / 'user_content_full.pt'}: missing (recorded at the save, not in the folder now)\n"
        "Use an older complete checkpoint")
    assert "smp-adapter checkpoint verify" in str(refused.value) and f"{SKIP_ENV}=1" in str(refused.value)
    assert (tmp_path / "full.pt").read_bytes() == bytes(damaged)  # nothing rewritten
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    assert capsys.readouterr().out == (
        f"{tmp_path / 'full.pt'}: content differs from the save ({digests.default_algorithm()} digest): damaged bytes\n"
        f"{tmp_path / 'user_content_full.pt'}: missing (recorded at the save, not in the folder now)\n")
    smp.save_checkpoint(str(tmp_path), tag="t", partial=True)
    ds_file = tmp_path / "t_partial" / "ds" / "mp_rank_00_model_states.pt"
    with open(ds_file, "r+b") as f:
        f.truncate(ds_file.stat().st_size - 1)
    monkeypatch.setenv(SKIP_ENV, "1")
    digests._warned.clear()  # the opt-out's warning is said once per process
    with pytest.warns(UserWarning, match="used without checking their digests"), \
            pytest.raises(SMPCheckpointError, match=f"DeepSpeed could not read {ds_file} \\(.*\\): the file is damaged "
                                                    f"or cut short; run `smp-adapter checkpoint verify "):
        smp.resume_from_checkpoint(str(tmp_path), tag="t")


class _RunsCode:
    """A pickle that would run a command when loaded: must never load untrusted."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/smp_adapter_pwned_by_checkpoint",))


def test_checkpoints_holding_client_objects(fresh, tmp_path, monkeypatch):
    """The AWS GPT templates put a transformers config in user_content, the DLC script puts one in
    its smp.save dict, train scripts keep an argparse.Namespace: plain data, loaded without trust.
    BERT's checkpoint holds a DataLoader: refused (loading it runs code of the file's choosing),
    with both fixes named; SMP_ADAPTER_TRUST_CHECKPOINTS=1 or weights_only=False load it as smp v1 did."""
    import argparse

    from transformers import GPT2Config

    smp.init({})
    model = smp.DistributedModel(_mlp())
    smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64)
    # the GPT template's num_params is np.prod(ds_shape) summed (a numpy integer); numpy scalars,
    # dtypes and arrays are plain data, as torch's weights_only documentation allows them
    content = {"total_steps": 2, "model_config": config, "args": argparse.Namespace(lr=0.1),
               "num_params": np.prod((4, 8)) + np.int64(1), "lr_scheduler": {"lr": np.float32(0.5)},
               "dtype": np.dtype("float16"), "rng": np.arange(3)}
    smp.save_checkpoint(str(tmp_path), tag="t1", partial=True, user_content=content)
    got = smp.resume_from_checkpoint(str(tmp_path), tag="t1")
    assert got["total_steps"] == 2 and got["args"].lr == 0.1
    assert got["num_params"] == 33 and isinstance(got["num_params"], np.int64)
    assert got["lr_scheduler"]["lr"] == np.float32(0.5) and got["dtype"] == np.float16 and got["rng"].tolist() == [0, 1, 2]
    assert isinstance(got["model_config"], GPT2Config) and got["model_config"].to_dict() == config.to_dict()
    smp.save_checkpoint(str(tmp_path), tag="full.pt", partial=False, user_content=content)
    assert smp.resume_from_checkpoint(str(tmp_path), tag="full.pt", partial=False)["model_config"].n_layer == 2
    smp.save({"model": model.local_state_dict(), "model_config": config}, str(tmp_path / "m.pt"), partial=True)
    assert smp.load(str(tmp_path / "m.pt"))["model_config"].n_embd == 16

    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    smp.save({"data_loader": loader}, str(tmp_path / "bert.pt"), partial=False)
    with pytest.raises(SMPCheckpointError, match=r"bert.pt holds Python objects that are not plain data \(torch.utils.data._utils.collate"
                                                 r".*torch.utils.data.dataloader.DataLoader.*set SMP_ADAPTER_TRUST_CHECKPOINTS=1 .*"
                                                 r"or pass weights_only=False to smp.load"):
        smp.load(str(tmp_path / "bert.pt"), partial=False)
    assert isinstance(smp.load(str(tmp_path / "bert.pt"), partial=False, weights_only=False)["data_loader"],
                      torch.utils.data.DataLoader)
    monkeypatch.setenv("SMP_ADAPTER_TRUST_CHECKPOINTS", "1")
    assert isinstance(smp.load(str(tmp_path / "bert.pt"), partial=False)["data_loader"], torch.utils.data.DataLoader)
    monkeypatch.delenv("SMP_ADAPTER_TRUST_CHECKPOINTS")

    marker = Path("/tmp/smp_adapter_pwned_by_checkpoint")
    marker.unlink(missing_ok=True)
    torch.save({"x": _RunsCode()}, tmp_path / "evil.pt")
    with pytest.raises(SMPCheckpointError, match=r"evil.pt holds Python objects that are not plain data \(posix.system"):
        smp.load(str(tmp_path / "evil.pt"), partial=False)
    assert not marker.exists()


def test_smp_1_10_save_names_and_optimizer_backcompat(fresh, tmp_path):
    """smp.save(v3=...) and the optimizer's *_backcompat methods, as the DLC GPT-2 script calls them:
    v3=False writes one file per mp rank (<f>_<pp>_<tp>, saved on rdp 0 and loaded by every replica),
    v3=True one per rdp rank, None decides from the layout (no ZeRO here: per mp rank)."""
    smp.init({})
    model = smp.DistributedModel(_mlp())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    F.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
    optimizer.step()
    whole = optimizer.save_optimizer_backcompat(gather_if_shard=True)
    smp.save({"optimizer": whole}, str(tmp_path / "a.pt"), partial=True, v3=False)
    smp.save({"optimizer": optimizer.save_optimizer_backcompat(gather_if_shard=False)}, str(tmp_path / "b.pt"),
             partial=True, v3=True)
    smp.save({}, str(tmp_path / "c.pt"), partial=True)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".smp_digest")) == [
        "a.pt_0_0", "b.pt_0_0_0", "c.pt_0_0"]
    assert whole["state"][0]["exp_avg"].device.type == "cpu"
    before = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    optimizer.step()  # moves the moments; loading the saved state puts them back
    optimizer.load_optimizer_backcompat(smp.load(str(tmp_path / "a.pt"))["optimizer"], gather_if_shard=True)
    after = optimizer.state_dict()["state"]
    assert all(torch.equal(after[k]["exp_avg"], v) for k, v in before.items())
    optimizer.load_optimizer_backcompat(smp.load(str(tmp_path / "b.pt"))["optimizer"])


def test_model_creation_says_which_smp_transformer_keywords_it_does_not_carry_out(fresh):
    """The templates pass smp's own-transformer switches: each is said once, on rank 0, with the reason."""
    import warnings

    smp.init({})  # after the fixture's shutdown: nothing said yet
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with smp.model_creation(tensor_parallelism=False, flash_attention=True, fused_softmax=True,
                                    fused_bias_gelu=True, query_key_layer_scaling=False, zero_init=True):
                _mlp()
    said = [str(w.message) for w in caught if "model_creation" in str(w.message)]
    # flash_attention and fused_softmax are carried out (translate/kernels.py): nothing said for them
    assert said == [
        "smp.model_creation(fused_bias_gelu=True) is not carried out: fused by inductor with SMP_ADAPTER_COMPILE=blocks "
        "(off by default: then not carried out)",
        "smp.model_creation(zero_init=True) is not carried out: replaced: under sharded data parallel every parameter "
        "is ZeRO-3-partitioned when DistributedModel wraps the model (at creation with "
        "delayed_parameter_initialization)"], said  # False (query_key_layer_scaling) asks for nothing


def test_partial_checkpoint_index_points_into_deepspeeds_files_unless_switched_off(fresh, tmp_path, monkeypatch):
    from safetensors import safe_open

    smp.init({})
    model = smp.DistributedModel(_mlp())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # Adam's moments exist
    smp.save_checkpoint(str(tmp_path), tag="with", partial=True)
    with safe_open(str(tmp_path / "with_partial" / "universal" / "rank0.safetensors"), "pt") as f:
        index = json.loads(f.metadata()["index"])
        assert list(f.keys()) == []  # no value written twice: every piece is a range of DeepSpeed's files
    assert {e["kind"] for e in index} == {"param", "exp_avg", "exp_avg_sq"}
    assert all(e["ref"]["file"].startswith("ds/") for e in index)
    monkeypatch.setenv("SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS", "0")
    smp.save_checkpoint(str(tmp_path), tag="without", partial=True)
    assert not (tmp_path / "without_partial" / "universal").exists()
    assert smp.resume_from_checkpoint(str(tmp_path), tag="without") is None  # the same layout: DeepSpeed's files
    manifest_file = tmp_path / "without_partial" / "smp_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["layout"]["tp"] = 2
    from smp_adapter.runtime.checkpoint.integrity.saving import write_manifest

    write_manifest(manifest_file.parent, manifest)  # as a tp 2 job would have written it: sealed
    with pytest.raises(SMPCheckpointError, match=r"saved with another parallel layout \(tp: saved 2 vs now 1\) and "
                                                 r"without layout-independent pieces "
                                                 r"\(SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS=0, or an older "
                                                 r"smp-adapter\): resume it with the saved layout"):
        smp.resume_from_checkpoint(str(tmp_path), tag="without")


def test_shutdown_clears_every_process_wide_value_and_the_environment_init_set(fresh):
    import os

    from smp_adapter.parallel import context, marking

    original_init = nn.Module.__init__
    before = dict(os.environ)
    smp.init({"tensor_parallel_degree": 1, "ddp": True})
    context.set_current_tp_context(context.TPContext(group=None, rank=0, size=1))
    opened = smp.tensor_parallelism()
    opened.__enter__()  # a context left open (a script that died inside it)
    assert nn.Module.__init__ is not original_init and marking.current_mark() is not None
    assert dict(os.environ) != before  # smp.init exported the rendezvous (MASTER_ADDR, ...)
    shutdown()
    assert nn.Module.__init__ is original_init
    assert marking.current_mark() is None and context.current_tp_context() is None
    assert dict(os.environ) == before
    assert smp.is_initialized() is False and smp.state.failed is False


def test_backward_without_a_distributed_optimizer_names_the_fix(fresh):
    smp.init({"ddp": True})
    model = smp.DistributedModel(_mlp())

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    with pytest.raises(SMPUsageError, match=r"model.backward\(\) needs an optimizer: wrap it with "
                                            r"smp.DistributedOptimizer\(optimizer\)"):
        train_step(model, torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))


def test_engine_registry_names_the_available_engines():
    from smp_adapter.runtime.engines import ENGINES, engine_class, engine_for

    with pytest.raises(SMPUsageError, match=r"no engine named 'megatron': the available engines are deepspeed, mics, pipeline"):
        engine_class("megatron")
    assert sorted(ENGINES) == ["deepspeed", "mics", "pipeline"]
    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.config.options import SMPConfig

    pp2 = ParallelDims.from_config(SMPConfig.from_dict({"pipeline_parallel_degree": 2}), 2)
    pp1 = ParallelDims.from_config(SMPConfig.from_dict({"tensor_parallel_degree": 2, "ddp": True}), 2)
    assert (engine_for(pp2).name, engine_for(pp1).name) == ("pipeline", "deepspeed")
    assert engine_class("pipeline").name == "pipeline" and engine_class("deepspeed").name == "deepspeed"


def test_smp_before_1_10_fp16_path_is_refused_with_the_fix(fresh):
    """smp < 1.10 scripts wrapped their own apex-style FP16_Optimizer and read smp's internal maps:
    both say to use the fp16 option instead (never a bare AttributeError)."""
    from smp_adapter.errors import UnsupportedFeatureError

    class FP16_Optimizer:  # the shape of the DLC script's own class: not a torch optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    smp.init({})
    model = smp.DistributedModel(_mlp())
    fix = r"has no equivalent in smp-adapter: set fp16: true \(or bf16: true\) in the smp options"
    with pytest.raises(UnsupportedFeatureError, match=r"smp.DistributedOptimizer\(FP16_Optimizer\): smp < 1.10's fp16 path.*" + fix):
        smp.DistributedOptimizer(FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
    with pytest.raises(UnsupportedFeatureError, match=r"smp.state.param_index_to_name_tp_group: .*" + fix):
        smp.state.param_index_to_name_tp_group
    with pytest.raises(AttributeError, match="smp.state has no attribute 'no_such_thing'"):
        smp.state.no_such_thing
