"""``smp-adapter check`` against what the runtime really provides (check/api.py,
check/local.py): attributes read on smp's model, optimizer and state; call keywords bound to
the real signatures; model_creation keywords not carried out; apex, also in the script's own helper
modules. Every status is asserted with its note."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from smp_adapter.check.script import SUPPORT, check_source, script_options
from test_check import AWS_STYLE, ROOT, SEED_FILES, SEEDS, check_json

WRAPPED = """
import torch
import smdistributed.modelparallel.torch as smp
smp.init()
model = smp.DistributedModel(torch.nn.Linear(2, 2))
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
"""


def wrapped_uses(body: str) -> dict[int, tuple[str, str, str]]:
    """line (from 1 for the first line of body) -> (name, status, note) of its wrapper attribute."""
    report = check_source(WRAPPED + body)
    offset = WRAPPED.count("\n")
    return {u.line - offset: (u.name, u.status, u.note) for u in report.uses if u.kind == "method"}


def test_wrapper_attributes_are_checked_against_the_runtime_classes():
    import torch

    got = wrapped_uses("""model.train()
model.eval()
model.to("cpu")
model.named_parameters()
model.training
model.partitioned
model.config
model._engine
optimizer.add_param_group({"params": []})
optimizer.param_groups
optimizer.optimizer
optimizer.overflow
optimizer.fp32_partitioned_groups_flat
optimizer.fp16_groups
optimizer._global_grad_norm
optimizer.ds_param_shard_group
optimizer.no_such_thing
optimizer._secret
model.join()
optimizer.state_dict()
optimizer.new_attribute = 1
""")
    # nn.Module's API (methods, and `training`, which nn.Module sets in __init__) and DistributedModel's own
    assert [got[i][1] for i in range(1, 7)] == ["supported"] * 6
    assert got[7] == ("DistributedModel.config", "unknown", "smp-adapter's DistributedModel has no attribute 'config' "
                      "(it is an nn.Module around your model and does not forward other names: use "
                      "model.get_module().config for the wrapped model's): AttributeError")
    assert got[8] == ("DistributedModel._engine", "unknown",
                      "smp-adapter's DistributedModel has no attribute '_engine' (a private name): AttributeError")
    # torch.optim.Optimizer's API, DistributedOptimizer's own (overflow: a property, on every engine)
    assert [got[i][1] for i in range(9, 13)] == ["supported"] * 4
    zero3 = "DeepSpeed ZeRO-3 internal: exists under sharded_data_parallel_degree > 1 (AttributeError otherwise)"
    assert got[13] == ("DistributedOptimizer.fp32_partitioned_groups_flat", "partial", zero3)
    assert got[14] == ("DistributedOptimizer.fp16_groups", "partial", zero3)
    assert got[15][1] == "partial" and got[15][2].startswith("DeepSpeed optimizer internal: exists under "
                                                               "sharded_data_parallel_degree > 1")
    assert got[16] == ("DistributedOptimizer.ds_param_shard_group", "partial", "ZeRO-3 parameter-shard group: exists "
                       "under sharded_data_parallel_degree > 1 (AttributeError otherwise)")
    assert got[17] == ("DistributedOptimizer.no_such_thing", "unknown", "smp-adapter's DistributedOptimizer has no "
                       "attribute 'no_such_thing' (neither smp's optimizer, DeepSpeed's ZeRO optimizer nor "
                       "torch.optim.Optimizer defines it (a custom optimizer's own attributes are forwarded, but not "
                       "checked)): AttributeError")
    assert got[18][:2] == ("DistributedOptimizer._secret", "unknown") and "a private name" in got[18][2]
    assert got[19][1] == "unsupported" and got[19][2] == SUPPORT["DistributedModel.join"][1]  # the table first
    assert got[20] == ("DistributedOptimizer.state_dict", "supported", SUPPORT["DistributedOptimizer.state_dict"][1])
    assert 21 not in got  # setting an attribute creates it
    assert not torch.distributed.is_initialized()  # reading the runtime's classes needs no process group


def test_wrapper_names_follow_scopes():
    src = """
import argparse
import smdistributed.modelparallel.torch as smp

def parse_args():
    parser = argparse.ArgumentParser()
    model = parser.add_argument_group("model")  # not the wrapped model
    model.add_argument("--width")

def train(model, optimizer):  # parameters named like the wrapped objects are taken to be them
    model.no_such_method()
    optimizer.step()

def main():
    optimizer = make_optimizer()
    optimizer.custom_before_wrapping()  # the plain optimizer
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(optimizer)
    optimizer.zero_grad()
"""
    got = {(u.line, u.name): u.status for u in check_source(src).uses if u.kind == "method"}
    assert got == {(11, "DistributedModel.no_such_method"): "unknown", (12, "DistributedOptimizer.step"): "supported",
                   (19, "DistributedOptimizer.zero_grad"): "supported"}


def test_a_method_the_runtime_gains_is_known_without_editing_the_check(monkeypatch):
    from smp_adapter.runtime.optimizer import DistributedOptimizer

    body = "optimizer.save_optimizer_fake(cast_to_cpu=False)\n"
    assert wrapped_uses(body)[1] == ("DistributedOptimizer.save_optimizer_fake", "unknown", (
        "smp-adapter's DistributedOptimizer has no attribute 'save_optimizer_fake' (neither smp's optimizer, "
        "DeepSpeed's ZeRO optimizer nor torch.optim.Optimizer defines it (a custom optimizer's own attributes are "
        "forwarded, but not checked)): AttributeError"))

    def save_optimizer_fake(self, cast_to_cpu=True):
        return {}

    monkeypatch.setattr(DistributedOptimizer, "save_optimizer_fake", save_optimizer_fake, raising=False)
    assert wrapped_uses(body)[1] == ("DistributedOptimizer.save_optimizer_fake", "supported", "")
    # and its signature is read too
    report = check_source(WRAPPED + "optimizer.save_optimizer_fake(gather_if_shard=True)\n")
    bad = [u for u in report.uses if u.kind == "keyword"]
    assert [(u.name, u.status, u.expr, u.note) for u in bad] == [(
        "DistributedOptimizer.save_optimizer_fake(gather_if_shard=)", "error", "gather_if_shard=True",
        "DistributedOptimizer.save_optimizer_fake() takes no keyword 'gather_if_shard' in smp-adapter: its "
        "parameters are (cast_to_cpu=True)")]


def test_state_attributes_are_checked_against_the_runtime_state(monkeypatch):
    from smp_adapter.runtime.state import State

    src = """
import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.state_mod import state as smp_state
st = smp.state
smp_state.param_index_to_name_tp_group_fake
smp_state.cfg.fp16
smp.state.model
smp.state.module_manager.translate_functions
smp.state._cfg
st.no_such
smp.state.cfg.anything_after_cfg
smp.state.coord
"""
    uses = {u.line: (u.name, u.status, u.note) for u in check_source(src).uses if u.kind == "api" and u.line > 4}
    missing = "smp.state has no attribute {!r} in smp-adapter (smp_adapter.runtime.state.State): AttributeError"
    assert uses[5] == ("state_mod.state.param_index_to_name_tp_group_fake", "unknown",
                       missing.format("param_index_to_name_tp_group_fake"))
    assert uses[6] == ("state_mod.state", "supported", "the same object as smp.state")
    assert uses[7][1] == uses[8][1] == uses[11][1] == uses[12][1] == "supported"  # reset() sets; cfg/coord: properties
    assert uses[9] == ("state._cfg", "unknown", missing.format("_cfg"))
    assert uses[10] == ("state.no_such", "unknown", missing.format("no_such"))
    monkeypatch.setattr(State, "param_index_to_name_tp_group_fake", property(lambda self: {}), raising=False)
    assert {u.line: u.status for u in check_source(src).uses}[5] == "supported"


def test_keywords_are_bound_against_the_real_signatures(monkeypatch):
    import smdistributed.modelparallel.torch as smp

    src = """
import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.nn import FusedLayerNorm
smp.init()
model = smp.DistributedModel(net, trace_device="cpu", no_such_kw=1)
opt = smp.DistributedOptimizer(base, dynamic_loss_scale=True, scale_window=10)
smp.save(obj, "f", partial=True, bogus=True)
smp.save(obj, "f", **extra)
smp.load("f", None, None, None, True, False, True, 7)
opt.zero_grad(set_to_none=True, foo=1)
model.state_dict(gather_to_rank0=True)
FusedLayerNorm(8, eps=1e-5)
smp.step(non_split_inputs=["x"])
smp.state.cfg.fp16
"""
    report = check_source(src)
    bad = {(u.line, u.name): (u.status, u.expr, u.note) for u in report.uses if u.kind == "keyword"}
    assert set(bad) == {(5, "DistributedModel(no_such_kw=)"), (7, "save(bogus=)"), (9, "load()"),
                        (10, "DistributedOptimizer.zero_grad(foo=)")}
    assert {s for s, _, _ in bad.values()} == {"error"}
    assert bad[(7, "save(bogus=)")][1:] == ("bogus=True", "smp.save() takes no keyword 'bogus' in smp-adapter: its "
                                            "parameters are (obj, f, partial=True, pickle_module=None, "
                                            "pickle_protocol=2, v3=None)")
    assert bad[(5, "DistributedModel(no_such_kw=)")][2].startswith(
        "smp.DistributedModel() takes no keyword 'no_such_kw' in smp-adapter: its parameters are (module, ")
    assert bad[(9, "load()")][2].startswith("smp.load(): too many positional arguments in smp-adapter: its "
                                             "parameters are (f, ")
    assert bad[(10, "DistributedOptimizer.zero_grad(foo=)")][2] == (
        "DistributedOptimizer.zero_grad() takes no keyword 'foo' in smp-adapter: its parameters are (set_to_none=True)")
    # the signature is the runtime's, read at check time
    v3 = "import smdistributed.modelparallel.torch as smp\nsmp.save(obj, 'f', partial=True, v3=True)\n"
    monkeypatch.setattr(smp, "save", lambda obj, f, partial=True: None)
    assert [(u.status, u.note) for u in check_source(v3).uses if u.kind == "keyword"] == [
        ("error", "smp.save() takes no keyword 'v3' in smp-adapter: its parameters are (obj, f, partial=True)")]
    monkeypatch.setattr(smp, "save", lambda obj, f, partial=True, v3=None: None)
    assert [u for u in check_source(v3).uses if u.kind == "keyword"] == []


def test_model_creation_keywords_not_carried_out_are_partial():
    from smp_adapter.runtime.memory import MODEL_CREATION_NOT_CARRIED_OUT
    from smp_adapter.translate.kernels import SWITCHES

    # flash_attention and fused_softmax are carried out (translate/kernels.py); the rest are not
    assert set(MODEL_CREATION_NOT_CARRIED_OUT) == {
        "fused_dropout", "fused_bias_gelu", "attention_in_fp32",
        "query_key_layer_scaling", "fp32_residual_addition", "use_alibi", "zero_init"}
    src = """
import torch
import smdistributed.modelparallel.torch as smp
smp.init()
with smp.model_creation(tensor_parallelism=True, dtype=torch.bfloat16, flash_attention=True, fused_softmax=False,
                        zero_init=args.zero_init, use_alibi=1, attention_in_fp32=None):
    model = build()
"""
    report = check_source(src)
    got = [(u.line, u.name, u.status, u.expr, u.note) for u in report.uses if u.kind == "keyword"]
    # asked for (True, 1, not a literal): partial, or supported with what the kernel switch becomes;
    # literally off (False, None): nothing to say
    assert got == [(5, "model_creation(flash_attention=)", "supported", "flash_attention=True",
                    SWITCHES["model_creation(flash_attention=)"].note())] + [
                   (6, f"model_creation({k}=)", "partial", expr,
                    f"smp.model_creation({k}=...) is not carried out: {MODEL_CREATION_NOT_CARRIED_OUT[k]}")
                   for k, expr in (("zero_init", "zero_init=args.zero_init"), ("use_alibi", "use_alibi=1"))]
    assert report.exit_status() == 0  # partial: the script runs, without those optimisations


def test_apex_names_and_what_the_run_gets_for_each(monkeypatch, tmp_path):
    """Without apex: the fallback's names are supported, names it refuses are partial where only imported
    or used under an if and unsupported where used unconditionally, names it lacks are unsupported; with
    the fallback switched off every name is unsupported; with a real apex on the path every name is."""
    src = """
import amp_C
from apex.multi_tensor_apply import multi_tensor_applier
from apex import amp
from apex.parallel import DistributedDataParallel as DDP
from apex.contrib.optimizers import DistributedFusedAdam
multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], False)
if fp16:
    model, opt = amp.initialize(model, opt)
amp.initialize(model, opt)
"""
    def statuses(source=src):
        return {(u.name, u.line): (u.status, u.note) for u in check_source(source).uses if u.kind == "apex"}

    got = statuses()
    assert {k: s for k, (s, _) in got.items()} == {
        ("amp_C", 2): "supported", ("apex.multi_tensor_apply.multi_tensor_applier", 3): "supported",
        ("apex.amp", 4): "supported", ("apex.parallel.DistributedDataParallel", 5): "partial",
        ("apex.contrib.optimizers.DistributedFusedAdam", 6): "unsupported", ("amp_C.multi_tensor_l2norm", 7): "supported",
        ("apex.amp.initialize", 9): "partial", ("apex.amp.initialize", 10): "unsupported"}  # under `if fp16:` / always
    assert "smp-adapter's fallback" in got["amp_C", 2][1]
    assert "install NVIDIA apex" in got["apex.contrib.optimizers.DistributedFusedAdam", 6][1]
    assert "fp16: true" in got["apex.amp.initialize", 9][1]
    assert "smp.DistributedModel" in got["apex.parallel.DistributedDataParallel", 5][1]
    conditional_only = src.replace("\namp.initialize(model, opt)\n", "\n").replace("from apex.contrib", "# ")
    assert check_source(conditional_only).exit_status() == 0 and check_source(src).exit_status() == 1

    monkeypatch.setenv("SMP_ADAPTER_APEX_FALLBACK", "0")
    assert {s for s, _ in statuses().values()} == {"unsupported"}
    monkeypatch.delenv("SMP_ADAPTER_APEX_FALLBACK")
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = statuses()
    assert {s for s, _ in got.values()} == {"supported"} and str(tmp_path / "apex") in got["amp_C", 2][1]


def test_deepspeed_internals_the_check_names_exist_where_it_says():
    """ZERO_INTERNALS is the one hand-written list: each name is set by DeepSpeed's ZeRO-3 optimizer
    (or, _global_grad_norm at pp > 1, by the pipeline engine), and ds_param_shard_group is the
    runtime's own property that refuses without sharded data parallel."""
    import importlib.util
    import inspect

    from smp_adapter.runtime.engines.base import Engine
    from smp_adapter.runtime.engines.pipeline.engine import ClippingRecord
    from smp_adapter.runtime.optimizer import DistributedOptimizer
    from smp_adapter.check.api import ZERO_INTERNALS

    stage3 = Path(importlib.util.find_spec("deepspeed").origin).parent / "runtime/zero/stage3.py"
    source = stage3.read_text()  # read, not imported: importing DeepSpeed is slow
    for name in set(ZERO_INTERNALS) - {"ds_param_shard_group"}:
        assert f"self.{name} = " in source, name
    assert ClippingRecord._global_grad_norm == 0.0
    assert isinstance(inspect.getattr_static(DistributedOptimizer, "ds_param_shard_group"), property)
    assert "sharded_data_parallel_degree > 1" in inspect.getsource(Engine.param_shard_group)


def test_the_support_table_and_the_introspection_agree():
    from smp_adapter.check.api import known_attributes, wrapper_class

    for wrapper in ("DistributedModel", "DistributedOptimizer"):
        table = {k.split(".", 1)[1] for k in SUPPORT if k.startswith(wrapper + ".")}
        assert table <= known_attributes(wrapper_class(wrapper)), table - known_attributes(wrapper_class(wrapper))


def test_every_smp_optimizer_and_model_attribute_of_the_gpt_fixture_is_listed(capsys):
    import io
    import tokenize

    path = AWS_STYLE / "gpt/train.py"
    _, report = check_json(capsys, path)
    listed = {(u["line"], u["expr"]) for u in report["uses"]}
    chains, last = [], ["", ""]  # dotted name chains outside strings and comments: [(line, [names])]
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME and last == ["NAME", "."]:  # a.b, not f().b
            chains[-1][1].append(tok.string)
        elif tok.type == tokenize.NAME:
            chains.append((tok.start[0], [tok.string]))
        last = [last[1], "NAME" if tok.type == tokenize.NAME else tok.string]
    touched = {(line, ".".join(names if names[0] == "smp" else names[:2])) for line, names in chains
               if len(names) > 1 and names[0] in ("smp", "optimizer", "model")}
    assert len(touched) > 50
    # parse_args's `model` is an argparse group, not the wrapped model: the only unlisted ones
    assert {expr for _, expr in touched - listed} == {"model.add_argument"}, touched - listed
    by_expr = {u["expr"]: u for u in report["uses"]}
    assert by_expr["optimizer.fp32_partitioned_groups_flat"]["status"] == "partial"
    assert by_expr["optimizer._global_grad_norm"]["status"] == "partial"
    assert by_expr["optimizer.optimizer"]["status"] == by_expr["model.train"]["status"] == "supported"
    assert by_expr["zero_init=args.use_distributed_transformer == 0"]["status"] == "partial"


def test_script_options_reads_the_options_without_importing_torch():
    """launch needs only what the script gives smp.init: script_options gets it without the checks
    that import the runtime (torch)."""
    scripts = [*SEED_FILES, *(AWS_STYLE / s for s in ("gpt/train.py", "bert/pretrain.py", "mnist/train_mnist.py"))]
    for path in scripts:
        assert script_options(path.read_text()) == check_source(path.read_text()).init_options, path
    code = ("import sys; from smp_adapter.check.script import script_options; "
            f"print(script_options(open({str(SEEDS / 'seed000_tp_pp.py')!r}).read())); print('torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT / "adapter"), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "False"


def test_the_scripts_own_helper_package_that_uses_apex(tmp_path, capsys, monkeypatch):
    """Like the GPT templates: the script names no apex module, but its bundled fp16/ package (imported
    unconditionally) imports amp_C and torch._six (removed in torch 2.0): the check lists those names at
    the script's import of fp16, with the helper's line, and what the run gets. A helper whose apex
    import is guarded is followed too; a module not beside the script is not read."""
    (tmp_path / "fp16").mkdir()
    (tmp_path / "fp16/__init__.py").write_text("from .fp16 import FP16_Optimizer\n")
    (tmp_path / "fp16/fp16.py").write_text("import torch\nfrom torch._six import inf\nfrom .loss_scaler import Scaler\n"
                                         "\nclass FP16_Optimizer: pass\n")
    (tmp_path / "fp16/loss_scaler.py").write_text("import torch\nimport amp_C\n\nclass Scaler: pass\n")
    (tmp_path / "optional.py").write_text("try:\n    import apex\nexcept ImportError:\n    apex = None\n")
    script = tmp_path / "train.py"
    script.write_text("import smdistributed.modelparallel.torch as smp\nimport optional\nimport numpy\n"
                      "from fp16 import FP16_Optimizer\nsmp.init({'ddp': True})\n")
    code, report = check_json(capsys, script)
    apex = [(u["line"], u["name"], u["status"], u["note"].split(":")[0]) for u in report["uses"] if u["kind"] == "apex"]
    assert code == 0 and apex == [(2, "apex", "supported", "in the script's own module optional (optional.py"),
                                  (4, "torch._six.inf", "supported", "in the script's own module fp16 (fp16/fp16.py"),
                                  (4, "amp_C", "supported", "in the script's own module fp16 (fp16/loss_scaler.py")], apex
    monkeypatch.setenv("SMP_ADAPTER_APEX_FALLBACK", "0")
    code, report = check_json(capsys, script)
    assert code == 1 and {u["status"] for u in report["uses"] if u["kind"] == "apex"} == {"unsupported"}


def test_a_failing_wrapper_use_under_an_if_is_partial():
    """The 2022 GPT templates call their own FP16_Optimizer's methods on smp's optimizer only under
    `if args.fp16:`: the fp32 run does not reach them, so they do not make the verdict "does not run"."""
    src = ("import smdistributed.modelparallel.torch as smp\nopt = smp.DistributedOptimizer(base)\n"
           "if args.fp16:\n    opt.update_master_grads()\n    opt.zero_grad(set_grads_to_None=True)\n"
           "opt.update_master_grads()\n")
    uses = {(u.line, u.name): (u.status, u.note) for u in check_source(src).uses if u.line >= 4}
    assert uses[4, "DistributedOptimizer.update_master_grads"][0] == "partial"
    assert uses[4, "DistributedOptimizer.update_master_grads"][1].startswith("only when `if args.fp16:` (line 3) is taken")
    assert uses[5, "DistributedOptimizer.zero_grad(set_grads_to_None=)"][0] == "partial"
    assert uses[6, "DistributedOptimizer.update_master_grads"][0] == "unknown"


def test_smp_before_1_10_fp16_internals_are_unsupported_with_the_fix():
    """The DLC GPT-2 script's smp < 1.10 branch reads smp's internal maps through state_mod.state:
    the check says what the runtime raises (UnsupportedFeatureError naming fp16: true)."""
    src = ("from smdistributed.modelparallel.torch.state_mod import state as smp_state\n"
           "names = smp_state.param_index_to_name_tp_group\n")
    use = [u for u in check_source(src).uses if u.line == 2]
    assert [(u.name, u.status) for u in use] == [("state_mod.state.param_index_to_name_tp_group", "unsupported")]
    assert use[0].note.startswith("smp < 1.10's fp16 path") and "set fp16: true (or bf16: true)" in use[0].note
