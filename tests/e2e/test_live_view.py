"""The live view (``GET /``) in a real browser: Debian's chromium, headless,
driven by selenium through Debian's chromium-driver (both installed by
deploy/install-validators.sh, as the other system tools the tests drive).

A drafter and a verifier with its HTTP API run as processes. The prompt is
first answered once over gRPC, so the drafter's global table learns the
answer; asked again on the page, the answer is drafted from that table where
the request's own context has nothing yet, and from the context once the
answer starts repeating itself.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.v1 import verifier_pb2 as pb

from processes import HttpVerifier, ServiceProcess

PROMPT = "t5 t9 t14 t20"
MAX_TOKENS = 48
PAGE_TIMEOUT_S = 120
API_KEY = "view-key-0123"


@pytest.fixture(scope="module")
def services(tmp_path_factory, chat_model_dir):
    drafter = ServiceProcess(
        "drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(tmp_path_factory.mktemp("view-drafter-db"))
    )
    try:
        drafter.wait_until_serving("specdec.v1.Drafter", 60)
        # A loaded test machine must not turn drafts off (the production deadline is 0.1 s).
        verifier = HttpVerifier(chat_model_dir, "--drafter", drafter.address, "--drafter-timeout", "5")
        try:
            yield drafter, verifier
        finally:
            verifier.process.stop()
    finally:
        drafter.stop()


@pytest.fixture
def browser(tmp_path):
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "chromium and chromium-driver are missing: run deploy/install-validators.sh (make install does)"
    options = Options()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")
    session = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield session
    finally:
        session.quit()


# The text of the tokens the page kept (accepted drafts and the target's own), without the
# struck-through rejected drafts and the "+n" branch marks beside them.
KEPT_TEXT = "return Array.from(document.querySelectorAll(arguments[0] + ' .step > span')).map((e) => e.textContent).join('');"
# Plot pixels that are not background: the bars and dots drawn so far.
PLOTTED = """const c = document.getElementById('plot'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] && (d[i] !== d[i + 1] || d[i + 1] !== d[i + 2])) n++; return n;"""


def run_on_the_page(browser, prompt: str, max_tokens: int, temperature: str = "0", seed: str = "") -> str:
    """Fill the form, click Generate, and return the status once it settles."""
    for element_id, value in (("prompt", prompt), ("max-tokens", str(max_tokens)), ("temperature", temperature), ("seed", seed)):
        element = browser.find_element(By.ID, element_id)
        element.clear()
        if value:
            element.send_keys(value)
    browser.find_element(By.ID, "run").click()
    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, PAGE_TIMEOUT_S).until(lambda _: status.text == "done" or status.text.startswith("error"))
    return status.text


def test_the_page_streams_an_answer_coloured_by_source_with_live_counters(services, browser, tmp_path):
    drafter, verifier = services
    reference = verifier.generate(prompt=PROMPT, chat=True, max_new_tokens=MAX_TOKENS)  # teaches the global table
    stub = drafter_pb2_grpc.DrafterStub(drafter.channel)
    deadline = time.monotonic() + 60
    while stub.Stats(drafter_pb2.StatsRequest(), timeout=10).observed_tokens < MAX_TOKENS:
        assert time.monotonic() < deadline, "the verifier never observed the first answer"
        time.sleep(0.1)

    browser.get(verifier.base + "/")
    assert browser.find_element(By.ID, "compare").is_selected()  # plain decoding races beside it by default
    assert "```python" in browser.find_element(By.ID, "prompt").get_attribute("value")  # the default: a code edit
    assert run_on_the_page(browser, PROMPT, MAX_TOKENS) == "done"
    browser.save_screenshot(str(tmp_path / "live_view.png"))
    if os.environ.get("SPECDEC_VIEW_SCREENSHOT"):  # where to keep it (the README's comes from bench/view_screenshot.py)
        shutil.copy(tmp_path / "live_view.png", os.environ["SPECDEC_VIEW_SCREENSHOT"])

    output = browser.find_element(By.ID, "output")
    assert browser.execute_script(KEPT_TEXT, "#output") == reference.text
    assert browser.find_element(By.ID, "plain-output").get_attribute("textContent") == reference.text
    assert output.find_elements(By.CSS_SELECTOR, "span.context"), "no accepted draft from the request's own context"
    assert output.find_elements(By.CSS_SELECTOR, "span.global"), "no accepted draft from the global table"
    assert output.find_elements(By.CSS_SELECTOR, "span.target"), "no token of the target's own"
    # One outline per forward pass, each ending in the target's own token (but where EOS, drafted, ended it).
    steps = output.find_elements(By.CSS_SELECTOR, ".step")
    assert len(steps) == int(browser.find_element(By.ID, "passes").text) > 1
    ending = [step.find_elements(By.CSS_SELECTOR, ":scope > span:last-of-type")[0].get_attribute("class") for step in steps]
    assert ending[:-1] == ["target"] * (len(steps) - 1)
    assert float(browser.find_element(By.ID, "tokens-per-pass").text) > 1
    assert browser.find_element(By.ID, "acceptance").text.endswith("%")
    assert browser.find_element(By.ID, "speedup").text.endswith("x")
    assert browser.execute_script(PLOTTED) > 50, "nothing plotted"
    # Hovering a token says where it came from and why.
    ActionChains(browser).move_to_element(output.find_element(By.CSS_SELECTOR, "span.global")).perform()
    tip = browser.find_element(By.ID, "tip")
    WebDriverWait(browser, 10).until(lambda _: tip.is_displayed())
    assert "learned across requests" in tip.text and "evidence: the last" in tip.text

    # Sampled with a seed: the drafts (the greedy answer, from the table) are turned down where
    # the sample leaves them, struck through; both panes show the same sample.
    assert run_on_the_page(browser, PROMPT, MAX_TOKENS, temperature="1.5", seed="7") == "done"
    rejected = output.find_elements(By.CSS_SELECTOR, ".step > s.rejected")
    assert rejected, "no rejected draft shown"
    assert browser.execute_script(KEPT_TEXT, "#output") == browser.find_element(By.ID, "plain-output").get_attribute("textContent")
    ActionChains(browser).move_to_element(rejected[0]).perform()
    WebDriverWait(browser, 10).until(lambda _: tip.is_displayed() and "rejected" in tip.text)


@pytest.fixture(scope="module")
def keyed_verifier(chat_model_dir):
    verifier = HttpVerifier(chat_model_dir, "--api-key", API_KEY)
    try:
        yield verifier
    finally:
        verifier.process.stop()


def test_with_api_keys_the_page_asks_for_one_sends_it_and_keeps_it(keyed_verifier, browser):
    request = pb.GenerateRequest(prompt=PROMPT, chat=True, max_new_tokens=8)
    reference = keyed_verifier.stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=PAGE_TIMEOUT_S)
    browser.get(keyed_verifier.base + "/")  # the page itself is open
    status = run_on_the_page(browser, PROMPT, 8)
    assert status.startswith("error: this verifier requires an API key") and status.endswith("(enter the API key above)")
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    assert run_on_the_page(browser, PROMPT, 8) == "done"
    assert browser.execute_script(KEPT_TEXT, "#output") == reference.text
    browser.get(keyed_verifier.base + "/")  # a reload keeps the key (localStorage)
    assert browser.find_element(By.ID, "api-key").get_attribute("value") == API_KEY
    assert run_on_the_page(browser, PROMPT, 8) == "done"
