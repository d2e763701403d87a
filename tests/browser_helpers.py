"""What the dashboard's browser tests share: skipping without Chromium, a `slotune dashboard` process, one
headless browser per module, and waiting for the page to show something."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from dashboards.screenshots import start_browser
from tests.server_helpers import REPO, free_port

WAIT_S = 90.0


def skip_without_browser() -> None:
    """Skip the calling test module when SLOTUNE_SKIP_BROWSER=1 (a machine without Chromium)."""
    if os.environ.get("SLOTUNE_SKIP_BROWSER") == "1":
        pytest.skip("SLOTUNE_SKIP_BROWSER=1", allow_module_level=True)


def start_dashboard(*args: str, log: IO[bytes] | None = None,
                    log_path: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`slotune dashboard ARGS` on a free port, once its page answers: (the process, its URL). Its output goes to
    ``log`` (else nowhere); a dashboard that exits first fails the test with ``log_path``'s text."""
    port = free_port()
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "slotune.cli", "dashboard", "--port", str(port), *args],
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log_path.read_text() if log_path else "the dashboard exited"
        try:
            if httpx.get(url + "/", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.2)


def headless_browser() -> Iterator[Any]:
    """A headless Chromium for a module-scoped fixture; a missing browser fails the test with what to do."""
    try:
        driver = start_browser()
    except FileNotFoundError as error:
        pytest.fail(f"{error} (or SLOTUNE_SKIP_BROWSER=1)")
    yield driver
    driver.quit()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """``condition()`` once it is truthy, polled every 0.25 s; fails naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)
