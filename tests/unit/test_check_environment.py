"""`smp-adapter check` resolves the imports of the script and of its own modules beside it against
the environment it runs in (check/local.py missing_imports): the Flan-T5 template's helper
t5_flash_attn.py imports flash_attn unconditionally, so the template cannot start without CUDA."""

import textwrap

from smp_adapter.check.script import check_source

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


def test_a_helper_reached_through_sys_path_is_the_scripts_own(tmp_path):
    """The recipes and many AWS examples put a shared folder on sys.path from their own location
    (``sys.path.insert(0, str(Path(__file__).resolve().parents[1]))``): a helper there is the
    script's own module, followed like one beside it, not a package to pip install."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "common_utils.py").write_text("import json\n")
    (tmp_path / "jobs" / "a").mkdir(parents=True)
    forms = {"pathlib": "sys.path.insert(0, str(Path(__file__).resolve().parents[2] / 'shared'))",
             "os.path": "sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname("
                        "os.path.abspath(__file__)))), 'shared'))"}
    for name, line in forms.items():
        script = tmp_path / "jobs" / "a" / f"train_{name}.py"
        script.write_text(f"import os\nimport sys\nfrom pathlib import Path\n{line}\nimport common_utils\n"
                          "import smdistributed.modelparallel.torch as smp\nsmp.init({})\n")
        assert "verdict: runs as-is" in check_source(script.read_text(), str(script)).text(), name
    # the helper's own missing import is reported where it is, as for a helper beside the script
    (tmp_path / "shared" / "common_utils.py").write_text("import flash_attn\n")
    text = check_source(script.read_text(), str(script)).text()
    assert "does not start here: `flash_attn` is not installed (a CUDA-only package" in text
    # a path the checker cannot read without running the script: the import stays unresolved
    script.write_text("import sys\nsys.path.insert(0, compute_dir())\nimport common_utils\n")
    assert "`common_utils` is not installed" in check_source(script.read_text(), str(script)).text()


def test_the_recipes_run_as_is():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "recipes"
    scripts = sorted(p for p in root.rglob("*.py") if p.name != "recipe_utils.py")
    assert scripts
    for script in scripts:
        text = check_source(script.read_text(), str(script)).text()
        assert "verdict: runs as-is" in text, f"{script}:\n{text[-1500:]}"


def test_a_module_the_installed_package_lacks_means_the_script_does_not_start(tmp_path):
    """`from transformers.sagemaker import ...` (transformers 5 has no transformers.sagemaker): the package
    resolves, its module does not, found without importing transformers; `os.path` and an existing
    submodule resolve. In a helper module beside the script too."""
    from smp_adapter.check.local import _resolves_dotted

    assert _resolves_dotted("os.path") and _resolves_dotted("smp_adapter.runtime.model")
    assert not _resolves_dotted("smp_adapter.no_such_module")
    script = tmp_path / "train.py"
    script.write_text("import os.path\nimport smp_adapter.runtime.model\nfrom smp_adapter.no_such_module import x\n"
                      "import helper\n")
    (tmp_path / "helper.py").write_text("import smp_adapter.nor_this_one\n")
    report = check_source(script.read_text(), str(script))
    missing = {u.name: u for u in report.uses if u.kind == "environment"}
    assert set(missing) == {"smp_adapter.no_such_module", "smp_adapter.nor_this_one"}, missing
    assert report.exit_status() == 1 and "does not start here: `smp_adapter.no_such_module` does not exist" in report.text()


def test_hf_argument_parser_scripts_are_told_about_no_mp_parameters():
    """A script parsing its arguments with HfArgumentParser into TrainingArguments, strictly: on
    transformers 5 (no TrainingArguments.mp_parameters) check says to launch with --no-mp-parameters;
    with return_remaining_strings=True, or on transformers 4, nothing is said."""
    from importlib.metadata import version

    strict = ("from transformers import HfArgumentParser, TrainingArguments\n"
              "parser = HfArgumentParser((TrainingArguments,))\n(args,) = parser.parse_args_into_dataclasses()\n")
    lenient = strict.replace("parse_args_into_dataclasses()", "parse_args_into_dataclasses(return_remaining_strings=True)")
    told = int(version("transformers").split(".")[0]) >= 5
    report = check_source(strict, "train.py")
    assert report.exit_status() == 0
    assert ("verdict: runs as-is through smp-adapter launch --no-mp-parameters" in report.text()) == told, report.text()
    assert [u.status for u in report.uses if u.kind == "launch"] == (["partial"] if told else [])
    assert not [u for u in check_source(lenient, "train.py").uses if u.kind == "launch"]
