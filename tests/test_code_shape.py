"""The code's shape: no Python file outside tests/ and benchmarks/ is over 400 lines, and no function or method there
is over 60 lines (from its `def` to its last line) unless it says why, in a `# long: <reason>` comment on its `def`
line or the line above it. No import inside a function of the tuner goes without a one-line reason (a heavy or
optional dependency, or an import cycle) in a comment on its line or the line above it."""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
EXEMPT_DIRS = {"tests", "benchmarks"}  # at the top of the repository
SKIPPED_DIRS = {"__pycache__", "build", "dist", "node_modules"}  # and hidden ones (.venv, .git) and *.egg-info
LONG_REASON = re.compile(r"#\s*long:\s*\S")
REASON = re.compile(r"#\s*\S")  # a comment with something in it


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


def unexplained_imports(text: str, name: str) -> list[str]:
    """The imports inside a function (or method) of one file's source with no comment on their lines or on the line
    above them: each must say why it is not at the top (a heavy or optional dependency, or an import cycle)."""
    lines = text.splitlines()
    commented = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                 if tok.type == tokenize.COMMENT and REASON.match(tok.string)}
    problems: dict[int, str] = {}  # by line: the innermost function's (ast.walk meets the outer ones first)
    for node in ast.walk(ast.parse(text, filename=name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    own = commented.intersection(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
                    above = sub.lineno - 1 in commented and lines[sub.lineno - 2].lstrip().startswith("#")
                    if not (own or above):
                        problems[sub.lineno] = (f"{name}:{sub.lineno}: {lines[sub.lineno - 1].strip()} (in "
                                                f"{node.name}()): move it to the top, or say why not in a comment "
                                                "on its line or the line above")
    return [problems[line] for line in sorted(problems)]


def test_every_import_inside_a_tuner_function_says_why() -> None:
    files = source_files(REPO / "tuner")
    assert any(p.name == "tune.py" for p in files)  # the walk found the tuner
    problems = [problem for path in files
                for problem in unexplained_imports(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert not problems, "\n".join(problems)


def test_the_import_check_wants_a_comment_on_the_line_or_above() -> None:
    body = "def f():\n    x = 1\n{}    return json\n"
    assert unexplained_imports("import json\n\n\n" + body.format(""), "m.py") == []  # at the top: nothing to say
    bare = unexplained_imports(body.format("    import json\n"), "m.py")
    assert len(bare) == 1 and bare[0].startswith("m.py:3: import json (in f())")
    assert unexplained_imports(body.format("    import json  # heavy: only here\n"), "m.py") == []
    assert unexplained_imports(body.format("    # a cycle: json imports this module\n    import json\n"), "m.py") == []
    assert unexplained_imports(body.format("    import json  #\n"), "m.py") != []  # a reason must be given
    assert unexplained_imports(body.format("    from json import (\n        dumps)  # optional: only here\n"),
                               "m.py") == []
    after_code = "def f():\n    x = 1  # not about the import\n    import json\n    return json\n"
    assert unexplained_imports(after_code, "m.py") != []  # the line above must be a comment of its own
    method = "class C:\n    def f(self):\n        from json import dumps\n        return dumps\n"
    assert len(unexplained_imports(method, "m.py")) == 1
    nested = "def f():\n    async def g():\n        import json\n        return json\n    return g\n"
    inner = unexplained_imports(nested, "m.py")
    assert len(inner) == 1 and "(in g())" in inner[0]  # once, in the innermost function
