"""``tokenmill router --replica`` in front of servers on loopback: failures on fake replicas (no model), then
``tokenmill serve --data-parallel-size 2`` with the real model: prefix affinity, a replica killed mid-stream,
and a shutdown that leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.helpers import free_port, metric, wait_healthy


def _wait_for(fn, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _fake_replica(name: str) -> tuple[FastAPI, dict]:
    """A replica that answers as told: ``status`` for completions, a stream that breaks off before event
    ``break_at``, ``health`` for /health."""
    app, state = FastAPI(), {"status": 200, "health": 200, "break_at": None, "calls": 0}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=state["health"])

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse("vllm:num_requests_running 0\nvllm:prefix_cache_hits_total 7\n")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        body = await raw.json()
        state["calls"] += 1
        if state["status"] != 200:
            return JSONResponse({"error": {"message": "busy", "type": "server_error", "param": None, "code": None}},
                                state["status"], headers={"Retry-After": "3"})
        if not body.get("stream"):
            return JSONResponse({"id": name})

        async def events():
            for i in range(4):
                if state["break_at"] == i:
                    state["health"] = 503  # a dying replica: its /health fails too, until the test revives it
                    raise RuntimeError("the replica died")  # uvicorn drops the connection mid-body
                yield f'data: {{"id": "{name}", "i": {i}}}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, state


@pytest.fixture()
def fakes():
    from tokenmill.server.router import Router, build_router_app
    from tokenmill.server.routing_policy import RoutingConfig
    from tokenmill.server.run import BackgroundServer

    servers, states = [], []
    for name in ("a", "b"):
        app, state = _fake_replica(name)
        servers.append(BackgroundServer(app).start())
        states.append(state)
    router = Router(replicas=[s.url for s in servers], routing=RoutingConfig("round-robin"), poll_interval=0.1)
    front = BackgroundServer(build_router_app(router)).start()
    yield front.url, router, states
    front.stop(10)
    for s in servers:
        s.stop(10)


def _events(url: str, body: dict) -> list:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ")]


def test_a_failed_replica_is_retried_elsewhere_marked_down_and_polled_back(fakes):
    url, router, (a, b) = fakes
    ra, rb = router.replicas
    _wait_for(lambda: metric(httpx.get(url + "/metrics").text, "tokenmill:router_instance_prefix_cache_hits",
                             instance=ra.url) == 7)  # the replicas' own counters, read by the poll
    assert [httpx.post(url + "/v1/completions", json={"prompt": "x"}).json()["id"] for _ in range(4)] == list("abab")
    a["status"] = 500  # a broken replica: its request is retried on b, the client never knows
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).json()["id"] == "b"
    text = httpx.get(url + "/metrics").text
    assert metric(text, "tokenmill:router_requests_total", instance=ra.url, outcome="failed") == 1
    assert metric(text, "tokenmill:router_retries_total", role="replica") == 1
    a["health"] = 503  # and its /health says so: the poll keeps it down, nothing more goes there
    _wait_for(lambda: not ra.up)
    calls = a["calls"]
    assert {httpx.post(url + "/v1/completions", json={"prompt": "x"}).json()["id"] for _ in range(3)} == {"b"}
    assert a["calls"] == calls
    assert metric(httpx.get(url + "/metrics").text, "tokenmill:router_instance_up", instance=ra.url) == 0
    a["status"], a["health"] = 200, 200
    _wait_for(lambda: ra.up)  # the poll brings it back
    assert {httpx.post(url + "/v1/completions", json={"prompt": "x"}).json()["id"] for _ in range(2)} == {"a", "b"}
    # 503 is an overloaded replica: retried elsewhere but not marked down; from every replica, it goes back
    # to the client as the replicas said it, Retry-After included
    a["status"] = 503
    assert {httpx.post(url + "/v1/completions", json={"prompt": "x"}).json()["id"] for _ in range(2)} == {"b"}
    assert ra.up
    b["status"] = 503
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "3" and r.json()["error"]["message"] == "busy"
    b["status"] = 400  # a client error is the client's: passed through, nobody retried or marked down
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and rb.up
    assert httpx.post(url + "/v1/completions", content=b"{").status_code == 400  # the router's own 400
    assert httpx.get(url + "/health").status_code == 200


def test_a_stream_broken_mid_way_ends_with_an_error_and_one_broken_before_its_first_event_is_retried(fakes):
    url, router, (a, b) = fakes
    ra, _ = router.replicas
    a["break_at"] = 2
    events = _events(url, {"prompt": "x"})  # round robin: a first
    assert [e["i"] for e in events[:2]] == [0, 1] and events[0]["id"] == "a"
    assert events[2]["error"]["code"] == "upstream_failed" and events[3] == "[DONE]" and len(events) == 4
    assert not ra.up
    assert metric(httpx.get(url + "/metrics").text, "tokenmill:router_stream_failures_total", instance=ra.url) == 1
    assert [e["id"] for e in _events(url, {"prompt": "x"})[:4]] == ["b"] * 4  # the next one goes elsewhere
    a["health"] = 200
    _wait_for(lambda: ra.up)
    a["break_at"] = 0  # nothing relayed yet: retried on b, the client never knows
    for _ in range(2):
        events = _events(url, {"prompt": "x"})
        assert [e["id"] for e in events[:4]] == ["b"] * 4 and events[-1] == "[DONE]"
    assert b["calls"] == 3 and a["calls"] >= 2


def test_replicas_die_with_their_parent_even_a_sigkilled_one():
    """start_replica's children get SIGTERM from the kernel when the process that started them dies."""
    code = ("import sys, time\nfrom tokenmill.server.data_parallel import start_replica\n"
            "p = start_replica([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(p.pid, flush=True)\ntime.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    assert child.is_running()
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    child.wait(10)  # psutil.TimeoutExpired if it outlived its parent


# ---- the real model: tokenmill serve --data-parallel-size 2 ----------------------------------------

SYSTEM = ("You are the harbour master's assistant in a small fishing town. You answer questions about tides, "
          "berths, fuel, weather warnings and fees in one short sentence, politely, without guessing. ") * 3


@pytest.fixture(scope="module")
def fleet():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--data-parallel-size", "2",
                             "--port", str(port), "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                             "--itl-target-ms", "0", "--no-dashboard", "--request-timelines", "0",
                             "--uvicorn-log-level", "warning", "--disable-log-requests", "--disable-log-stats"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=300)
        everyone = psutil.Process(proc.pid).children(recursive=True)
        yield proc, url, everyone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _replicas(url: str) -> list[str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return sorted(s.labels["instance"] for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "tokenmill:router_instance_up")


def _chat(url: str, system: str, question: str, **extra) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0, **extra,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_shared_prefixes_stick_to_a_replica_and_a_replica_killed_mid_stream_is_routed_around(fleet):
    proc, url, everyone = fleet
    replicas = _replicas(url)
    assert len(replicas) == 2
    first = _chat(url, SYSTEM, "When is high tide?")
    second = _chat(url, SYSTEM, "How much is a berth for a night?")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    text = httpx.get(url + "/metrics").text
    ok = {r: metric(text, "tokenmill:router_requests_total", instance=r, outcome="ok") for r in replicas}
    holder, other = sorted(replicas, key=ok.get, reverse=True)
    assert ok[holder] == 2 and ok[other] == 0
    assert metric(text, "tokenmill:router_routing_decisions_total", reason="prefix_match") == 1
    assert metric(text, "tokenmill:router_prefix_match_chars_total", instance=holder) > len(SYSTEM)
    # negative control: the other replica never saw the prefix, so it has nothing cached for it
    direct = _chat(other, SYSTEM, "How much is a berth for a night?")
    assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # another prompt goes to the replica with room (nothing routed to it yet)
    _chat(url, "You translate English into French, word for word.", "Good morning")
    assert metric(httpx.get(url + "/metrics").text, "tokenmill:router_requests_total", instance=other,
                  outcome="ok") == 1

    # kill the replica serving a stream, mid-stream
    body = {"model": "smollm2-135m-instruct", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell a long story."}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert got and all(json.loads(line[6:])["choices"] for line in got)
        assert metric(httpx.get(holder + "/metrics").text, "vllm:num_requests_running") == 1  # the prefix's holder
        port = int(holder.rsplit(":", 1)[1])
        victim = [p for p in psutil.Process(proc.pid).children() if str(port) in p.cmdline()]
        assert len(victim) == 1
        victim[0].kill()
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert json.loads(rest[-2])["error"]["code"] == "upstream_failed" and rest[-1] == "[DONE]"
    assert len(got) + len(rest) < 400  # it was cut short
    for q in ("Is there fuel at the pier?", "Any weather warnings?", "Where do I pay?"):
        _chat(url, SYSTEM, q)  # the next ones succeed, on the survivor
    text = httpx.get(url + "/metrics").text
    assert metric(text, "tokenmill:router_instance_up", instance=holder) == 0
    assert metric(text, "tokenmill:router_requests_total", instance=other, outcome="ok") == 4
    assert metric(text, "tokenmill:router_stream_failures_total", instance=holder) == 1
    assert proc.poll() is None  # one replica left: still serving


@pytest.mark.slow
def test_stopping_the_data_parallel_server_stops_every_replica(fleet):
    proc, url, everyone = fleet
    assert len(everyone) >= 4  # two replica servers, each with its engine core
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.stdout.read()
    gone, alive = psutil.wait_procs(everyone, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
