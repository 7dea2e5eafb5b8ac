"""No function in adapter/ is over 80 lines (issue 67): a longer one is
split into named steps. Read with ast, so a decorator or docstring counts as part of its function."""

import ast
from pathlib import Path

ADAPTER = Path(__file__).resolve().parents[2] / "adapter"
LIMIT = 80


def test_no_function_in_adapter_is_over_80_lines():
    long = []
    for path in sorted(ADAPTER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LIMIT:
                    long.append(f"{path.relative_to(ADAPTER)}:{node.lineno} {node.name}: {length} lines")
    assert not long, f"functions over {LIMIT} lines (split them into named steps):\n" + "\n".join(long)
