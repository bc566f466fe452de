"""The dashboard in a real browser: headless Chromium (Debian's package, driven by Selenium through its own
chromedriver, nothing downloaded) against the real server on the default model in its default mode, under
load from `tokenmill bench serve`. The page loads without console errors, its charts update, and the
numbers it shows agree with /metrics within a sampling interval (exactly, once the load is over).

`.ci/run` installs chromium and chromium-driver and sets TOKENMILL_REQUIRE_BROWSER=1, so there a missing
browser fails the test; elsewhere it skips saying what to install. TOKENMILL_DASHBOARD_SCREENSHOT=PATH
saves a screenshot of the page under load (the README's)."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest

from tokenmill.cli import main
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.app import ServerConfig, build_app
from tokenmill.server.run import BackgroundServer

from helpers import metric

pytestmark = pytest.mark.slow

KEY = "browser-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture()
def browser():
    missing = [what for what, ok in (("chromium", CHROMIUM), ("chromedriver (chromium-driver)", CHROMEDRIVER))
               if not ok]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install selenium)")
    if missing:
        why = f"the browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("TOKENMILL_REQUIRE_BROWSER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1800"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def shown(driver, key: str) -> float | None:
    """A tile's raw value (its data-value), as the page last rendered it."""
    v = driver.find_element("id", "v-" + key).get_attribute("data-value")
    return float(v) if v else None


def wait_for(condition, timeout: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def test_dashboard_in_chromium_under_load(llm_default, browser, tmp_path):
    engine = llm_default.engine  # the configuration a user gets with no flags
    ae = AsyncEngine(engine, max_waiting_requests=64, log_interval=None)
    srv = BackgroundServer(build_app(ae, ServerConfig(api_key=KEY))).start()
    auth = {"Authorization": f"Bearer {KEY}"}
    bench_rc: list[int] = []
    bench = threading.Thread(target=lambda: bench_rc.append(main([
        "bench", "serve", "--base-url", srv.url, "--model", "smollm2-135m-instruct", "--num-prompts", "40",
        "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "24", "--request-rate", "4",
        "--ignore-eos", "--disable-tqdm", "--api-key", KEY])))
    try:
        host = srv.url.removeprefix("http://")
        browser.get(f"http://user:{KEY}@{host}/dashboard")  # the key as Basic auth's password
        bench.start()
        # the charts draw and update: the sample time moves, the requests chart has a canvas
        first = wait_for(lambda: browser.find_element("tag name", "body").get_attribute("data-sample-time"), 15,
                         "the first data")
        wait_for(lambda: browser.find_element("tag name", "body").get_attribute("data-sample-time") != first, 10,
                 "an update")
        wait_for(lambda: (shown(browser, "running") or 0) > 0, 30, "running requests on the page")
        for chart in ("requests", "cache", "ttft", "itl", "tps", "device"):
            assert browser.find_elements("css selector", f"#chart-{chart} canvas"), chart
        assert browser.find_element("id", "status").text == "live"
        # under load: the page's totals trail /metrics by at most a sampling interval's (and a poll's) worth
        wait_for(lambda: (shown(browser, "generation_tokens_total") or 0) > 50, 60, "tokens on the page")
        page_total, page_tps = shown(browser, "generation_tokens_total"), shown(browser, "generation_tps")
        served = metric(httpx.get(srv.url + "/metrics", headers=auth).text, "vllm:generation_tokens_total")
        assert page_total <= served <= page_total + 3.0 * max(page_tps, 1.0) + 30, (page_total, served, page_tps)
        # the in-flight table fills while requests run, with states and no prompt text
        # (the table is rebuilt every 2 s: a row is read and clicked in one script, never held across a refresh)
        # a row's request as a waterfall: its steps drawn from GET /v1/requests/{id}/timeline
        rid, state = wait_for(lambda: browser.execute_script(
            "const r = document.querySelector('#requests tbody tr');"
            "if (!r) return null; const got = [r.dataset.id, r.children[1].textContent]; r.click(); return got;"),
            20, "table rows")
        assert state in ("waiting", "prefill", "decode", "preempted")
        timeline = browser.find_element("id", "timeline")
        wait_for(lambda: timeline.get_attribute("data-request") == rid, 10, "the clicked request's timeline")
        if os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT"):
            time.sleep(4)  # let a few more seconds of load into the charts
            browser.save_screenshot(os.environ["TOKENMILL_DASHBOARD_SCREENSHOT"])
        bench.join(120)
        assert bench_rc == [0]
        # idle: after the next readings the page shows /metrics' totals exactly
        text = httpx.get(srv.url + "/metrics", headers=auth).text
        for key, name in (("generation_tokens_total", "vllm:generation_tokens_total"),
                          ("finished_total", "vllm:request_success_total")):
            want = metric(text, name)
            wait_for(lambda k=key, w=want: shown(browser, k) == w, 10, f"{key} = {want}")
        assert shown(browser, "running") == 0
        # the same request, finished now, looked up by id: every step it took, and the blame for its TTFT
        box = browser.find_element("id", "timeline-id")
        box.clear()
        box.send_keys(rid)
        browser.find_element("css selector", "#timeline-form button").click()
        summary = browser.find_element("id", "timeline-summary")
        wait_for(lambda: "finished" in summary.text and "TTFT:" in summary.text, 10, "the finished timeline")
        want = httpx.get(f"{srv.url}/v1/requests/{rid}/timeline", headers=auth).json()
        steps = [e for e in want["events"] if e["event"] == "step"]
        assert timeline.get_attribute("data-steps") == str(len(steps)) and len(steps) >= 24  # (24 tokens out)
        assert len(browser.find_elements("css selector", "#timeline .tl-prefill, #timeline .tl-decode")) == len(steps)
        box.clear()
        box.send_keys("no-such-request")
        browser.find_element("css selector", "#timeline-form button").click()
        wait_for(lambda: "no timeline for request" in summary.text, 10, "the 404's message")
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
                  and "/v1/requests/no-such-request/" not in e["message"]]  # (the 404 asked for above)
        assert not errors, errors
    finally:
        srv.stop(60)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
