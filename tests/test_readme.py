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
