"""Screenshot of the live view (GET /) running its default prompt with the default model.

    .venv/bin/python -m bench.view_screenshot [--out bench/results/live_view.png]

Starts a drafter (empty) and a verifier (the default model, HTTP API on a
free port), then drives the page in headless chromium (Debian's chromium and
chromium-driver, as the browser test does): Generate on the page's own
defaults (a code edit, 200 tokens, temperature 0, plain decoding racing
beside it), and saves what the page shows once both runs are done. Nothing is
learned beforehand: what is drafted comes from the request's own context.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from specdec.processes import ServiceProcess


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/live_view.png"))
    parser.add_argument("--height", type=int, default=1680, help="window height in pixels")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        drafter = ServiceProcess("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", scratch, inherit_stderr=True)
        try:
            verifier = ServiceProcess(
                "verifier_service",
                *("--port", "0", "--metrics-port", "-1", "--http-port", "0", "--drafter", drafter.address),
                inherit_stderr=True,
            )
            try:
                http_port = verifier.announced_port("http")
                verifier.wait_until_serving()
                shoot(f"http://127.0.0.1:{http_port}/", args)
            finally:
                verifier.stop()
        finally:
            drafter.stop()


def shoot(url: str, args: argparse.Namespace) -> None:
    options = Options()
    options.binary_location = shutil.which("chromium") or "chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size=1280,{args.height}"):
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=options)
    try:
        browser.get(url)
        browser.find_element(By.ID, "run").click()
        status = browser.find_element(By.ID, "status")
        WebDriverWait(browser, 600).until(lambda _: status.text == "done" or status.text.startswith("error"))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(args.out))
        names = ("tokens", "passes", "tokens-per-s", "tokens-per-pass", "acceptance", "plain-tokens-per-s", "speedup")
        counters = {name: browser.find_element(By.ID, name).text for name in names}
        print(f"{status.text}: {counters}; saved {args.out}")
    finally:
        browser.quit()


if __name__ == "__main__":
    main()
