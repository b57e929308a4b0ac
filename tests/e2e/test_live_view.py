"""The live view (``GET /``) in a real browser: Debian's chromium, headless,
driven by selenium through Debian's chromium-driver (both installed by
deploy/install-validators.sh, as the other system tools the tests drive).

A drafter and a verifier with its HTTP API run as processes. The prompt is
first answered once over gRPC, so the drafter's global table learns the
answer; asked again on the page, the answer is drafted from that table where
the request's own context has nothing yet, and from the context once the
answer starts repeating itself.

The page is served under a Content-Security-Policy, and Chromium's console
must report no violation of it. Stop and a cut stream are driven through
``CuttingLink``, a proxy that passes a streamed answer's first token and then
drops the connection, ends the body before ``data: [DONE]``, or holds it open.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import threading
import time
import urllib.request

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
        verifier = HttpVerifier(chat_model_dir, "--drafter", drafter.address, "--drafter-timeout-seconds", "5")
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
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for CSP violations
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


SETTLED = ("done", "stopped", "cut:", "error:")
CUT = "cut: the stream was cut before it finished"


def fill_in_and_generate(browser, prompt: str, max_tokens: int, temperature: str = "0", seed: str = "", k: str = "") -> None:
    fields = (("prompt", prompt), ("max-tokens", str(max_tokens)), ("temperature", temperature), ("seed", seed), ("k", k))
    for element_id, value in fields:
        element = browser.find_element(By.ID, element_id)
        element.clear()
        if value:
            element.send_keys(value)
    browser.find_element(By.ID, "run").click()


def settled_status(browser) -> str:
    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, PAGE_TIMEOUT_S).until(lambda _: status.text.startswith(SETTLED))
    return status.text


def run_on_the_page(browser, prompt: str, max_tokens: int, temperature: str = "0", seed: str = "", k: str = "") -> str:
    """Fill the form, click Generate, and return the status once it settles."""
    fill_in_and_generate(browser, prompt, max_tokens, temperature, seed, k)
    return settled_status(browser)


def csp_reports(browser) -> list[str]:
    """Console messages since the last call that report a Content-Security-Policy violation."""
    return [entry["message"] for entry in browser.get_log("browser") if "Content Security Policy" in entry["message"]]


def test_the_page_is_served_with_a_content_security_policy(services):
    _, verifier = services
    with urllib.request.urlopen(verifier.base + "/", timeout=30) as response:
        headers = response.headers
    policy = {part.split()[0]: part.split()[1:] for part in headers["Content-Security-Policy"].split(";")}
    assert policy["default-src"] == ["'none'"]
    assert policy["connect-src"] == ["'self'"]
    # The page's one inline script and one style sheet, by hash: nothing else runs or styles it.
    assert len(policy["script-src"]) == 1 and policy["script-src"][0].startswith("'sha256-")
    assert len(policy["style-src"]) == 1 and policy["style-src"][0].startswith("'sha256-")
    for directive in ("frame-ancestors", "base-uri", "object-src", "form-action"):
        assert policy[directive] == ["'none'"], directive
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Referrer-Policy"] == "no-referrer"


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
    # The table learned this very answer and has predicted the context's end, so it leads the
    # drafts (the request's own context drafts where it does not): its tokens are coloured so.
    assert output.find_elements(By.CSS_SELECTOR, "span.global"), "no accepted draft from the global table"
    sources = {span.get_attribute("class") for span in output.find_elements(By.CSS_SELECTOR, ".step > span")}
    assert sources <= {"context", "global", "successor", "target"}, sources
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

    assert browser.find_element(By.ID, "k-label").text == "adaptive K"

    # Sampled with a seed and a fixed K: the drafts (the greedy answer, from the table) are turned
    # down where the sample leaves them, struck through; both panes show the same sample. K is
    # fixed because the tiny model's sampled text is near uniform: adaptive K soon learns that
    # its drafts seldom pay and verifies next to none, so whether one is turned down is chance.
    assert run_on_the_page(browser, PROMPT, MAX_TOKENS, temperature="1.5", seed="7", k="4") == "done"
    assert browser.find_element(By.ID, "k-label").text == "K=4"
    steps = output.find_elements(By.CSS_SELECTOR, ".step")
    assert int(browser.find_element(By.ID, "passes").text) == len(steps)
    rejected = output.find_elements(By.CSS_SELECTOR, ".step > s.rejected")
    assert rejected, "no rejected draft shown"
    assert all(len(step.find_elements(By.CSS_SELECTOR, ":scope > s.rejected")) <= 4 for step in steps)
    assert browser.execute_script(KEPT_TEXT, "#output") == browser.find_element(By.ID, "plain-output").get_attribute("textContent")
    ActionChains(browser).move_to_element(rejected[0]).perform()
    WebDriverWait(browser, 10).until(lambda _: tip.is_displayed() and "rejected" in tip.text)

    # All of that ran under the page's Content-Security-Policy without a violation; and the policy
    # is enforced (and its reports reach this log): a script added to the page does not run.
    assert csp_reports(browser) == []
    browser.execute_script(
        "const s = document.createElement('script'); s.textContent = 'window.injected = true'; document.body.appendChild(s);"
    )
    assert browser.execute_script("return window.injected === undefined")
    assert any("script-src" in message for message in csp_reports(browser))


@pytest.fixture(scope="module")
def keyed_verifier(chat_model_dir):
    verifier = HttpVerifier(chat_model_dir, "--api-key", API_KEY)
    try:
        yield verifier
    finally:
        verifier.process.stop()


STORED_KEYS = "return [sessionStorage.getItem('specdec-api-key'), localStorage.length];"


def test_with_api_keys_the_page_asks_for_one_sends_it_and_keeps_it_for_the_tab(keyed_verifier, browser):
    request = pb.GenerateRequest(prompt=PROMPT, chat=True, max_new_tokens=8)
    reference = keyed_verifier.stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=PAGE_TIMEOUT_S)
    browser.get(keyed_verifier.base + "/")  # the page itself is open
    # A key an older page kept in localStorage (on disk, for every later page of the origin) is removed.
    browser.execute_script("localStorage.setItem('specdec-api-key', 'a key from an older page');")
    browser.refresh()
    assert browser.execute_script(STORED_KEYS) == [None, 0]
    assert browser.find_element(By.ID, "api-key").get_attribute("value") == ""
    status = run_on_the_page(browser, PROMPT, 8)
    assert status.startswith("error: this verifier requires an API key") and status.endswith("(enter the API key above)")
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    assert run_on_the_page(browser, PROMPT, 8) == "done"
    assert browser.execute_script(KEPT_TEXT, "#output") == reference.text
    browser.get(keyed_verifier.base + "/")  # a reload of the tab keeps the key (sessionStorage), never localStorage
    assert browser.find_element(By.ID, "api-key").get_attribute("value") == API_KEY
    assert browser.execute_script(STORED_KEYS) == [API_KEY, 0]
    assert run_on_the_page(browser, PROMPT, 8) == "done"


# Time for the page to show a token before its stream is cut: a failed read discards what it had queued.
SHOWN_S = 0.5


class CuttingLink:
    """A proxy to ``target_port`` on 127.0.0.1 that passes every response whole, but for a streamed
    one (``text/event-stream``, chunked) passes its headers and body chunks up to the first with a
    token in it, and then, by ``ending``: "hold" keeps the connection open and passes nothing more
    (a stream still running); a moment later (for the page to show that token), "drop" closes the
    connection mid-body (a dropped connection) and "end" ends the body properly before
    ``data: [DONE]`` (a server that gave up). ``held`` counts the streams held, ``released`` those
    whose connection the browser has closed since."""

    def __init__(self, target_port: int, ending: str) -> None:
        assert ending in ("drop", "end", "hold"), ending
        self.target_port, self.ending = target_port, ending
        self.held: set[socket.socket] = set()
        self.released: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(1 << 16):
                upstream.sendall(data)
        except OSError:
            pass
        if client in self.held:
            self.released.add(client)
        for end in (client, upstream):
            end.close()

    def _responses(self, upstream: socket.socket, client: socket.socket) -> None:
        buffer = b""
        try:
            while True:
                start = buffer.find(b"text/event-stream")
                body = buffer.find(b"\r\n\r\n", start) + 4 if start >= 0 else -1
                if body > 3:
                    cut = self._cut_after_first_token(buffer, body)
                    if cut is not None:
                        if self.ending == "hold":
                            self.held.add(client)
                        client.sendall(buffer[:cut])
                        break
                elif start >= 0:
                    pass  # the stream's headers are still arriving
                else:  # no stream yet on this connection: pass what came, whole
                    client.sendall(buffer)
                    buffer = b""
                select.select([upstream], [], [])
                data = upstream.recv(1 << 16)
                if not data:
                    client.close()
                    return
                buffer += data
            if self.ending == "hold":
                return  # the connection stays open; the browser ends it
            time.sleep(SHOWN_S)
            if self.ending == "end":
                client.sendall(b"0\r\n\r\n")  # the chunked body's proper end
            client.shutdown(socket.SHUT_RDWR)
            client.close()
        except (OSError, ValueError):
            return

    @staticmethod
    def _cut_after_first_token(buffer: bytes, body: int) -> int | None:
        """Where the body's first chunk with a token ends, once the buffer holds it (None before)."""
        position = body
        while (size_end := buffer.find(b"\r\n", position)) >= 0:
            end = size_end + 2 + int(buffer[position:size_end].split(b";")[0], 16) + 2
            if end > len(buffer):
                return None
            if b'"token_ids"' in buffer[position:end]:
                return end
            position = end
        return None


@pytest.fixture
def cutting_link(services, request):
    _, verifier = services
    link = CuttingLink(int(verifier.base.rsplit(":", 1)[1]), request.param)
    try:
        yield link
    finally:
        link.close()


@pytest.mark.parametrize("cutting_link", ["drop", "end"], indirect=True)
def test_a_stream_cut_before_done_shows_as_cut_never_as_done(cutting_link, browser):
    browser.get(f"http://127.0.0.1:{cutting_link.port}/")
    status = run_on_the_page(browser, PROMPT, MAX_TOKENS)
    # A dropped connection fails the body's read; an ended body is whole as HTTP, but lacks [DONE].
    reason = "the connection failed" if cutting_link.ending == "drop" else "the connection closed"
    assert status.startswith(f"{CUT} ({reason}"), status
    assert browser.find_element(By.ID, "status").get_attribute("class") == "error"
    # What came before the cut stays on the page (a pane whose stream was not cut first is stopped with it).
    shown = browser.find_elements(By.CSS_SELECTOR, "#output .step") or browser.find_element(By.ID, "plain-output").text
    assert shown, "the tokens that came before the cut are not shown"
    assert browser.find_element(By.ID, "run").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()


@pytest.mark.parametrize("cutting_link", ["hold"], indirect=True)
def test_stop_aborts_the_running_streams(cutting_link, browser):
    browser.get(f"http://127.0.0.1:{cutting_link.port}/")
    assert not browser.find_element(By.ID, "stop").is_enabled()  # nothing to stop yet
    fill_in_and_generate(browser, PROMPT, MAX_TOKENS)
    # Both streams have shown their first token, and the link holds the rest: they are running.
    WebDriverWait(browser, PAGE_TIMEOUT_S).until(lambda _: browser.find_element(By.ID, "plain-output").text)
    WebDriverWait(browser, PAGE_TIMEOUT_S).until(lambda _: browser.find_elements(By.CSS_SELECTOR, "#output .step"))
    assert browser.find_element(By.ID, "status").text == "generating..."
    browser.find_element(By.ID, "stop").click()
    assert settled_status(browser) == "stopped"
    assert browser.find_element(By.ID, "run").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
    assert len(cutting_link.held) == 2  # the speculative stream and plain decoding's
    deadline = time.monotonic() + 10
    while cutting_link.released != cutting_link.held:
        assert time.monotonic() < deadline, "the browser kept the streams' connections open"
        time.sleep(0.1)
