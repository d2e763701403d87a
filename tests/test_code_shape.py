"""The code's shape: no Python file outside tests/ and benchmarks/ is over 400 lines, and no function or method there
is over 60 lines (from its `def` to its last line) unless it says why, in a `# long: <reason>` comment on its `def`
line or the line above it."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
EXEMPT_DIRS = {"tests", "benchmarks"}  # at the top of the repository
SKIPPED_DIRS = {"__pycache__", "build", "dist", "node_modules"}  # and hidden ones (.venv, .git) and *.egg-info
LONG_REASON = re.compile(r"#\s*long:\s*\S")


def source_files(root: Path = REPO) -> list[Path]:
    """Every Python file of the repository outside tests/ and benchmarks/ (virtual environments and builds left out)."""
    out = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d in SKIPPED_DIRS or d.endswith(".egg-info")
                                                 or (here == root and d in EXEMPT_DIRS)))
        out += [here / f for f in sorted(files) if f.endswith(".py")]
    return out


def _has_reason(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    near = lines[max(node.lineno - 2, 0):node.lineno]  # the line above the `def` and the `def` line itself
    return any(LONG_REASON.search(line) for line in near)


def shape_problems(text: str, name: str) -> list[str]:
    """What is too long in one file's source: the file, and each function without a `# long:` reason."""
    lines = text.splitlines()
    problems = [f"{name}: {len(lines)} lines (at most {MAX_FILE_LINES})"] if len(lines) > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(text, filename=name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not _has_reason(lines, node):
                problems.append(f"{name}:{node.lineno}: {node.name}() is {length} lines (at most "
                                f"{MAX_FUNCTION_LINES}, or say why in a `# long: <reason>` comment on its def line)")
    return problems


def test_no_file_or_function_is_too_long() -> None:
    files = source_files()
    assert any(p.relative_to(REPO).parts[0] == "engine" for p in files)  # the walk found the packages
    problems = [problem for path in files
                for problem in shape_problems(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert not problems, "\n".join(problems)


def _function(lines: int, above: str = "", on_def: str = "", prefix: str = "def") -> str:
    """A function of ``lines`` lines (its def included), with ``above`` on the line before it."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    return f"{above}\n{prefix} f():{on_def}\n{body}"


def test_the_check_counts_from_the_def_to_the_last_line_and_honours_a_reason() -> None:
    assert shape_problems(_function(MAX_FUNCTION_LINES), "m.py") == []
    over = shape_problems(_function(MAX_FUNCTION_LINES + 1), "m.py")
    assert len(over) == 1 and over[0].startswith(f"m.py:2: f() is {MAX_FUNCTION_LINES + 1} lines")
    assert shape_problems(_function(MAX_FUNCTION_LINES + 1, prefix="async def"), "m.py") != []
    method = "class C:\n" + "".join(f"    {line}\n" for line in _function(MAX_FUNCTION_LINES + 1).splitlines())
    assert shape_problems(method, "m.py") != []
    assert shape_problems(_function(99, above="# long: one table, row by row"), "m.py") == []
    assert shape_problems(_function(99, on_def="  # long: one table, row by row"), "m.py") == []
    assert shape_problems(_function(99, above="# long:"), "m.py") != []  # a reason must be given
    assert shape_problems("x = 1\n" * MAX_FILE_LINES, "m.py") == []
    assert shape_problems("x = 1\n" * (MAX_FILE_LINES + 1), "m.py") == [f"m.py: {MAX_FILE_LINES + 1} lines (at most "
                                                                         f"{MAX_FILE_LINES})"]
