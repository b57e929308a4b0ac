"""Screenshot of the live view (GET /) answering a grounded prompt with the default model.

    .venv/bin/python -m bench.view_screenshot [--out bench/results/live_view.png]

Starts a drafter and a verifier (the default model, HTTP API on a free
port), asks the prompt once over gRPC so the drafter's global table learns
the answer, then drives the page in headless chromium (Debian's chromium and
chromium-driver, as the browser test does): the prompt again, with plain
decoding beside it, and saves what the page shows.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from specdec.processes import ServiceProcess
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPT = (
    'Repeat this sentence exactly, twice: "The with statement wraps the execution of a block with methods defined by a '
    'context manager." Then explain it in one sentence.'
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/live_view.png"))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompt", default=PROMPT)
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
                shoot(verifier, drafter, f"http://127.0.0.1:{http_port}/", args)
            finally:
                verifier.stop()
        finally:
            drafter.stop()


def shoot(verifier: ServiceProcess, drafter: ServiceProcess, url: str, args: argparse.Namespace) -> None:
    request = verifier_pb2.GenerateRequest(prompt=args.prompt, chat=True, max_new_tokens=args.max_tokens)
    answer = verifier_pb2_grpc.VerifierStub(verifier.channel).Generate(request, timeout=600)
    stats = drafter_pb2_grpc.DrafterStub(drafter.channel)
    while stats.Stats(drafter_pb2.StatsRequest(), timeout=10).observed_tokens < len(answer.token_ids):
        time.sleep(0.1)
    options = Options()
    options.binary_location = shutil.which("chromium") or "chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,860"):
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=options)
    try:
        browser.get(url)
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys(args.prompt)
        tokens = browser.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys(str(args.max_tokens))
        browser.find_element(By.ID, "compare").click()
        browser.find_element(By.ID, "run").click()
        status = browser.find_element(By.ID, "status")
        WebDriverWait(browser, 600).until(lambda _: status.text == "done" or status.text.startswith("error"))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(args.out))
        counters = {name: browser.find_element(By.ID, name).text for name in ("tokens-per-s", "tokens-per-pass", "acceptance", "speedup")}
        print(f"{status.text}: {counters}; saved {args.out}")
    finally:
        browser.quit()


if __name__ == "__main__":
    main()
