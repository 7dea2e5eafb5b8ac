"""No file of the repository keeps a merge's conflict markers: docs/launch.md once carried a usage block
with both sides of a conflict (two branches' options), which no other test reads."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = {".py", ".md", ".sh", ".txt", ".toml", ".yaml", ".yml", ".json", ".cfg", ".ini"}
SKIP = {".git", ".venv", "node_modules", "__pycache__"}


def _files():
    for path in ROOT.rglob("*"):
        if path.is_file() and path.suffix in TEXT and not SKIP.intersection(path.relative_to(ROOT).parts) \
                and not any(part.endswith(".egg-info") for part in path.parts):
            yield path


def test_no_conflict_markers():
    found = []
    for path in _files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "=======" and path.suffix != ".md":
                found.append(f"{path.relative_to(ROOT)}:{number}: {line[:40]}")
    assert not found, "merge conflict markers left:\n" + "\n".join(found)
