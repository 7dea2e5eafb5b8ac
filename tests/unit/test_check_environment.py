"""`smp-adapter check` resolves the imports of the script and of its own modules beside it against
the environment it runs in (script_check_local.missing_imports): the Flan-T5 template's helper
t5_flash_attn.py imports flash_attn unconditionally, so the template cannot start without CUDA."""

import textwrap

from smp_adapter.script_check import check_source

SCRIPT = """\
import argparse
import smdistributed.modelparallel.torch as smp
import torch
from t5_flash_attn import add_flash_attn
from data_helpers import load
try:
    import not_a_module_guarded
except ImportError:
    not_a_module_guarded = None

def main():
    import not_a_module_in_function
    smp.init({})
"""


def _write(tmp_path, helper_imports: str):
    (tmp_path / "t5_flash_attn.py").write_text(textwrap.dedent(f"""\
        import torch
        {helper_imports}
        def add_flash_attn(model):
            return model
        """))
    (tmp_path / "data_helpers.py").write_text("import json\nfrom . import t5_flash_attn\ndef load():\n    return 0\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return script


def test_a_cuda_only_import_in_a_helper_module_means_the_script_does_not_start(tmp_path):
    script = _write(tmp_path, "from flash_attn.flash_attention import FlashAttention")
    report = check_source(script.read_text(), str(script))
    text = report.text()
    assert report.exit_status() == 1 and "runs as-is" not in text
    assert ("verdict: does not start here: `flash_attn` is not installed (a CUDA-only package; on a GPU machine "
            "`pip install flash-attn`), imported by the script's own module at t5_flash_attn.py:2") in text
    line4 = [u for u in report.uses if u.kind == "environment" and u.line == 4]
    assert [u.name for u in line4] == ["flash_attn"] and line4[0].status == "unsupported"
    # guarded: the script's fallback; inside a function: needed only when that code runs
    others = {u.name: u for u in report.uses if u.kind == "environment"}
    assert "not_a_module_guarded" not in others
    assert others["not_a_module_in_function"].status == "partial"
    assert others["not_a_module_in_function"].note.endswith("needed when that code runs")


def test_helpers_whose_imports_resolve_run_as_is_and_plain_packages_get_their_pip_name(tmp_path):
    script = _write(tmp_path, "import json")
    text = check_source(script.read_text(), str(script)).text()
    assert "verdict: runs as-is" in text
    script = _write(tmp_path, "import sklearn_surely_missing_pkg")
    text = check_source(script.read_text(), str(script)).text()
    assert ("does not start here: `sklearn_surely_missing_pkg` is not installed (`pip install "
            "sklearn_surely_missing_pkg`, or put it beside the script") in text
