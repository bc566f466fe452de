"""`tokenmill bench`: metrics on scripted timings, arrivals, and the CLI against fake OpenAI servers.

The fake server streams like a real one (a role/empty first chunk, text chunks, an empty finish
chunk, a usage chunk, [DONE]) with token timings the test scripts, so the measured TTFT/TPOT/ITL/
goodput can be checked against the script. Loopback timings on a busy 2-core machine jitter by a
few milliseconds; the tolerances allow for that and no more.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tiny_models import write_tokenizer_files
from tokenmill.bench.arrivals import gamma_arrivals, schedule
from tokenmill.bench.client import ApiConfig, RequestResult
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import calculate_metrics, parse_goodput, parse_percentiles, tpot_s
from tokenmill.bench.runner import LoadSpec, run
from tokenmill.bench.timeline import queued_in_client, requests_in_flight, tokens_in_flight
from tokenmill.cli import main
from tokenmill.server.run import BackgroundServer

FAST_TTFT, SLOW_TTFT, GAP = 0.15, 0.6, 0.05
TOL = 0.03  # seconds of loopback jitter allowed around a typical measured time
# A stalled event loop on a loaded CI machine can only make a time late, never early: one time in a run may be this
# much late, the medians must still be within TOL.
LATE = 0.25


def as_scripted(measured: float, scripted: float) -> bool:
    return scripted - TOL <= measured <= scripted + LATE


# ---------------------------------------------------------------- metrics on exact, synthetic results

def result(i, ttft, gaps, tokens=None, prompt=10, start=0.0, ok=True, error=None) -> RequestResult:
    e2el = ttft + sum(gaps) + 0.001
    return RequestResult(i, prompt, len(gaps) + 1, scheduled_s=start, start_s=start, end_s=start + e2el, success=ok,
                         error=error, ttft_s=ttft if ok else 0.0, itl_s=list(gaps) if ok else [],
                         e2el_s=e2el if ok else 0.0, prompt_tokens=prompt if ok else None,
                         completion_tokens=(tokens if tokens is not None else len(gaps) + 1) if ok else None)


def test_metrics_follow_vllm_definitions_exactly():
    rs = [result(0, 0.1, [0.02, 0.04, 0.06]), result(1, 0.3, [0.01]), result(2, 0.2, []),
          result(3, 0, [], ok=False, error="HTTP 500: boom"), result(4, 0, [], ok=False, error="HTTP 500: boom")]
    m = calculate_metrics(rs, duration_s=2.0, slos={"ttft": 150.0}, percentiles=[50, 99.9])
    assert (m["completed"], m["failed"], m["errors"]) == (3, 2, {"HTTP 500: boom": 2})
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 4 + 2 + 1
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(18.5)
    assert m["request_goodput"] == pytest.approx(0.5)  # only request 0 has TTFT <= 150 ms
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 300, 200]))
    # TPOT only for requests with 2+ tokens: (e2el - ttft) / (n - 1)
    assert m["mean_tpot_ms"] == pytest.approx(np.mean([(0.121 / 3) * 1000, 11.0]))
    # ITL pools every gap of every request
    assert m["mean_itl_ms"] == pytest.approx(np.mean([20, 40, 60, 10]))
    assert m["p99.9_itl_ms"] == pytest.approx(np.percentile([20, 40, 60, 10], 99.9))
    assert "p50_e2el_ms" in m and m["output_tokens_source"] == "usage"


def test_tokens_come_from_usage_not_chunks():
    r = result(0, 0.1, [0.1, 0.1], tokens=7)  # 3 chunks carrying 7 tokens
    m = calculate_metrics([r], 1.0)
    assert m["total_output_tokens"] == 7
    assert tpot_s(r) == pytest.approx((r.e2el_s - r.ttft_s) / 6)
    r.completion_tokens = None  # a server without usage: counted by chunks, and labelled so
    m = calculate_metrics([r], 1.0)
    assert (m["total_output_tokens"], m["output_tokens_source"]) == (3, "chunks")


def test_goodput_needs_every_slo():
    rs = [result(0, 0.1, [0.2]), result(1, 0.1, [0.05]), result(2, 0.5, [0.05])]
    m = calculate_metrics(rs, 1.0, slos={"ttft": 200, "tpot": 100})
    assert m["request_goodput"] == pytest.approx(1.0)  # request 1 only
    assert calculate_metrics(rs, 1.0)["request_goodput"] is None


def test_tokens_in_flight_counts_prompt_and_received_output():
    r = result(0, 1.0, [1.0, 1.0], tokens=3, prompt=100)  # chunks at 1, 2, 3 s; ends at 3.001
    got = tokens_in_flight([r], np.array([0.5, 1.5, 2.5, 3.5]))
    assert got.tolist() == [100, 101, 102, 0]


@pytest.mark.parametrize("text,err", [("ttft", "NAME:MILLISECONDS"), ("latency:5", "NAME:MILLISECONDS"),
                                      ("tpot:x", "not a number"), ("e2el:-1", "positive")])
def test_bad_goodput_is_a_clear_error(text, err):
    with pytest.raises(ValueError, match=err):
        parse_goodput([text])


def test_percentiles_parse():
    assert parse_percentiles("50, 90,99.9") == [50, 90, 99.9]
    with pytest.raises(ValueError, match="0, 100"):
        parse_percentiles("50,101")


# ---------------------------------------------------------------- arrivals

@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_have_the_asked_rate_and_burstiness(burstiness):
    n, rate = 20000, 8.0
    t = gamma_arrivals(n, rate, burstiness, seed=3)
    assert t[-1] == pytest.approx(n / rate) and np.all(np.diff(t) >= 0)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_all_at_once_deterministic_and_traces_rescaled():
    assert gamma_arrivals(5, math.inf).tolist() == [0.0] * 5
    assert np.array_equal(gamma_arrivals(50, 2.0, seed=1), gamma_arrivals(50, 2.0, seed=1))
    reqs = [SampleRequest("x", 1, 1, arrival_s=a) for a in (10.0, 11.0, 14.0)]
    assert schedule(reqs, None, time_scale=2.0).tolist() == [0.0, 2.0, 8.0]
    assert schedule(reqs, 1.0).tolist() == pytest.approx([0.0, 0.5, 2.0])  # 2 gaps in 4 s: 0.5/s -> 1/s
    with pytest.raises(ValueError, match="--burstiness"):
        gamma_arrivals(3, 1.0, 0)


# ---------------------------------------------------------------- a scripted fake OpenAI server

def fake_openai_app(fail_every: int = 0, slow_every: int = 2) -> FastAPI:
    """Request k (in arrival order) waits FAST_TTFT, or SLOW_TTFT every ``slow_every``-th request, for its first
    token, then GAP per token; every ``fail_every``-th request gets HTTP 500."""
    app = FastAPI()
    app.state.count = 0
    app.state.prompts = []

    async def stream(body: dict, chat: bool, ttft: float):
        n = body.get("max_tokens") or body.get("max_completion_tokens")

        def chunk(text, finish=None):
            if chat:
                return {"choices": [{"index": 0, "delta": {"content": text} if text is not None else {"role": "assistant"},
                                     "finish_reason": finish}]}
            return {"choices": [{"index": 0, "text": text or "", "finish_reason": finish}]}

        yield f"data: {json.dumps(chunk(None))}\n\n"  # role-only / empty first chunk: no output yet
        await asyncio.sleep(ttft)
        for i in range(n):
            if i:
                await asyncio.sleep(GAP)
            yield f"data: {json.dumps(chunk(f' t{i}'))}\n\n"
        yield f"data: {json.dumps(chunk('', 'length'))}\n\n"
        # Usage says twice as many tokens as chunks: a server may pack tokens into one chunk.
        usage = {"prompt_tokens": 11, "completion_tokens": 2 * n, "total_tokens": 11 + 2 * n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        k = app.state.count
        app.state.count += 1
        if fail_every and k % fail_every == fail_every - 1:
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error"}}, status_code=500)
        body = await request.json()
        app.state.prompts.append(body.get("prompt") or json.dumps(body.get("messages")))
        ttft = SLOW_TTFT if k % slow_every == slow_every - 1 else FAST_TTFT
        return StreamingResponse(stream(body, chat, ttft), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    return app


@pytest.fixture()
def fake_server():
    servers = []

    def start(**kw) -> BackgroundServer:
        srv = BackgroundServer(fake_openai_app(**kw)).start()
        servers.append(srv)
        return srv

    yield start
    for s in servers:
        s.stop(10)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    (d / "config.json").write_text("{}")  # a model folder; only the tokenizer is read
    return str(d)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_measured_timings_equal_the_script(fake_server, endpoint):
    srv = fake_server()
    n_tokens = 5
    reqs = [SampleRequest(f"prompt {i}", 3, n_tokens) for i in range(6)]
    api = ApiConfig(srv.url, "fake", endpoint=endpoint)
    got = run(api, reqs, LoadSpec(max_concurrency=1), progress=False, slos={"ttft": 450.0})
    m = got.metrics
    assert (m["completed"], m["failed"]) == (6, 0)
    ttfts = [r.ttft_s for r in got.results]
    # With one request at a time, arrival order is index order: odd requests are the slow ones.
    for r in got.results:
        assert as_scripted(r.ttft_s, SLOW_TTFT if r.index % 2 else FAST_TTFT), (r.index, r.ttft_s)
        assert len(r.itl_s) == n_tokens - 1  # the empty first and finish chunks are not tokens
        assert all(as_scripted(g, GAP) for g in r.itl_s), r.itl_s
        assert r.completion_tokens == 2 * n_tokens and r.prompt_tokens == 11
        assert r.generated_text == "".join(f" t{i}" for i in range(n_tokens))
    fast = [r.ttft_s for r in got.results if r.index % 2 == 0]
    slow = [r.ttft_s for r in got.results if r.index % 2]
    assert np.median(fast) == pytest.approx(FAST_TTFT, abs=TOL) and np.median(slow) == pytest.approx(SLOW_TTFT, abs=TOL)
    # TPOT from usage's token count: (e2el - ttft) spread over 2n - 1 tokens
    assert np.median([tpot_s(r) for r in got.results]) == pytest.approx(
        GAP * (n_tokens - 1) / (2 * n_tokens - 1), abs=TOL / 4)
    assert m["mean_ttft_ms"] == pytest.approx(1000 * np.mean(ttfts))
    assert m["median_itl_ms"] == pytest.approx(GAP * 1000, abs=TOL * 1000)
    assert m["total_output_tokens"] == 6 * 2 * n_tokens
    # goodput: the three fast requests meet ttft <= 450 ms, the slow ones (600 ms) do not
    assert m["request_goodput"] * m["duration"] == pytest.approx(3)
    # run time is about the sum of the requests' times (they ran one at a time)
    assert m["duration"] == pytest.approx(sum(r.e2el_s for r in got.results), abs=0.2)


def test_failures_are_counted_with_their_errors(fake_server):
    srv = fake_server(fail_every=3)
    reqs = [SampleRequest("p", 3, 2) for _ in range(6)]
    got = run(ApiConfig(srv.url, "fake"), reqs, LoadSpec(max_concurrency=2), progress=False)
    assert (got.metrics["completed"], got.metrics["failed"]) == (4, 2)
    assert got.metrics["errors"] == {"HTTP 500: scripted failure": 2}


def test_concurrency_cap_holds_requests_in_the_client(fake_server):
    srv = fake_server(slow_every=10**6)  # all fast
    reqs = [SampleRequest("p", 3, 3) for _ in range(8)]
    got = run(ApiConfig(srv.url, "fake"), reqs, LoadSpec(request_rate=math.inf, max_concurrency=2), progress=False)
    starts = sorted(r.start_s for r in got.results)
    one = FAST_TTFT + 2 * GAP
    # four waves of two: the k-th wave starts about k request-times after the first
    assert starts[-1] == pytest.approx(3 * one, abs=4 * TOL)
    _, in_flight = requests_in_flight(got.results)
    assert in_flight.max() == 2
    # all eight released at 0: six of them waited in the client for a free slot
    assert sum(r.start_s - r.scheduled_s > one / 2 for r in got.results) == 6
    _, held = queued_in_client(got.results)
    assert held.max() >= 6


def test_cli_compare_sweep_json_and_plots(fake_server, tiny_tokenizer, tmp_path, capsys):
    # B's scripted TTFT (a sleep) is a floor the SLO sits below; A has 400 ms of room for a loaded machine
    slo_ms = round(1000 * SLOW_TTFT) - 50
    a, b = fake_server(slow_every=10**6), fake_server(slow_every=1)  # b: every request slow
    out = tmp_path / "r.json"
    plots = tmp_path / "plots"
    rc = main(["bench", "serve", "--base-url", a.url, "--model", "fake", "--tokenizer", tiny_tokenizer,
               "--compare", b.url, "--label", "A", "--compare-label", "B", "--num-prompts", "4", "--input-len", "8",
               "--output-len", "3", "--sweep", "20,10", "--goodput", f"ttft:{slo_ms}", "--slo-percentile", "90",
               "--save-result", str(out), "--plot", str(plots), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "A / B" in text and "p90 TTFT" in text
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    # sweep points in ascending order, A and B at each, alternating who goes first
    assert [(r["label"], r["request_rate"]) for r in runs] == [("A", 10.0), ("B", 10.0), ("A", 20.0), ("B", 20.0)]
    for r in runs:
        assert r["completed"] == 4 and len(r["requests"]) == 4
        assert all(len(q["chunk_times_s"]) == 3 for q in r["requests"])
    assert runs[0]["p90_ttft_ms"] < slo_ms < runs[1]["p90_ttft_ms"]
    assert "A: highest request rate meeting the SLOs: 20" in text
    assert "B: highest request rate meeting the SLOs: none" in text
    assert {p.name for p in plots.iterdir()} == {"latency_cdf.png", "tokens_in_flight.png", "sweep.png"}
    # both servers got the same prompts; each sweep point and the readiness probe had prompts of their own
    pa, pb = a.app.state.prompts, b.app.state.prompts
    assert len(pa) == 9 and sorted(pa) == sorted(pb)
    probe, first, second = {pa[0]}, set(pa[1:5]), set(pa[5:])
    assert len(first) == len(second) == 4 and not (first & second) and not (probe & (first | second))


def test_cli_bad_input_says_what_to_do(fake_server, tiny_tokenizer, capsys):
    srv = fake_server()
    base = ["bench", "serve", "--model", "fake", "--tokenizer", tiny_tokenizer, "--num-prompts", "2"]
    assert main(base + ["--base-url", "localhost:1"]) == 2
    assert "must start with http://" in capsys.readouterr().err
    assert main(base + ["--base-url", srv.url, "--goodput", "ttft"]) == 2
    assert "NAME:MILLISECONDS" in capsys.readouterr().err
    assert main(base + ["--base-url", srv.url, "--dataset", "text"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
    assert main(base + ["--base-url", "http://127.0.0.1:9", "--ready-timeout", "0"]) == 2
    assert "is the server running" in capsys.readouterr().err


# ---------------------------------------------------------------- datasets (the tiny tokenizer)

@pytest.fixture(scope="module")
def maker(tiny_tokenizer):
    from tokenmill.bench.datasets import PromptMaker
    from tokenmill.models.tokenizer_loader import load_tokenizer

    return PromptMaker(load_tokenizer(tiny_tokenizer))


def test_random_prompts_have_the_asked_token_lengths(maker):
    from tokenmill.bench.datasets import DatasetSpec, sample_requests

    reqs = sample_requests(DatasetSpec("random", num_prompts=12, input_len=40, output_len=10, range_ratio=0.5,
                                       long_input_len=90, long_input_every=4, seed=1), maker)
    for i, r in enumerate(reqs):
        assert maker.encode(r.prompt) == r.prompt_ids and len(r.prompt_ids) == r.prompt_len
        assert r.prompt_len == 90 if i % 4 == 3 else 20 <= r.prompt_len <= 60
        assert 5 <= r.output_len <= 15
    again = sample_requests(DatasetSpec("random", num_prompts=12, input_len=40, output_len=10, range_ratio=0.5,
                                        long_input_len=90, long_input_every=4, seed=1), maker)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_shared_prefix_prompts_share_their_leading_tokens(maker):
    from tokenmill.bench.datasets import DatasetSpec, sample_requests

    reqs = sample_requests(DatasetSpec("shared-prefix", num_prompts=6, prefix_len=50, question_len=8,
                                       output_len=4, num_prefixes=2), maker)
    heads = [maker.encode(r.system) for r in reqs]
    for r, head in zip(reqs, heads):
        assert r.prompt_ids[:len(head)] == head and len(r.prompt_ids) > len(head)
        assert r.messages()[0] == {"role": "system", "content": r.system}
    assert heads[0] == heads[2] == heads[4] != heads[1]
    assert len({r.prompt for r in reqs}) == 6


def test_text_trace_and_sharegpt_datasets(maker, tmp_path):
    from tokenmill.bench.datasets import DatasetSpec, sample_requests

    corpus = tmp_path / "t.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200)))
    for r in sample_requests(DatasetSpec("text", str(corpus), num_prompts=3, input_len=30, output_len=5), maker):
        assert r.prompt_len == 30 and r.prompt.split()[0] in corpus.read_text()
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50.5,40,9\n"
                     "2023-11-16 18:15:46.0,20,5\n2023-11-16 18:15:47.25,1000,700\n")
    reqs = sample_requests(DatasetSpec("trace", str(trace), num_prompts=3, trace_max_input_len=64,
                                       trace_max_output_len=32), maker)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [(0.0, 20, 5), (1.25, 64, 32), (4.5, 40, 9)]
    convs = [{"conversations": [{"from": "human", "value": "tell me a story about a fox"},
                                {"from": "gpt", "value": "once upon a time a fox lived in the woods"}]},
             {"conversations": [{"from": "gpt", "value": "no user turn"}]}]
    share = tmp_path / "sg.json"
    share.write_text(json.dumps(convs))
    reqs = sample_requests(DatasetSpec("sharegpt", str(share), num_prompts=5), maker)
    assert len(reqs) == 1 and reqs[0].prompt == "tell me a story about a fox"
    assert reqs[0].output_len == len(maker.encode("once upon a time a fox lived in the woods"))
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="lacks the column"):
        sample_requests(DatasetSpec("trace", str(bad), num_prompts=1), maker)
    with pytest.raises(ValueError, match="--dataset random only"):
        sample_requests(DatasetSpec("text", str(corpus), long_input_every=2), maker)
