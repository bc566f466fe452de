"""The OpenAI-compatible server on the real default model, driven by the official openai client and httpx.

One server for the module (the model loads once, shared with the other modules through the
session's llm_fp32). Greedy references come from LLM.generate / LLM.chat before the server
takes the engine. Completions stay short: the CPU is slow.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.app import ServerConfig, build_app
from tokenmill.server.run import BackgroundServer

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hello in French."}]
CONCURRENT_PROMPTS = ["Once upon a time", "The best way to learn is", "1, 2, 3, 4,", "Dear diary, today"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def refs(llm_fp32):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm_fp32.generate([PROMPT, *CONCURRENT_PROMPTS], greedy, use_tqdm=False)
    chat = llm_fp32.chat(CHAT, greedy, use_tqdm=False)[0]
    return {"prompt": outs[0], "concurrent": {p: o.outputs[0].text for p, o in zip(CONCURRENT_PROMPTS, outs[1:])},
            "chat": chat}


@pytest.fixture(scope="module")
def server(llm_fp32, refs):
    engine = llm_fp32.engine
    ae = AsyncEngine(engine, max_waiting_requests=256, log_interval=None)
    app = build_app(ae, ServerConfig(api_key=API_KEY, max_n=4))
    srv = BackgroundServer(app).start()
    srv.async_engine = ae
    yield srv
    srv.stop(60)
    # Nothing leaked: every block back in the pool, the engine idle and consistent.
    assert not ae.is_running
    assert not engine.has_unfinished_requests()
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c
    assert_idle(server)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def assert_idle(server, timeout: float = 30.0) -> None:
    """Every request finished or aborted and every KV block free (checked on the engine thread)."""
    ae = server.async_engine
    engine = ae.engine

    def idle():
        engine.kv_cache.check_invariants()
        return (not engine.has_unfinished_requests() and
                engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks)

    deadline = time.monotonic() + timeout
    while not ae.call_soon(idle).result(timeout):
        assert time.monotonic() < deadline, "requests or KV blocks left behind"
        time.sleep(0.05)


def metrics(http) -> dict[str, float]:
    """Every sample of /metrics as {'name{label=value,...}': value}."""
    text = http.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def sse(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


# ---- basic endpoints ------------------------------------------------------------------------------


def test_models_health_version(http, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json()["version"]
    assert http.get("/nope").status_code == 404 and "error" in http.get("/nope").json()
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_auth_required_on_every_route_but_health(server):
    """Route by route from the app's own table, so a route added later is covered too."""
    url = server.url
    routes = [(m, r.path) for r in server.app.routes for m in sorted(getattr(r, "methods", None) or ())
              if m != "HEAD"]
    assert ("POST", "/v1/completions") in routes and ("GET", "/metrics") in routes
    for method, path in routes + [("GET", "/no-such-route")]:
        path = path.replace("{", "").replace("}", "")  # any value for a path parameter
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"}]:
            r = httpx.request(method, url + path, headers=headers, json={"prompt": "x", "max_tokens": 1})
            if path == "/health":
                assert r.status_code == 200
                continue
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "authentication_error",
                                         "param": None, "code": "invalid_api_key"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    key = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/metrics", "/version", "/v1/models"):
        assert httpx.get(url + path, headers=key).status_code == 200


# ---- completions -----------------------------------------------------------------------------------


def test_completion_greedy_equals_llm_generate(http, refs):
    ref = refs["prompt"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == ref.outputs[0].text
    assert choice["finish_reason"] == ref.outputs[0].finish_reason
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_token_ids),
                             "completion_tokens": len(ref.outputs[0].token_ids),
                             "total_tokens": len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # (a prompt under one KV block)


def test_completion_stream_with_openai_client(client, refs):
    ref = refs["prompt"]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_non_stream_with_openai_client(client, refs):
    ref = refs["prompt"]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == ref.outputs[0].text
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_token_prompt_echo_batch_and_stop(http, refs):
    ref = refs["prompt"]
    ids = ref.prompt_token_ids
    text = ref.outputs[0].text
    r = http.post("/v1/completions", json={"prompt": [ids, ids], "max_tokens": MAX_TOKENS, "temperature": 0,
                                           "echo": True})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == PROMPT + text for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == 2 * len(ids)
    assert body["usage"]["completion_tokens"] == 2 * len(ref.outputs[0].token_ids)
    # a stop string cut from the greedy text ends the completion right before it
    stop = text.strip().split()[1]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                           "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == text[: text.index(stop)]


def test_n_seed_and_logprobs(http):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 1234, "n": 2, "logprobs": 2}
    a, b = (http.post("/v1/completions", json=body).json() for _ in range(2))
    assert len(a["choices"]) == 2 and a["choices"] == b["choices"]  # seeded: reproducible
    assert a["usage"]["completion_tokens"] == 8
    for c in a["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
        assert all(math.isfinite(x) and x <= 0 for x in lp["token_logprobs"])
        assert all(len(t) >= 2 for t in lp["top_logprobs"])
        if not any("\ufffd" in t for t in lp["tokens"]):  # pieces of one character do not join back
            assert "".join(lp["tokens"]) == c["text"]


def test_stream_logprobs_raw_sse(http):
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                      "logprobs": 1, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 4
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- chat ------------------------------------------------------------------------------------------


def test_chat_greedy_equals_llm_chat(client, refs):
    ref = refs["chat"]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_stream_with_usage_and_logprobs(client, refs):
    ref = refs["chat"]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=3))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    lps = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(lps) == len(ref.outputs[0].token_ids)
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in lps)
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


# ---- many clients ----------------------------------------------------------------------------------


def test_32_concurrent_streams_all_correct(server, refs):
    expected = refs["concurrent"]

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def one(i: int):
            prompt = CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)]
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    usage = chunk.usage
            return prompt, text, usage

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32
    for prompt, text, usage in results:
        assert text == expected[prompt]
        assert usage.completion_tokens == MAX_TOKENS
    assert_idle(server)


def test_disconnects_under_load_free_all_blocks(server, http):
    before = metrics(http)
    n_streams, n_posts = 12, 4

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120) as c:
            async def stream_and_leave(i: int):
                body = {"prompt": f"Story number {i}:", "max_tokens": 200, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():
                        break  # leave after the first event

            async def post_and_leave(i: int):
                body = {"prompt": f"Essay {i}:", "max_tokens": 200, "ignore_eos": True}
                with pytest.raises(httpx.ReadTimeout):
                    await c.post("/v1/completions", json=body, timeout=1.5)

            await asyncio.gather(*(stream_and_leave(i) for i in range(n_streams)),
                                 *(post_and_leave(i) for i in range(n_posts)))

    asyncio.run(main())
    assert_idle(server)
    after = metrics(http)
    key = f"vllm:request_success_total{{finished_reason=abort,model_name={MODEL}}}"
    assert after[key] - before[key] == n_streams + n_posts
    assert after[f"vllm:kv_cache_usage_perc{{model_name={MODEL}}}"] == 0


# ---- metrics -----------------------------------------------------------------------------------------


def test_metrics_match_what_was_sent(http):
    before = metrics(http)
    usages = []
    t = time.perf_counter()
    for max_tokens in (3, 5):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
        usages.append(r.json()["usage"])
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": 0})
    usages.append(r.json()["usage"])
    client_s = time.perf_counter() - t  # the three requests one after another, as the client saw them
    after = metrics(http)
    lab = f"model_name={MODEL}"

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta(f"vllm:prompt_tokens_total{{{lab}}}") == sum(u["prompt_tokens"] for u in usages)
    assert delta(f"vllm:generation_tokens_total{{{lab}}}") == sum(u["completion_tokens"] for u in usages)
    assert delta(f"vllm:request_success_total{{finished_reason=length,{lab}}}") == 3
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_time_per_output_token_seconds",
              "request_inference_time_seconds"):
        assert delta(f"vllm:{h}_count{{{lab}}}") == 3, h
    s = {h: delta(f"vllm:{h}_seconds_sum{{{lab}}}") for h in (
        "time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
        "request_decode_time", "request_inference_time", "inter_token_latency")}
    # each phase took time, the server saw no more than the client did, and the phases add up: e2e is queue
    # then inference, TTFT is queue then prefill, inference is prefill then decode, decode is about the tokens' gaps
    assert all(v > 0 for k, v in s.items() if k != "request_queue_time"), s
    assert s["e2e_request_latency"] < client_s
    close = functools.partial(pytest.approx, rel=1e-6, abs=1e-6)
    assert s["e2e_request_latency"] == close(s["request_queue_time"] + s["request_inference_time"])
    assert s["time_to_first_token"] == close(s["request_queue_time"] + s["request_prefill_time"])
    assert s["request_inference_time"] == close(s["request_prefill_time"] + s["request_decode_time"])
    # (a request finishes just after its last token's time is taken)
    assert s["inter_token_latency"] <= s["request_decode_time"] == pytest.approx(s["inter_token_latency"], rel=0.05)
    # one inter-token latency per token after the first
    assert delta(f"vllm:inter_token_latency_seconds_count{{{lab}}}") == sum(u["completion_tokens"] - 1 for u in usages)
    assert delta(f"vllm:request_generation_tokens_sum{{{lab}}}") == sum(u["completion_tokens"] for u in usages)
    # e2e >= ttft: the sums over the same requests must agree
    assert delta(f"vllm:e2e_request_latency_seconds_sum{{{lab}}}") >= delta(f"vllm:time_to_first_token_seconds_sum{{{lab}}}")
    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"vllm:{g}{{{lab}}}"] == 0
    for c in ("num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f"vllm:{c}{{{lab}}}" in after


def test_stop_string_request_latencies_are_consistent(http):
    """A stop-string finish still records a decode time >= 0 and an e2e >= TTFT (engine gives no finish time)."""
    before = metrics(http)
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0,
                                           "stop": [","]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    after = metrics(http)
    lab = f"model_name={MODEL}"
    assert after[f"vllm:request_success_total{{finished_reason=stop,{lab}}}"] - \
        before[f"vllm:request_success_total{{finished_reason=stop,{lab}}}"] == 1
    assert after[f"vllm:request_decode_time_seconds_count{{{lab}}}"] - \
        before[f"vllm:request_decode_time_seconds_count{{{lab}}}"] == 1


# ---- bad requests ---------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
LONG = "hello " * 2100  # more tokens than the 2048-token context

BAD = [
    # (endpoint, raw body or json, status, param)
    ("c", b"{not json", 400, None),
    ("c", b"[1, 2]", 400, None),
    ("c", b"", 400, None),
    ("c", b'"just a string"', 400, None),
    ("c", {"max_tokens": 2}, 400, "prompt"),
    ("c", {"prompt": ""}, 400, "prompt"),
    ("c", {"prompt": []}, 400, "prompt"),
    ("c", {"prompt": [[]]}, 400, "prompt"),
    ("c", {"prompt": [""]}, 400, "prompt"),
    ("c", {"prompt": 42}, 400, "prompt"),
    ("c", {"prompt": [1, "a"]}, 400, "prompt"),
    ("c", {"prompt": [10**9]}, 400, "prompt"),
    ("c", {"prompt": [-1]}, 400, "prompt"),
    ("c", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("c", {"prompt": "hi", "model": 7}, 400, "model"),
    ("c", {"prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    ("c", {"prompt": "hi", "max_tokens": 2048}, 400, "max_tokens"),
    ("c", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("c", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("c", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("c", {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    ("c", {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("c", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("c", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    ("c", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("c", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("c", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("c", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("c", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("c", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("c", {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("c", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("c", {"prompt": "hi", "n": 5}, 400, "n"),
    ("c", {"prompt": "hi", "n": 0}, 400, "n"),
    ("c", {"prompt": "hi", "stop": ["s"] * 17}, 400, "stop"),
    ("c", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("c", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("c", {"prompt": "hi", "stop_token_ids": [10**12]}, 400, "stop_token_ids"),
    ("c", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("c", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("c", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("c", {"prompt": "hi", "seed": "abc"}, 400, "seed"),
    ("c", {"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    ("c", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("c", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("c", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("c", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("c", {"prompt": "hi", "priority": 2**40}, 400, "priority"),
    ("c", {"prompt": ["a"] * 33}, 400, "prompt"),
    ("ch", {"max_tokens": 2}, 400, "messages"),
    ("ch", {"messages": []}, 400, "messages"),
    ("ch", {"messages": "hi"}, 400, "messages"),
    ("ch", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("ch", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("ch", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content"),
    ("ch", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("ch", {"messages": MSG, "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("ch", {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    ("ch", {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    ("ch", {"messages": MSG, "logprobs": True, "top_logprobs": 25}, 400, "top_logprobs"),
    ("ch", {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    # constraints, structured outputs and tools (issue 28): each names its field
    ("c", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("c", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("c", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("c", {"prompt": "hi", "allowed_token_ids": [10**9]}, 400, "allowed_token_ids"),
    ("c", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("c", {"prompt": "hi", "bad_words": [""]}, 400, "bad_words"),
    ("c", {"prompt": "hi", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("c", {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("c", {"prompt": "hi", "guided_regex": "[^\\s\\S]"}, 400, "guided_regex"),  # a regex nothing matches
    ("ch", {"messages": MSG, "guided_grammar": "start: undefined_rule"}, 400, "guided_grammar"),
    ("ch", {"messages": MSG, "structured_outputs": {"json": '{"type": '}}, 400, "structured_outputs"),
    ("ch", {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}},
     400, "response_format"),
    ("ch", {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("ch", {"messages": MSG, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400, "guided_regex"),
    ("ch", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     400, "tools"),
    ("ch", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools"),
    ("ch", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "tool_choice": "required"}, 400, "tools"),
    ("ch", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("ch", {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("ch", {"messages": MSG, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("ch", {"messages": MSG, "model": "other"}, 404, "model"),
    ("ch", {"messages": MSG, "temperature": -1}, 400, "temperature"),
    ("big", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 413, None),
    # the Responses API (tests/test_responses_api.py has its own)
    ("r", b"{not json", 400, None),
    ("r", {}, 400, "input"),
    ("r", {"input": [{"role": "user", "content": 5}]}, 400, "input[0].content"),
    ("r", {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ("r", {"input": "hi", "temperature": -1}, 400, "temperature"),
    ("r", {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("r", {"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    # pooling endpoints on a generative model (tests/test_pooling.py has their own, on pooling models)
    ("e", {"input": "hi"}, 400, "model"),
    ("e", {}, 400, "input"),
    ("e", {"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ("s", {"text_1": "a", "text_2": "b"}, 400, "model"),
    ("s", {"text_1": "a"}, 400, "text_2"),
    ("rr", {"query": "q", "documents": ["d"]}, 400, "model"),
    ("rr", {"query": "q", "documents": "d"}, 400, "documents"),
]
PATHS = {"ch": "/v1/chat/completions", "r": "/v1/responses", "e": "/v1/embeddings", "s": "/v1/score",
         "rr": "/v1/rerank"}


@pytest.mark.parametrize("endpoint,body,status,param", BAD,
                         ids=[f"{i}-{b[0]}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_table(http, endpoint, body, status, param):
    path = PATHS.get(endpoint, "/v1/completions")
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err


def test_bad_requests_with_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=100_000)
    assert e.value.body["code"] == "context_length_exceeded"


def test_chunked_body_over_limit_gets_413(http):
    def chunks():
        for _ in range(40):
            yield b" " * 32768

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# ---- fuzz ------------------------------------------------------------------------------------------

FIELDS_C = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "seed", "n", "logprobs", "echo",
            "ignore_eos", "min_tokens", "stream", "stream_options", "priority", "best_of", "logit_bias", "suffix",
            "include_stop_str_in_output", "skip_special_tokens", "user"]
FIELDS_CH = [f for f in FIELDS_C if f not in ("prompt", "logprobs", "echo", "suffix")] + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "response_format",
    "add_generation_prompt"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, -1, 20, 21, 2048, 2**31, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-300, 1e300, -0.0, 0.5, 1.0]),
    st.text(max_size=20), st.sampled_from(["", "hi", MODEL, "\x00", "\ud7ff" * 3]),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "", "x"]),
                                           "content": st.one_of(st.text(max_size=30), json_values)}),
                    max_size=3)
FIELDS_R = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
            "previous_response_id", "tools", "tool_choice", "text", "metadata", "user", "parallel_tool_calls",
            "reasoning", "include", "truncation", "top_logprobs", "background", "top_k", "logit_bias"]


def _body(fields: list[str], base: dict):
    return st.dictionaries(st.sampled_from(fields), json_values, max_size=6).map(lambda d: {**base, **d})


completion_bodies = st.one_of(
    _body(FIELDS_C, {"prompt": "Hi", "max_tokens": 1}),
    _body(FIELDS_C, {}),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=5)),
                           "max_tokens": st.integers(-2, 2), "n": st.integers(0, 3),
                           "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
                           "stream": st.booleans(), "logprobs": st.one_of(st.none(), st.integers(-1, 22))}),
)
chat_bodies = st.one_of(
    _body(FIELDS_CH, {"messages": MSG, "max_tokens": 1}),
    st.fixed_dictionaries({"messages": messages, "max_tokens": st.integers(-1, 2), "stream": st.booleans()}),
    _body(FIELDS_CH, {}),
)
response_bodies = st.one_of(
    _body(FIELDS_R, {"input": "Hi", "max_output_tokens": 1}),
    st.fixed_dictionaries({"input": st.one_of(st.text(max_size=20), messages), "max_output_tokens": st.integers(-1, 2),
                           "stream": st.booleans()}),
    _body(FIELDS_R, {}),
)


def _clip(body) -> object:
    """Keep generation tiny where a fuzzed body happens to be valid: one prompt, one token."""
    if isinstance(body, dict):
        body = dict(body)
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(k), int) and not isinstance(body[k], bool) and 1 < body[k] < 2048:
                body[k] = 1
        if body.get("ignore_eos") and not isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = 1
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 1  # absent or null means 16 (completions) or the whole context (chat)
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 2 and isinstance(body["prompt"][0], str):
            body["prompt"] = body["prompt"][:2]
        if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
            body["min_tokens"] = 1
    return body


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]), data=st.data())
def test_fuzz_request_schema_never_5xx(server, endpoint, data):
    strategy = {"/v1/completions": completion_bodies, "/v1/responses": response_bodies}.get(endpoint, chat_bodies)
    body = data.draw(st.one_of(strategy, json_values))
    if endpoint == "/v1/responses":
        if isinstance(body, dict) and not (isinstance(body.get("max_output_tokens"), int) and
                                           body["max_output_tokens"] <= 1):
            body = {**body, "max_output_tokens": 1}  # absent means the whole context
    else:
        body = _clip(body)
    raw = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals are part of the fuzz
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}",
                                                    "Content-Type": "application/json"}, timeout=120) as c:
        r = c.post(endpoint, content=raw)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
    assert server.async_engine.healthy
