"""Seeing the server live: the device-utilization metrics, the dashboard's endpoints and `tokenmill top`.

Fast: the engine is the real engine code around a fake model runner (test_server_failures.fake_engine),
whose "forward pass" spins the CPU for a known time, so the busy share has an independent measure (the
engine thread's CPU time, from the OS). The browser test is in test_dashboard_browser.py.
"""

from __future__ import annotations

import base64
import http.server
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.cli import main
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.engine.messages import StepStats
from tokenmill.perf.roofline import Roofline
from tokenmill.engine.utilization import UtilizationMeter
from tokenmill.monitor.scrape import Scrape, frame, histogram_quantile

from helpers import metric
from test_server_failures import FakeRunner, fake_engine, running

KEY = "dash-key"




class SpinRunner(FakeRunner):
    """A fake model whose forward pass keeps a CPU busy for ``delay`` seconds: its busy time is CPU time."""

    def execute(self, sched) -> ModelRunnerOutput:  # noqa: ANN001
        self.forward_s = 0.0
        if sched.scheduled:
            t = time.perf_counter()
            while time.perf_counter() - t < self.delay:
                pass
            self.forward_s = time.perf_counter() - t
        return ModelRunnerOutput({s.request_id: [self.tokens[(s.start_pos + len(s.token_ids)) % len(self.tokens)]]
                                  for s in sched.scheduled if s.needs_logits})


def spinning_engine(delay: float = 0.02):
    engine = fake_engine(delay=delay)
    runner = SpinRunner(engine.core.runner.tokens, delay)
    engine.core.runner = engine.runner = runner
    return engine


def complete(url: str, max_tokens: int = 8, headers: dict | None = None) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": "the cat", "max_tokens": max_tokens, "ignore_eos": True},
                   headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---- the figures -------------------------------------------------------------------------------


def test_histogram_quantile_interpolates_as_prometheus_does():
    # 10 observations in (0, 0.1], 10 in (0.1, 0.5], none beyond
    buckets = {0.1: 10.0, 0.5: 20.0, float("inf"): 20.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.99, {0.1: 0.0, 1.0: 0.0, float("inf"): 5.0}) == 1.0  # past the last bound
    assert histogram_quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


VLLM_OLD = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {running}
vllm:num_requests_waiting{{model_name="m"}} 1
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{model_name="m"}} 0.25
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{model_name="m"}} {gen}
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{{le="0.01",model_name="m"}} {fast}
vllm:time_per_output_token_seconds_bucket{{le="0.1",model_name="m"}} {slow}
vllm:time_per_output_token_seconds_bucket{{le="+Inf",model_name="m"}} {slow}
vllm:time_per_output_token_seconds_count{{model_name="m"}} {slow}
vllm:time_per_output_token_seconds_sum{{model_name="m"}} 1.0
"""


def test_frame_reads_vllms_older_names_and_takes_histogram_deltas():
    a = Scrape.from_text(VLLM_OLD.format(running=2, gen=100, fast=100, slow=100), time=10.0)
    b = Scrape.from_text(VLLM_OLD.format(running=3, gen=400, fast=100, slow=200), time=12.0)
    f = frame(b, a, a)
    assert (f["running"], f["waiting"], f["kv_usage"]) == (3, 1, 0.25)
    assert f["generation_tps"] == pytest.approx(150.0)
    # over the window only the 100 new observations count, all in (0.01, 0.1]: the median is mid-bucket
    assert f["itl_p50"] == pytest.approx(0.055)
    # since the start, half were fast
    assert frame(b, a, None)["itl_p50"] == pytest.approx(0.01)
    assert f["device_busy"] is None and f["ttft_p50"] is None  # not exported: not made up
    assert b.model == "m" and b.is_inference_server


def test_meter_windows_split_wall_time_by_phase():
    roof = Roofline("test", peak_flops=1e9, peak_bandwidth=1e8, source="given")
    meter = UtilizationMeter(roof, cpu=None, window=10.0)
    meter.start = 0.0
    # 2 steps of 1 s each (0.6 forward, 0.2 sample, 0.1 schedule, 0.1 other) at t = 5 and 7
    for t in (5.0, 7.0):
        meter.on_step(StepStats(t, 1.0, 10, 0, 1, 1, 0, 1, 0, schedule_s=0.1, forward_s=0.6, sample_s=0.2,
                                flops=3e8, bytes=6e7))
    w = meter.recent(now=10.0)
    assert w.fractions["forward"] == pytest.approx(0.12) and w.fractions["sample"] == pytest.approx(0.04)
    assert w.fractions["other"] == pytest.approx(0.02) and w.fractions["idle"] == pytest.approx(0.8)
    assert w.device_busy == pytest.approx(0.12)
    assert w.achieved_flops == pytest.approx(6e8 / 1.2) and w.achieved_bandwidth == pytest.approx(1.2e8 / 1.2)
    # 6 s later the window starts at 6: the first step is gone, the second counts whole
    w = meter.recent(now=16.0)
    assert w.device_busy == pytest.approx(0.06)
    # a step straddling the window's start counts pro rata
    w = meter.recent(now=17.5)
    assert w.device_busy == pytest.approx(0.5 * 0.6 / 10)
    assert meter.phase_seconds["forward"] == pytest.approx(1.2)  # the counters keep everything


# ---- /metrics --------------------------------------------------------------------------------


def test_device_busy_agrees_with_the_engine_threads_cpu_time():
    """Load at a known duty cycle (8 steps of 25 ms, then 200 ms idle): the forward-phase seconds on
    /metrics match the CPU time the OS charged to the engine thread, and the busy ratio the cycle."""
    engine = spinning_engine(delay=0.025)
    with running(engine) as (srv, ae, _):
        complete(srv.url, 2)  # warm: the engine thread exists
        thread = next(t for t in psutil.Process().threads() if t.id == ae._thread.native_id)

        def cpu() -> float:
            t = next(t for t in psutil.Process().threads() if t.id == thread.id)
            return t.user_time + t.system_time

        text0, cpu0, t0 = httpx.get(srv.url + "/metrics").text, cpu(), time.perf_counter()
        while time.perf_counter() - t0 < 4.0:
            complete(srv.url, 8)
            time.sleep(0.2)
        text1, cpu1, wall = httpx.get(srv.url + "/metrics").text, cpu(), time.perf_counter() - t0
        busy_gauge = metric(text1, "tokenmill:device_busy_ratio")
    fwd = metric(text1, "tokenmill:engine_phase_seconds_total", phase="forward") - \
        metric(text0, "tokenmill:engine_phase_seconds_total", phase="forward")
    spent = cpu1 - cpu0
    # the thread's CPU time also covers scheduling and HTTP-free bookkeeping: a few percent of the wall time
    assert abs(spent - fwd) < 0.1 * wall, (spent, fwd, wall)
    duty = 8 * 0.025 / (8 * 0.025 + 0.2)
    assert fwd / wall == pytest.approx(duty, abs=0.2)
    assert busy_gauge == pytest.approx(fwd / wall, abs=0.15)


def test_utilization_metrics_are_exported_and_say_what_is_missing():
    engine = fake_engine(delay=0.01)
    with running(engine) as (srv, ae, _):
        complete(srv.url, 4)
        text = httpx.get(srv.url + "/metrics").text
    phases = {p: metric(text, "tokenmill:engine_phase_seconds_total", phase=p)
              for p in ("schedule", "draft", "forward", "sample", "other")}
    busy = metric(text, "tokenmill:engine_busy_seconds_total")
    assert phases["forward"] > 0 and sum(phases.values()) == pytest.approx(busy, rel=1e-6)
    fractions = {p: metric(text, "tokenmill:engine_time_fraction", phase=p) for p in (*phases, "idle")}
    assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-6)
    assert metric(text, "tokenmill:engine_cpus") >= 1 and metric(text, "tokenmill:engine_cpu_seconds_total") > 0
    assert metric(text, "tokenmill:step_forward_fraction_count") >= 4
    # on the CPU there is no NVML: the info says so and no gpu_* metric pretends to be zero
    info = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "tokenmill:device_info"]
    assert info and "not an NVIDIA GPU" in info[0].labels["nvml"]
    assert "tokenmill:gpu_utilization_ratio" not in text


# ---- the dashboard's endpoints -----------------------------------------------------------------------


def test_dashboard_endpoints_reject_bad_input():
    with running() as (srv, ae, _):
        get = lambda path: httpx.get(srv.url + path, timeout=30)  # noqa: E731
        for path, param in (("/dashboard/data?window=1e9", "window"), ("/dashboard/data?window=0", "window"),
                            ("/dashboard/data?since=nan", "since"), ("/dashboard/data?since=-1", "since"),
                            ("/dashboard/data?bogus=1", "bogus"), ("/dashboard/requests?limit=100000", "limit"),
                            ("/dashboard/requests?limit=x", "limit"), ("/dashboard?x=1", "x")):
            r = get(path)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        assert get("/dashboard/static/dashboard.py").status_code == 404
        assert get("/dashboard/static/..%2Fdashboard.py").status_code == 404
        page = get("/dashboard")
        assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
        lib = get("/dashboard/static/uPlot.iife.min.js")
        assert lib.status_code == 200 and lib.text.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32)")
        assert "MIT" in get("/dashboard/static/uPlot.LICENSE").text
        assert ae.is_running  # bad input did not hurt the engine
        complete(srv.url, 2)


def test_dashboard_uses_the_api_key_and_a_browser_can_send_it_as_basic_auth():
    with running(api_key=KEY) as (srv, _, _):
        r = httpx.get(srv.url + "/dashboard")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(srv.url + "/v1/models").headers["www-authenticate"] == "Bearer"
        basic = "Basic " + base64.b64encode(f"anyone:{KEY}".encode()).decode()
        wrong = "Basic " + base64.b64encode(b"anyone:nope").decode()
        assert httpx.get(srv.url + "/dashboard", headers={"Authorization": basic}).status_code == 200
        assert httpx.get(srv.url + "/dashboard/data", headers={"Authorization": wrong}).status_code == 401
        assert httpx.get(srv.url + "/dashboard/data", headers={"Authorization": "Basic %%%"}).status_code == 401
        assert httpx.get(srv.url + "/dashboard/data", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        # the key as a Basic password works on the API too, as for any client that can only send Basic
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": basic}).status_code == 200


def test_dashboard_data_agrees_with_metrics_and_lists_in_flight_requests():
    engine = fake_engine(delay=0.05)
    with running(engine) as (srv, ae, _):
        history = srv.app.state.history
        done: list[dict] = []
        workers = [threading.Thread(target=lambda: done.append(complete(srv.url, 30))) for _ in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 10
        while True:  # the table while they run: no prompt text, each decoding
            table = httpx.get(srv.url + "/dashboard/requests").json()
            if table["total"] == 3 and all(r["state"] == "decode" for r in table["requests"]):
                break
            assert time.monotonic() < deadline, table
            time.sleep(0.05)
        row = table["requests"][0]
        assert set(row) == {"id", "state", "computed_tokens", "total_tokens", "prompt_tokens", "output_tokens",
                            "max_tokens", "age_s"}
        assert row["max_tokens"] == 30 and 0 < row["output_tokens"] < 30 and row["age_s"] > 0
        assert row["computed_tokens"] == row["total_tokens"] - 1  # the newest token's KV comes next step
        one = httpx.get(srv.url + "/dashboard/requests?limit=1").json()
        assert one["total"] == 3 and [r["id"] for r in one["requests"]] == [table["requests"][0]["id"]]  # oldest
        for w in workers:
            w.join()
        history.sample()  # a reading after the load (the sampler takes one a second anyway)
        data = httpx.get(srv.url + "/dashboard/data").json()
        text = httpx.get(srv.url + "/metrics").text
        assert httpx.get(srv.url + "/dashboard/requests").json() == {"total": 0, "requests": []}
    cols = data["frames"]
    assert len(cols["time"]) >= 2 and cols["time"] == sorted(cols["time"])
    # idle now: the last reading's totals are /metrics' totals exactly
    assert cols["generation_tokens_total"][-1] == metric(text, "vllm:generation_tokens_total") == 3 * 30 and len(done) == 3
    assert cols["finished_total"][-1] == metric(text, "vllm:request_success_total")
    assert cols["running"][-1] == 0 and max(c for c in cols["generation_tps"] if c is not None) > 0
    assert cols["ttft_p50"][-1] is not None and cols["itl_p99"][-1] is not None
    assert max(v for v in cols["device_busy"] if v is not None) > 0.2
    # only newer readings come back after `since` (the sampler may have taken more since the page was read)
    after = [f["time"] for f in history.frames(since=cols["time"][-2])]
    assert after[0] == cols["time"][-1] and after == sorted(after) and len(set(after)) == len(after)


def test_no_dashboard_flag_turns_it_off():
    with running(dashboard=False) as (srv, _, _):
        assert httpx.get(srv.url + "/dashboard").status_code == 404
        assert srv.app.state.history is None
        complete(srv.url, 2)


# ---- tokenmill top --------------------------------------------------------------------------------


def test_top_once_against_a_live_tokenmill_server(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    engine = fake_engine(delay=0.02)
    with running(engine, api_key=KEY) as (srv, _, _):
        load = threading.Thread(target=lambda: [complete(srv.url, 20, {"Authorization": f"Bearer {KEY}"})
                                                for _ in range(3)])
        load.start()
        time.sleep(0.3)
        assert main(["top", srv.url, "--once", "--interval", "0.5", "--api-key", KEY]) == 0
        load.join()
        assert main(["top", srv.url, "--once", "--interval", "0.1"]) == 1  # no key
    out, err = capsys.readouterr()
    assert "generation tokens/s" in out and "TTFT p50 / p99" in out and "device busy" in out
    gen = float(out.split("generation tokens/s")[1].split()[0])
    assert gen > 0
    assert "needs an API key" in err


class ScriptedVllm(http.server.BaseHTTPRequestHandler):
    """Answers /metrics with vLLM's (older) text, its counters moving by a script."""

    calls = 0

    def do_GET(self) -> None:  # noqa: N802
        type(self).calls += 1
        n = type(self).calls
        body = VLLM_OLD.format(running=4, gen=100 * n, fast=10 * n, slow=20 * n).encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


@pytest.fixture()
def vllm_url():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ScriptedVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_top_reads_a_vllm_server(vllm_url, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["top", vllm_url + "/v1", "--once", "--interval", "0.5"]) == 0
    out = capsys.readouterr().out
    # two readings 0.5 s apart, 100 tokens between them: about 200 tokens/s (the scrape times add a little)
    gen = float(out.split("generation tokens/s")[1].split()[0])
    assert 120 < gen <= 200
    assert "KV cache used" in out and "25.0%" in out
    assert "device busy" not in out  # vLLM does not export it: top leaves the row out


def test_top_says_what_is_wrong_with_a_server_it_cannot_read(vllm_url, capsys):
    assert main(["top", vllm_url + "/nothing/metrics", "--once", "--interval", "0.1"]) == 1
    assert "answered HTTP 404" in capsys.readouterr().err
