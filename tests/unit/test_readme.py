"""The README's commands and links stay alive: every relative link of the README and of docs/ points
at a file (and a heading, where it names one) that exists; the README's script is
examples/smp_v1_train.py as it is; its launch command is accepted by `smp-adapter launch` (a dry run;
tests/distributed/test_readme_example.py runs it for real); the quick-start scripts exist and CI runs
the test command; every subcommand the README lists exists."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def readme_launch_command() -> list[str]:
    (block,) = [b for b in _blocks(README.read_text(), "bash") if "smp-adapter launch" in b]
    return shlex.split(block.strip())


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_what_exists(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve()
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md":
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
            if anchor not in anchors:
                broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_readme_script_is_the_example_file():
    (script,) = [b for b in _blocks(README.read_text(), "python") if "import smdistributed" in b]
    assert script == (ROOT / "examples/smp_v1_train.py").read_text()


def test_the_readme_launch_command_is_accepted():
    cmd = readme_launch_command()
    assert cmd[:2] == ["smp-adapter", "launch"]
    out = subprocess.run([sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())",
                          "launch", "--dry-run", *cmd[2:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "examples/smp_v1_train.py" in out.stdout + out.stderr


def test_quick_start_scripts_exist_and_ci_runs_the_test_command():
    (block,) = [b for b in _blocks(README.read_text(), "bash") if "scripts/test.sh" in b]
    commands = [line.split("#")[0].split() for line in block.strip().splitlines()]
    assert commands == [["bash", "scripts/main_job.sh"], ["bash", "scripts/test.sh"]]
    for _, script in commands:
        assert (ROOT / script).is_file(), script
    assert "scripts/test.sh" in (ROOT / ".ci/run").read_text()


def test_every_listed_subcommand_exists():
    listed = set(re.findall(r"`smp-adapter ([a-z]+)", README.read_text()))
    out = subprocess.run([sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    missing = {name for name in listed if name not in out.stdout}
    assert listed and not missing, (missing, out.stdout)


def test_each_where_to_go_answer_is_at_most_three_files_that_exist():
    """docs/architecture.md's "Where to go for": each row names the files that answer it, three at the
    most (a docs/ page linked counts as one), and each of them is there (a moved file moves its row)."""
    text = (ROOT / "docs/architecture.md").read_text()
    (table,) = re.findall(r"## Where to go for\n(.*?)\n## ", text, re.S)
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| question")]
    assert rows
    for row in rows:
        question, *answer = [cell.strip() for cell in row.strip("|").split(" | ")]
        code = set(re.findall(r"`([\w/]+\.py)`", " ".join(answer)))
        pages = set(LINK.findall(" ".join(answer)))
        assert len(code) + len(pages) <= 3, f"{question!r} names {len(code) + len(pages)} files: {code | pages}"
        missing = [p for p in code if not (ROOT / "adapter/smp_adapter" / p).is_file()]
        missing += [p for p in pages if not (ROOT / "docs" / p).is_file()]
        assert not missing, f"{question!r} names files that are not there: {missing}"
