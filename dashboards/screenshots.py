"""Full-page screenshots of dashboard pages in headless Chromium (Debian's ``chromium`` and ``chromium-driver``).
The browser tests take theirs with this code; the pictures of real runs in docs/dashboard.md come from the command:

    python -m dashboards.screenshots --url http://127.0.0.1:8050 --out docs/screenshots \\
        curves='/curves?sweep=sweep-max_num_seqs' study='/study?name=NAME'

Each NAME=PATH opens URL+PATH, waits until every plotly graph on the page has drawn, and saves OUT/NAME.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WIDTH = 1400
MAX_HEIGHT = 4000  # Chromium refuses larger viewports


def start_browser(width: int = WIDTH, height: int = 1000) -> Any:
    """A headless Chromium (selenium WebDriver) that keeps the browser console's messages."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        raise FileNotFoundError(f"missing {', '.join(missing)}: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    return driver


def full_page_screenshot(browser: Any, path: Path, width: int = WIDTH) -> Path:
    """Save the whole page, not just the viewport: the viewport is set to the page's height through the DevTools
    protocol for the shot, then restored."""
    path.parent.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return Math.max(document.body.scrollHeight, "
                                    "document.documentElement.scrollHeight)")
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": min(int(height), MAX_HEIGHT), "deviceScaleFactor": 1, "mobile": False})
    time.sleep(1.0)  # plotly relayouts on resize
    try:
        if not browser.save_screenshot(str(path)):
            raise RuntimeError(f"Chromium saved no screenshot to {path}")
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    return path


def graphs_drawn(browser: Any) -> bool:
    """True once the page has at least one plotly graph and every one of them holds data."""
    return bool(browser.execute_script(
        "const gs = Array.from(document.querySelectorAll('.js-plotly-plot'));"
        "return gs.length > 0 && gs.every(g => g.data && g.data.length > 0);"))


def shoot(browser: Any, url: str, path: Path, timeout: float = 60.0) -> Path:
    browser.get(url)
    deadline = time.monotonic() + timeout
    while not graphs_drawn(browser):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: no drawn graph after {timeout:g} s")
        time.sleep(0.25)
    return full_page_screenshot(browser, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="a running `slotune dashboard`, e.g. http://127.0.0.1:8050")
    p.add_argument("--out", required=True, type=Path, help="folder for NAME.png")
    p.add_argument("pages", nargs="+", metavar="NAME=PATH", help="e.g. study=/study?name=tune-mixed")
    args = p.parse_args(argv)
    pages = []
    for item in args.pages:
        name, sep, path = item.partition("=")
        if not sep or not name or not path.startswith("/"):
            p.error(f"page {item!r}: expected NAME=/PATH")
        pages.append((name, path))
    try:
        browser = start_browser()
    except FileNotFoundError as error:
        print(f"screenshots: error: {error}", file=sys.stderr)
        return 1
    try:
        for name, path in pages:
            saved = shoot(browser, args.url.rstrip("/") + path, args.out / f"{name}.png")
            print(f"{name}: {saved}")
    except TimeoutError as error:
        print(f"screenshots: error: {error}", file=sys.stderr)
        return 1
    finally:
        browser.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
