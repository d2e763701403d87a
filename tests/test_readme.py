"""The README's two set-up commands are what the project runs: CI calls exactly the test command, the main command
ends with `tune --slo-p99-tbt 50ms`, and every docs page the README points to exists."""

from __future__ import annotations

import re

from tests.server_helpers import REPO

README = (REPO / "README.md").read_text()


def bash_blocks() -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S)]


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [next(b for b in bash_blocks() if b.endswith("python -m pytest"))]


def test_the_main_command_installs_torch_first_and_runs_tune() -> None:
    main = next(b for b in bash_blocks() if b.endswith("tune --slo-p99-tbt 50ms"))
    assert main.index("pip install torch==2.13.0") < main.index("pip install -e .")


def test_every_docs_page_the_readme_names_exists() -> None:
    pages = set(re.findall(r"`(docs/[\w/.-]+\.md)`", README))
    assert pages and all((REPO / page).is_file() for page in pages), pages


def test_every_benchmarks_section_the_docs_cite_exists() -> None:
    """A citation ``BENCHMARKS.md, "NAME"`` names the start of one of its headings."""
    headings = [h.lower() for h in re.findall(r"^#+ (.+)$", (REPO / "BENCHMARKS.md").read_text(), flags=re.M)]
    cited = {}
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = " ".join(page.read_text().split())  # a citation may break across lines
        for name in re.findall(r'BENCHMARKS\.md,? "([^"]+)"', text):
            cited[name] = page.name
    assert cited
    missing = {name: page for name, page in cited.items() if not any(h.startswith(name.lower()) for h in headings)}
    assert missing == {}
