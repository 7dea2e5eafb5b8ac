"""The support matrix is one claim in three places: pyproject.toml's ranges (what pip's resolver
enforces), the "Supported versions" table in docs/supported-versions.md (what users read), and constraints/*.txt (what CI
installs for the other points of the matrix). These tests keep them in step: every range in the
table is pyproject's, every lower end is what constraints/lowest.txt tests, and every matrix point
lies inside the ranges."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def declared() -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {canonicalize_name(r.name): r.specifier for r in map(Requirement, project["dependencies"])}
    reqs["python"] = SpecifierSet(project["requires-python"])
    return reqs


def pins(path: Path) -> dict:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not a name==version pin"
            found[canonicalize_name(name)] = version
    return found


def readme_table() -> dict:
    text = (ROOT / "docs/supported-versions.md").read_text()
    section = text.split("# Supported versions", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("`"):
            rows[canonicalize_name(cells[0])] = (SpecifierSet(cells[1].strip("`")), cells[2].split()[0])
    return rows


def newest_tested() -> dict:
    text = (ROOT / "docs/supported-versions.md").read_text()
    section = text.split("# Supported versions", 1)[1].split("\n## ", 1)[0]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()]
    return {canonicalize_name(c[0]): c[3].split()[0] for c in cells if len(c) == 5 and c[1].startswith("`")}


def lower_end(spec: SpecifierSet) -> str:
    floors = [s.version for s in spec if s.operator == ">="]
    assert len(floors) == 1, f"{spec} has no single lower end"
    return floors[0]


def test_readme_table_is_pyproject_ranges():
    table, ranges = readme_table(), declared()
    constrained = {n for n, spec in ranges.items() if str(spec)}  # tokenizers: transformers pins it
    assert set(table) == constrained, (sorted(table), sorted(constrained))
    for name, (spec, _) in table.items():
        assert spec == ranges[name], f"docs/supported-versions.md says {name} {spec}, pyproject.toml says {ranges[name]}"


def test_lowest_point_tests_every_lower_end():
    table, lowest = readme_table(), pins(ROOT / "constraints" / "lowest.txt")
    for name, (spec, lowest_tested) in table.items():
        if name == "python":  # the interpreter is CI's, not a pin
            continue
        assert lowest.get(name) == lowest_tested, f"docs/supported-versions.md's lowest tested {name} {lowest_tested}, constraints {lowest.get(name)}"
        assert Version(lowest_tested) == Version(lower_end(spec)), \
            f"{name}: the range starts at {lower_end(spec)} but the lowest tested is {lowest_tested}"


@pytest.mark.parametrize("path", sorted((ROOT / "constraints").glob("*.txt")), ids=lambda p: p.name)
def test_every_matrix_point_is_inside_the_ranges(path):
    ranges = declared()
    for name, version in pins(path).items():
        if name in ranges:
            assert ranges[name].contains(version), f"{path.name} pins {name}=={version}, outside {ranges[name]}"


def test_newest_torch_point_is_the_tables_newest_and_inside_the_range():
    """constraints/newest-torch.txt is docs/supported-versions.md's newest tested torch, the range admits it, and the
    range's exclusive upper end is the next minor release (no untested minor is claimed)."""
    newest = pins(ROOT / "constraints" / "newest-torch.txt")["torch"]
    assert newest_tested()["torch"] == newest
    spec = declared()["torch"]
    assert spec.contains(newest)
    (upper,) = [s.version for s in spec if s.operator == "<"]
    major, minor = Version(newest).release[:2]
    assert Version(upper) == Version(f"{major}.{minor + 1}"), f"torch {spec}: the newest tested is {newest}"
