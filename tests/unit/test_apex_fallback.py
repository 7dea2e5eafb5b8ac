"""smp-adapter's apex fallback (smp_adapter/compat/apex_fallback): each function against a reference computed
another way (float64 for sums and norms), the overflow flag for inf and NaN, fp16 and fp32 tensors,
empty lists, the return shapes; the import finder's rules (real apex wins, libraries are not
answered, the off switch, nothing under apex's name on disk), and the launcher's start-up hook."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import smp_adapter.compat.apex_fallback as fallback
from smp_adapter.compat.apex_fallback import modules, multi_tensor as mt
from smp_adapter.errors import SMPUsageError, UnsupportedFeatureError

ROOT = Path(__file__).resolve().parents[2]
INF, NAN = float("inf"), float("nan")


def flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32)  # apex scripts: torch.cuda.IntTensor([0])


def tensors(dtype, seed=0, sizes=(5, 300, 1)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 3).to(dtype) for n in sizes]


# ---------------------------------------------------------------- multi_tensor_scale


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                     (torch.float32, torch.float16), (torch.float16, torch.float16),
                                     (torch.bfloat16, torch.float32)])
def test_scale_writes_float_products_into_the_outputs(src, dst):
    ins = tensors(src)
    outs = [torch.full_like(t, 7, dtype=dst) for t in ins]
    f = flag()
    assert mt.multi_tensor_scale(2048, f, [ins, outs], 0.125) is None
    for i, o in zip(ins, outs):
        # reference: the product in float64, rounded once to the output dtype; 0.125 is exact in every dtype,
        # so apex's float32 product rounds to the same value
        assert o.dtype == dst and torch.equal(o, (i.double() * 0.125).to(dst))
    assert f.item() == 0


def test_scale_in_place_rounds_once_like_apex():
    ins = tensors(torch.float16)
    ref = [(t.float() * 0.1).half() for t in ins]  # apex: float(in) * float(scale), cast to half once
    mt.multi_tensor_scale(2048, flag(), [ins, ins], 0.1)
    assert all(torch.equal(a, b) for a, b in zip(ins, ref))


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scale_sets_the_flag_on_a_non_finite_input(bad, dtype):
    ins = tensors(dtype)
    ins[1][17] = bad
    f = flag()
    mt.multi_tensor_scale(2048, f, [ins, [t.float() for t in ins]], 1.0)
    assert f.item() == 1


def test_scale_flag_reads_inputs_not_results_and_is_never_cleared():
    big = [torch.tensor([60000.0, 1.0])]  # finite input whose scaled value overflows fp16: apex leaves the flag
    out = [torch.zeros(2, dtype=torch.float16)]
    f = flag()
    mt.multi_tensor_scale(2048, f, [big, out], 4.0)
    assert f.item() == 0 and torch.isinf(out[0][0])
    f.fill_(1)
    mt.multi_tensor_scale(2048, f, [tensors(torch.float32), tensors(torch.float32)], 1.0)
    assert f.item() == 1  # callers zero it (apex does not either)


def test_scale_checks_the_lists():
    with pytest.raises(SMPUsageError, match="2 list"):
        mt.multi_tensor_scale(2048, flag(), [tensors(torch.float32)], 1.0)
    with pytest.raises(SMPUsageError, match="size mismatch"):
        mt.multi_tensor_scale(2048, flag(), [tensors(torch.float32), tensors(torch.float32)[:2]], 1.0)
    with pytest.raises(SMPUsageError, match="differs in size"):
        mt.multi_tensor_scale(2048, flag(), [[torch.ones(3)], [torch.ones(4)]], 1.0)
    with pytest.raises(SMPUsageError, match="float64"):
        mt.multi_tensor_scale(2048, flag(), [[torch.ones(3, dtype=torch.float64)], [torch.ones(3)]], 1.0)
    f = flag()
    assert mt.multi_tensor_scale(2048, f, [[], []], 2.0) is None and f.item() == 0  # empty: nothing to do


# ---------------------------------------------------------------- multi_tensor_l2norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_l2norm_against_float64_sums(dtype):
    ts = tensors(dtype, sizes=(5, 3000, 1, 77))
    f = flag()
    norm, per = mt.multi_tensor_l2norm(2048, f, [ts], True)
    ref_per = torch.stack([t.double().pow(2).sum().sqrt() for t in ts])
    ref = ref_per.pow(2).sum().sqrt()
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert per.shape == (4,) and per.dtype == torch.float32
    # float32 accumulation over <= 3000 terms against float64: relative error well under 1e-5
    assert torch.allclose(norm.double(), ref.reshape(1), rtol=1e-5)
    assert torch.allclose(per.double(), ref_per, rtol=1e-5)
    assert f.item() == 0


def test_l2norm_without_per_tensor_returns_an_empty_second_tensor():
    norm, per = mt.multi_tensor_l2norm(2048, flag(), [tensors(torch.float32)])
    assert norm.shape == (1,) and per.shape == (0,)
    norm2, per2 = mt.multi_tensor_l2norm(2048, flag(), [tensors(torch.float32)], False)
    assert torch.equal(norm, norm2) and per2.shape == (0,)


@pytest.mark.parametrize("bad", [INF, NAN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_l2norm_flags_inf_and_nan(bad, dtype):
    ts = tensors(dtype)
    ts[2][0] = bad
    f = flag()
    norm, per = mt.multi_tensor_l2norm(2048, f, [ts], True)
    assert f.item() == 1 and not torch.isfinite(norm).all()
    assert torch.isfinite(per[:2]).all() and not torch.isfinite(per[2])


def test_l2norm_of_squares_beyond_float32_is_inf_and_flagged_as_in_apex():
    f = flag()
    norm, _ = mt.multi_tensor_l2norm(2048, f, [[torch.tensor([1e20, 1.0])]])
    assert torch.isinf(norm).all() and f.item() == 1


def test_l2norm_of_empty_lists():
    f = flag()
    norm, per = mt.multi_tensor_l2norm(2048, f, [[]], True)
    assert norm.tolist() == [0.0] and per.shape == (0,) and f.item() == 0


# ---------------------------------------------------------------- multi_tensor_axpby, applier, apex_C


@pytest.mark.parametrize("arg_to_check,bad_in,expect", [(-1, "x", 1), (-1, "y", 1), (0, "x", 1), (0, "y", 0),
                                                        (1, "y", 1), (1, "x", 0)])
def test_axpby_result_and_which_argument_sets_the_flag(arg_to_check, bad_in, expect):
    xs, ys = tensors(torch.float16, seed=1), tensors(torch.float32, seed=2)
    ref = [(2.0 * x.double() - 0.5 * y.double()).float() for x, y in zip(xs, ys)]
    outs = [torch.empty_like(y) for y in ys]
    mt.multi_tensor_axpby(2048, flag(), [xs, ys, outs], 2.0, -0.5, -1)
    # float32 arithmetic against float64: products and one sum of values |v| < ~20
    assert all(torch.allclose(o.double(), r.double(), rtol=1e-6, atol=1e-6) for o, r in zip(outs, ref))
    (xs if bad_in == "x" else ys)[0][2] = NAN
    f = flag()
    mt.multi_tensor_axpby(2048, f, [xs, ys, outs], 2.0, -0.5, arg_to_check)
    assert f.item() == expect


def test_applier_passes_its_chunk_size_and_arguments():
    seen = []
    out = mt.multi_tensor_applier(lambda *a: seen.append(a) or "r", "flag", [["t"]], 1, 2)
    assert out == "r" and seen == [(2048 * 32, "flag", [["t"]], 1, 2)]
    assert mt.MultiTensorApply.available is True


def test_flatten_and_unflatten_give_views_of_the_flat_tensor():
    ts = [torch.arange(3.0), torch.arange(4.0).reshape(2, 2)]
    flat = mt.flatten(ts)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in ts]))
    views = mt.unflatten(torch.zeros(7), ts)
    assert [v.shape for v in views] == [t.shape for t in ts]
    views[1].fill_(5)  # BERT writes through the views, then all-reduces the flat buffer
    assert views[1]._base is not None and views[0]._base is views[1]._base


# ---------------------------------------------------------------- apex.normalization, amp, parallel


def test_fused_layer_norm_is_layer_norm():
    torch.manual_seed(0)
    norm = modules.FusedLayerNorm(8, eps=1e-6)
    x = torch.randn(3, 8)
    assert torch.equal(norm(x), torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias, 1e-6))
    assert not isinstance(torch.nn.LayerNorm(8), modules.FusedLayerNorm)  # as apex: no isinstance widening


@pytest.fixture
def fresh_amp_state(monkeypatch):
    monkeypatch.setattr(modules, "_amp_state", modules.AmpState())
    return modules


def test_amp_initialize_names_the_smp_options_and_disabled_amp_passes_through(fresh_amp_state):
    amp = fresh_amp_state
    model, opt = torch.nn.Linear(2, 2), object()
    with pytest.raises(UnsupportedFeatureError, match=r"fp16: true .*bf16: true.*smp.amp.GradScaler"):
        amp.initialize(model, opt, opt_level="O2")
    with pytest.raises(UnsupportedFeatureError, match="scale_loss before apex.amp.initialize"):
        with amp.scale_loss(torch.tensor(1.0), opt):
            pass
    assert amp.initialize(model, opt, enabled=False) == (model, opt)
    assert amp.initialize(model, enabled=False) is model
    loss = torch.tensor(3.0)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


def test_amp_master_params_and_refused_parallel():
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    assert list(modules.master_params(opt)) == [a, b]
    with pytest.raises(UnsupportedFeatureError, match="smp.DistributedModel"):
        modules.DistributedDataParallel(torch.nn.Linear(1, 1))


def test_flat_dist_call_groups_by_type_and_copies_back():
    ts = [torch.ones(2), torch.ones(3, dtype=torch.float16), torch.full((1,), 2.0)]
    calls = []

    def call(flat, factor):
        calls.append((flat.dtype, flat.numel()))
        flat.mul_(factor)

    modules.flat_dist_call(ts, call, (3,))
    assert sorted(calls, key=str) == sorted([(torch.float32, 3), (torch.float16, 3)], key=str)
    assert ts[0].tolist() == [3.0, 3.0] and ts[1].tolist() == [3.0] * 3 and ts[2].tolist() == [6.0]


# ---------------------------------------------------------------- the import finder


@pytest.fixture
def finder():
    """The fallback installed for the test, and the process left as it was (installed or not, no
    fallback module cached)."""
    was = fallback.installed()
    fallback.uninstall()
    fallback.install()
    yield fallback
    fallback.uninstall()
    if was:
        fallback.install()


def test_the_script_imports_every_name_the_public_scripts_use(finder):
    import amp_C
    import apex_C
    from apex import amp
    from apex.amp import _amp_state  # noqa: F401
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.normalization import FusedLayerNorm
    from apex.optimizers import FusedAdam, FusedLAMB
    from apex.parallel import DistributedDataParallel  # noqa: F401
    from apex.parallel.distributed import flat_dist_call
    from torch._six import container_abcs, inf, string_classes  # removed in torch 2.0 (the templates' fp16/)

    from smp_adapter.compat import fused_optimizers

    assert inf == float("inf") and string_classes == (str, bytes) and container_abcs.Mapping

    assert amp_C.multi_tensor_l2norm is mt.multi_tensor_l2norm and apex_C.unflatten is mt.unflatten
    assert multi_tensor_applier is mt.multi_tensor_applier and amp.initialize is modules.initialize
    assert FusedAdam is fused_optimizers.FusedAdam and FusedLAMB is fused_optimizers.FusedLAMB
    assert FusedLayerNorm is modules.FusedLayerNorm and flat_dist_call is modules.flat_dist_call
    with pytest.raises(ImportError):
        import apex.contrib  # noqa: F401  (not in the fallback: a plain ImportError, as without apex)


def test_libraries_probing_for_apex_are_not_answered(finder):
    probe = {"__name__": "megatron.core.probe"}
    with pytest.raises(ImportError):
        exec("import apex", probe)
    assert "apex" not in sys.modules
    script = {"__name__": "__main__"}
    exec("import apex", script)
    assert script["apex"].__loader__ is fallback._LOADER


def test_nothing_is_written_under_apex_names():
    package = ROOT / "adapter"
    assert not [p for p in package.rglob("*") if p.stem in fallback.ROOTS]


def test_real_apex_on_the_path_always_wins(finder, tmp_path, monkeypatch):
    real = tmp_path / "site"
    (real / "apex" / "multi_tensor_apply").mkdir(parents=True)
    (real / "apex" / "__init__.py").write_text("REAL = True\n")
    (real / "apex" / "multi_tensor_apply" / "__init__.py").write_text("multi_tensor_applier = 'real'\n")
    monkeypatch.syspath_prepend(str(real))
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        import apex
        from apex.multi_tensor_apply import multi_tensor_applier

        assert apex.REAL and multi_tensor_applier == "real"
        with pytest.raises(ImportError):  # with a real apex, even the names it lacks are not answered
            import amp_C  # noqa: F401
    finally:
        for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
            del sys.modules[name]


def test_the_switch_turns_it_off(monkeypatch):
    was = fallback.installed()
    monkeypatch.setenv("SMP_ADAPTER_APEX_FALLBACK", "0")
    fallback.uninstall()
    try:
        assert fallback.install() is False and not fallback.installed()
        with pytest.raises(ImportError):
            import amp_C  # noqa: F401
    finally:
        monkeypatch.delenv("SMP_ADAPTER_APEX_FALLBACK")
        if was:
            fallback.install()


def test_launched_processes_have_it_before_the_first_line_and_keep_their_own_sitecustomize(tmp_path):
    """What smp-adapter launch puts on PYTHONPATH (commands/launch.py): the finder is there before the
    script's first line (no torch imported: find_spec does not load the module) and a sitecustomize
    of the environment still runs."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE_RAN'] = '1'\n")
    code = ("import importlib.util, os, sys\nspec = importlib.util.find_spec('amp_C')\n"
            "assert 'smdistributed' not in sys.modules and 'torch' not in sys.modules\n"
            "print(type(spec.loader).__module__, os.environ.get('OWN_SITECUSTOMIZE_RAN'))\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SMP_ADAPTER_")}
    environ["PYTHONPATH"] = os.pathsep.join([fallback.BOOT_DIR, str(own), str(ROOT / "adapter")])
    result = subprocess.run([sys.executable, "-c", code], env=environ, cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["smp_adapter.compat.apex_fallback", "1"]
