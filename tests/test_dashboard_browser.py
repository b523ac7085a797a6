"""The dashboard in a real browser: Playwright drives Debian's chromium (never a downloaded
browser) against a real server with an API key. The page asks for the key, then its hit-rate
figure, pool chart, tree view and speculation figure must come to match /v1/cache/stats after
traffic sent through the openai SDK, and a prompt holding `<script>` must show as text."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from radixserve.server.observability.dashboard import install_dashboard
from radixserve.testing.server import ServerProcess, wait_idle
from tests.support.servers import running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

try:
    from playwright import sync_api
except ImportError:  # the test extra installs it
    sync_api = None

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    sync_api is None or CHROMIUM is None,
    reason="pip install playwright (the test extra)" if sync_api is None else
           "Debian's chromium is not installed: apt-get install chromium (make test does it "
           "where apt-get runs as root)")

KEY = "sk-dashboard-test"
SCRIPT = "<script>alert(1)</script>"
SHARED = ("You are the support assistant of a small bakery. Answer in one short sentence. "
          "The bakery opens at seven, sells sourdough, rye and croissants, and closes on "
          "Mondays. ") * 3
QUESTIONS = ["When do you open?", "Do you sell rye?", "Are you open on Monday?",
             "What bread do you have?"]
REPEAT = "Repeat exactly: one two three four, one two three four, one two three four."
POOL_STATES = ("free", "evictable", "protected", "pinned", "private")
# The page polls once a second; a figure gets a few polls to catch up with the endpoint.
CATCH_UP_MS = 5000


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--api-key", KEY, "--kv-cache-tokens", "2048",
                        "--served-model-name", "radixserve", "--speculative", "ngram") as proc:
        yield proc


@pytest.fixture(scope="module")
def dialogs() -> list[str]:
    """The messages of every dialog the page opened: an alert() would be prompt text run as
    script."""
    return []


@pytest.fixture(scope="module")
def page(server: ServerProcess, dialogs: list[str]) -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                             args=["--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(15_000)
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        yield page
        browser.close()


def stats(server: ServerProcess, window: str = "5m") -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/v1/cache/stats", params={"window": window},
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=30, trust_env=False)
    response.raise_for_status()
    return response.json()


def wait_for_value(page: Any, testid: str, expected: float) -> None:
    """Until the element's data-value equals `expected` (the page refreshes once a second)."""
    page.wait_for_function(
        """([testid, expected]) => {
             const node = document.querySelector(`[data-testid="${testid}"]`);
             return node && node.dataset.value !== "" &&
                    Math.abs(Number(node.dataset.value) - expected) <= 1e-9 * Math.max(1, expected);
           }""", arg=[testid, expected], timeout=CATCH_UP_MS)


def send_traffic(server: ServerProcess) -> None:
    """A shared system prompt under four questions, twice each, and a salted prompt that
    starts with a script tag (twice, so it is served from cache too)."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0,
                       timeout=120) as client:
        for _ in range(2):
            for question in QUESTIONS:
                client.chat.completions.create(
                    model="radixserve", max_tokens=2, temperature=0,
                    messages=[{"role": "system", "content": SHARED},
                              {"role": "user", "content": question}])
            client.completions.create(model="radixserve", max_tokens=2, temperature=0,
                                      prompt=f"{SCRIPT} is a tag that runs code in a page.",
                                      extra_body={"cache_salt": "xss"})


def test_page_and_its_files_are_served_without_a_key() -> None:
    app = FastAPI()
    install_dashboard(app)
    with TestClient(app) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        # Only its own files: no inline script may run, whatever text reaches the page.
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "connect-src 'self'" in policy
        for asset in ("/dashboard/dashboard.js", "/dashboard/dashboard.css"):
            assert asset in page.text
            assert http.get(asset).status_code == 200
        assert ".innerHTML" not in http.get("/dashboard/dashboard.js").text


@needs_browser
def test_dashboard_follows_the_stats_endpoint(server: ServerProcess, page: Any, dialogs: list[str],
                                              tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert httpx.get(server.base_url + "/v1/cache/stats", trust_env=False).status_code == 401
    shot = tmp_path / "dashboard.png"
    try:
        # The page itself needs no key; its data does: it asks once and keeps it for the tab.
        page.goto(server.base_url + "/dashboard")
        page.get_by_test_id("key-input").fill("sk-wrong")
        page.get_by_test_id("key-submit").click()
        sync_api.expect(page.locator("#key-error")).to_contain_text("rejected")
        page.get_by_test_id("key-input").fill(KEY)
        page.get_by_test_id("key-submit").click()
        sync_api.expect(page.get_by_test_id("status")).to_have_attribute("data-state", "live")
        assert KEY not in page.url
        assert page.evaluate("sessionStorage.getItem('radixserve.apiKey')") == KEY
        page.reload()
        sync_api.expect(page.get_by_test_id("status")).to_have_attribute("data-state", "live")
        sync_api.expect(page.get_by_test_id("key-form")).to_be_hidden()
        wait_for_value(page, "requests-total", 0)

        send_traffic(server)
        wait_idle(server.base_url)
        now = stats(server)
        assert now["totals"]["requests"] == 2 * (len(QUESTIONS) + 1)
        assert now["totals"]["hit_rate"] > 0

        # Figures: the same numbers as the endpoint once the page has polled after the traffic.
        wait_for_value(page, "requests-total", now["totals"]["requests"])
        wait_for_value(page, "hit-rate", now["totals"]["hit_rate"])
        wait_for_value(page, "cached-tokens", now["totals"]["cached_tokens"])

        # Pool chart: every state's current figure, the capacity, one path per drawn state.
        for state in POOL_STATES:
            wait_for_value(page, f"pool-{state}", now["pool"][state])
        chart = page.get_by_test_id("pool-chart")
        sync_api.expect(chart).to_have_attribute("data-total", str(now["pool"]["total"]))
        assert int(chart.get_attribute("data-points")) == len(stats(server)["series"]["t"])
        assert chart.locator("path[data-layer=evictable]").get_attribute("d")

        # Tree view: the top-level prefixes as the endpoint lists them (edge text, tokens, hits).
        roots = page.locator("#tree > li[data-testid=tree-node]")
        sync_api.expect(roots).to_have_count(len(now["tree"]["roots"]))
        shown = sorted((r.locator(".edge").first.get_attribute("title"),
                        int(r.get_attribute("data-tokens")), int(r.get_attribute("data-hits")))
                       for r in roots.all())
        assert shown == sorted((n["text"], n["tokens"], n["hits"]) for n in now["tree"]["roots"])
        # A node with children shows them, and hides them at a click on its toggle.
        index = page.evaluate("[...document.querySelectorAll('#tree > li')]"
                              ".findIndex(li => li.getAttribute('aria-expanded') === 'true')")
        assert index >= 0, "no top-level prefix with children: the shared prefix should be one"
        parent = roots.nth(index)
        sync_api.expect(parent.locator(":scope > ul > li")).not_to_have_count(0)
        parent.locator(".toggle").first.click()
        sync_api.expect(parent).to_have_attribute("aria-expanded", "false")
        sync_api.expect(parent.locator(":scope > ul > li")).to_have_count(0)

        # The script tag is shown as text and never becomes an element or runs.
        sync_api.expect(page.get_by_test_id("tree-text").filter(has_text="<script>alert(1)")
                        ).not_to_have_count(0)
        assert page.evaluate("document.scripts.length") == 1  # dashboard.js itself
        assert dialogs == []

        # The window switch: the 1 h series has 60 one-minute buckets.
        page.get_by_role("button", name="1 h").click()
        sync_api.expect(page.get_by_test_id("hit-rate-chart")).to_have_attribute(
            "data-points", str(len(stats(server, "1h")["series"]["t"])))

        # Speculation: a reply that repeats its prompt drafts from it; the figure follows.
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0,
                           timeout=120) as client:
            client.chat.completions.create(model="radixserve", max_tokens=24, temperature=0,
                                           messages=[{"role": "user", "content": REPEAT}])
        wait_idle(server.base_url)
        spec = stats(server)["speculation"]
        assert spec["mode"] == "ngram" and spec["draft_tokens"] > 0, spec
        wait_for_value(page, "spec-drafted", spec["draft_tokens"])
        wait_for_value(page, "spec-acceptance", spec["acceptance_rate"])
        sync_api.expect(page.get_by_test_id("spec-mode")).to_contain_text("ngram")
    finally:
        page.screenshot(path=str(shot), full_page=True)
        with capsys.disabled():
            print(f"\ndashboard screenshot: {shot}")
