"""SLO-aware scheduling (core/step_planner.py): step budgets and batch sizes planned on a step-cost model,
TTFT predicted at admission, requests shed (or queued) when it cannot be met.

The cost models here are scripted linear functions, so every expected budget and batch size follows by
hand; the simulator runs the real Scheduler on a fake clock with the scripted model as its truth. The
server test runs the real HTTP server and AsyncEngine on a fake runner whose steps take a set time.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest

from tokenmill.bench.datasets import SampleRequest
from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.perf.step_cost import StepShape
from tokenmill.core.step_planner import (MIN_CHUNK, Forecast, SLOAdmission, SLOPlanner, predict_ttft,
                                         prefill_equivalent)
from tokenmill.sim.simulator import Simulator
from test_scheduler import FakeRunner, check_state, make_request


def linear_cost(base: float = 0.010, per_prefill: float = 0.001, per_decode: float = 0.002):
    """Seconds of a step: a fixed part plus a cost per prefill token and per decode token."""
    return lambda s: base + per_prefill * s.prefill_tokens + per_decode * s.decode_tokens


def planned_scheduler(cost, num_blocks: int = 512, block_size: int = 16, max_model_len: int = 4096,
                      **config) -> Scheduler:
    cfg = SchedulerConfig(**{"max_num_seqs": 64, **config})
    sched = Scheduler(cfg, KVCacheManager(num_blocks, block_size), max_model_len)
    sched.planner = SLOPlanner(cfg, cost, headroom=1.0)  # exact targets: the expected numbers follow by hand
    return sched


def step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    check_state(sched)
    return out


# ---------------------------------------------------------------- the planner follows the cost model


@pytest.mark.parametrize("num_decodes", [0, 1, 5, 12])
def test_chunk_budget_is_what_the_target_leaves_after_the_decodes(num_decodes):
    # 10 ms + 1 ms per prefill token + 2 ms per decode <= 50 ms: a chunk of 40 - 2 D tokens (at least MIN_CHUNK)
    sched = planned_scheduler(linear_cost(), itl_target_ms=50)
    runner = FakeRunner(sched)
    for i in range(num_decodes):
        sched.add_request(make_request(f"d{i}", 4, max_tokens=50))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        step(sched, runner)
    sched.add_request(make_request("long", 3000, max_tokens=4))
    out = step(sched, runner)
    want = max(40 - 2 * num_decodes, MIN_CHUNK)
    assert out.num_decode_tokens == num_decodes
    assert out.num_prefill_tokens == want
    assert sched.planner.last_budget == num_decodes + want
    # a step planned within the target is predicted within it (unless the decodes alone overflow it)
    if 40 - 2 * num_decodes >= MIN_CHUNK:
        assert sched.planner.predict(StepShape.of(out)) <= 0.050 + 1e-9


def test_chunks_shrink_as_they_reach_deeper_into_a_long_prompt():
    # attention grows with the chunk's position: 0.5 us per (token, context token) pair on top of 0.2 ms a token
    def cost(s):
        return 0.005 + 0.0002 * s.tokens + 0.5e-6 * s.attention_context

    sched = planned_scheduler(cost, itl_target_ms=100)
    runner = FakeRunner(sched)
    sched.add_request(make_request("short", 4, max_tokens=200))
    step(sched, runner)  # now decoding: its inter-token latency is what the chunks protect
    sched.add_request(make_request("long", 3000, max_tokens=2))
    chunks = []
    while sched.requests["long"].num_computed_tokens < 3000:
        out = step(sched, runner)
        chunks.append(out.num_prefill_tokens)
        assert cost(StepShape.of(out)) <= 0.100 + 1e-9
    assert chunks[0] > chunks[-1] + 50 and chunks == sorted(chunks, reverse=True)
    assert sum(chunks) == 3000


def test_batch_target_follows_the_model():
    # 10 ms + 16 prefill tokens (16 ms) + 2 ms per decode <= 50 ms: 12 requests; at 4 ms per decode: 6
    for per_decode, want in ((0.002, 12), (0.004, 6)):
        sched = planned_scheduler(linear_cost(per_decode=per_decode), slo_tpot_ms=50)
        runner = FakeRunner(sched)
        for i in range(30):
            sched.add_request(make_request(f"r{i}", 4, max_tokens=40))
        seen = 0
        for _ in range(20):
            step(sched, runner)
            seen = max(seen, len(sched.running))
        assert seen == want == sched.planner.last_batch_target
        # as requests finish the waiting ones take their slots: nobody waits forever
        while sched.has_unfinished():
            step(sched, runner)


def test_a_request_own_tpot_slo_tightens_the_plan_while_it_runs():
    sched = planned_scheduler(linear_cost(), itl_target_ms=50)
    runner = FakeRunner(sched)
    tight = make_request("tight", 4, max_tokens=3)
    tight.slo_tpot_ms = 34
    sched.add_request(tight)
    sched.add_request(make_request("other", 4, max_tokens=100))
    step(sched, runner)
    sched.add_request(make_request("long", 500, max_tokens=2))
    # 10 + 2 x 2 (two decodes) + 1 per token <= 34
    assert step(sched, runner).num_prefill_tokens == 20
    while "tight" in sched.requests:
        step(sched, runner)
    # back to the engine's 50 ms: 10 + 2 (other's decode) + 1 per token
    assert step(sched, runner).num_prefill_tokens == 38


# ---------------------------------------------------------------- TTFT prediction and admission


def test_predicted_ttft_by_hand():
    f = Forecast(step_s=0.1, prefill_per_step=100, running_prefill_tokens=150, waiting=[(0, 2, 200), (5, 1, 300)],
                 free_slots=2, slot_steps=[10, 40])
    # The step in flight (0.1 s), then: fcfs, 150 + 200 + 300 ahead plus its own 50: 7 steps; 4 ahead of it
    # need 2 slots to free, the 2nd after 40 steps, then its own chunk: 4.1 s
    assert predict_ttft(f, 50) == pytest.approx(0.1 + 4.1)
    # priority 0 does not wait for the priority-5 request: ceil(400 / 100) steps; 3 ahead -> 1st free slot
    assert predict_ttft(f, 50, priority=0, fcfs=False) == pytest.approx(0.1 + max(0.4, 1.0 + 0.1))
    # half a second later: 5 steps of prefill and of decodes are done
    assert predict_ttft(f, 50, priority=0, fcfs=False, elapsed_s=0.5) == pytest.approx(0.1 + max(0.1, 0.5 + 0.1))
    # more waiting than the running batch frees once: a request lifetime at least
    assert math.isinf(predict_ttft(f, 50, pending_seqs=10))


def test_deep_prompts_count_the_smaller_chunks_they_take():
    table = [(0, 100), (256, 50)]  # from position 256 on, a step takes half as many of the prompt's tokens
    assert prefill_equivalent(table, 0, 128) == pytest.approx(128)
    # chunk by chunk: 0-100-200-300 (a chunk starting before 256 is a shallow one), then 212 at 50 a step:
    # 3 + 4.24 steps, i.e. 724 first-chunk tokens
    assert prefill_equivalent(table, 0, 512) == pytest.approx(724)
    assert prefill_equivalent(table, 256, 512) == pytest.approx(512)  # a prompt part-computed already
    assert prefill_equivalent([], 0, 512) == 512
    f = Forecast(step_s=0.1, prefill_per_step=100, free_slots=5, chunk_at=table)
    # the step in flight, then ceil(724 / 100) steps: 0.9 s, not the 0.7 s its length alone would say
    v = SLOAdmission(ttft_ms=1000, headroom=1.0).check(f, 512)
    assert v.predicted_ttft_s == pytest.approx(0.9) and v.prefill_tokens == pytest.approx(724)


def test_admission_sheds_only_what_misses():
    f = Forecast(step_s=0.1, prefill_per_step=100, running_prefill_tokens=800, free_slots=5)
    adm = SLOAdmission(ttft_ms=1000, headroom=1.0)
    assert adm.check(f, 50).admit  # the step in flight + ceil(850 / 100) steps = 1.0 s
    v = adm.check(f, 200)
    assert not v.admit and v.predicted_ttft_s == pytest.approx(1.1) and v.retry_after_s == 1
    assert adm.check(f, 200, ttft_ms=2000).admit  # its own SLO
    queued = SLOAdmission(ttft_ms=1000, policy="queue", headroom=1.0).check(f, 200)
    assert queued.admit and not queued.meets
    assert SLOAdmission(ttft_ms=None).check(f, 10_000).admit  # no TTFT SLO: no shedding
    # the engine's default plans under the target: 1.0 s predicted misses 80% of 1 s
    assert not SLOAdmission(ttft_ms=1000).check(f, 50).admit


def burst(n: int, prompt_len: int, output_len: int):
    return [SampleRequest("", prompt_len, output_len) for _ in range(n)], [0.0] * n


def simulate(cost, requests, arrivals, **config):
    cfg = SchedulerConfig(**{"max_num_seqs": 64, **config})
    return Simulator(cost, cfg, num_blocks=4096, block_size=16, max_model_len=4096).run(requests, arrivals)


def test_shed_requests_leave_the_served_ones_on_time():
    cost = linear_cost(per_prefill=0.0002)
    reqs, arrivals = burst(60, 100, 20)
    out = simulate(cost, reqs, arrivals, slo_ttft_ms=500, slo_tpot_ms=50)
    served = [r for r in out.results if r.success]
    shed = [r for r in out.results if r.status == 503]
    assert len(served) + len(shed) == 60 and 0 < len(shed) < 60
    assert all(r.error.startswith("shed") for r in shed)
    assert max(r.ttft_s for r in served) <= 0.5
    assert max(max(r.itl_s) for r in served) <= 0.050 + 1e-9
    # the same burst without the SLO planner: everyone is admitted, and most are served late
    today = simulate(cost, reqs, arrivals)
    assert all(r.success for r in today.results)
    assert sum(r.ttft_s > 0.5 for r in today.results) > 30 and max(max(r.itl_s) for r in today.results) > 0.05


def test_queue_policy_starves_nobody():
    cost = linear_cost(per_prefill=0.0002)
    reqs, arrivals = burst(60, 100, 20)
    reqs = reqs + [SampleRequest("", 100, 20) for _ in range(60)]
    arrivals = arrivals + [0.05 * i for i in range(60)]  # a steady stream behind the burst
    out = simulate(cost, reqs, arrivals, slo_ttft_ms=500, slo_tpot_ms=50, slo_policy="queue")
    assert all(r.success for r in out.results)  # every request runs to its end
    # under the batch target throughout: 10 ms + 16 x 0.2 ms + 2 ms per decode <= 90% of 50 ms
    assert max(len(s.scheduled) for s in out.steps) <= 15


def test_simulate_cli_compares_slo_aware_with_todays_scheduler(tmp_path, capsys):
    import json
    import re

    from test_simulator import LLAMA3_8B
    from tokenmill.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    # Llama 3 8B on one L4 at 8 req/s of 512/128: several times what it can serve
    assert main(["simulate", "--model", str(tmp_path / "config.json"), "--hardware", "l4", "--dataset", "random",
                 "--num-prompts", "200", "--input-len", "512", "--output-len", "128", "--tokenizer",
                 "smollm2-135m-instruct", "--request-rate", "8", "--duration", "25", "--max-num-seqs", "64",
                 "--slo", "ttft:1000", "tpot:100", "--compare", "--slo-ttft-ms 1000 --slo-tpot-ms 100"]) == 0
    text = capsys.readouterr().out
    today, slo = text.split("== B:")
    goodput = [float(re.search(r"Request goodput \(req/s\):\s+([0-9.]+)", t).group(1)) for t in (today, slo)]
    failed = [int(re.search(r"Failed requests:\s+([0-9]+)", t).group(1)) for t in (today, slo)]
    assert failed[0] == 0 and failed[1] > 0  # today's admits everyone; the SLO-aware one sheds
    assert goodput[1] > 2 * goodput[0]


# ---------------------------------------------------------------- the server: 503 with Retry-After, at once


def test_server_sheds_with_503_and_retry_after_within_50ms():
    """Shed requests hear their 503 at once: within 50 ms of arrival as the server measures it (the client
    shares these cores, so its own clock measures the machine), and before any admitted request ends."""
    from helpers import metric
    from test_server_failures import fake_engine, running

    delay = 0.02
    engine = fake_engine(delay=delay, max_num_seqs=4,
                         scheduler=SchedulerConfig(max_num_seqs=4, slo_ttft_ms=300, slo_tpot_ms=50),
                         cost=lambda s: delay)
    with running(engine) as (srv, ae, _):
        async def one(client: httpx.AsyncClient, i: int):
            t = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json={
                    "model": "fake", "prompt": f"the cat {i}", "max_tokens": 20, "stream": True}) as r:
                status, retry = r.status_code, r.headers.get("retry-after")
                first = time.perf_counter() - t
                async for _ in r.aiter_bytes():
                    pass
            return status, retry, first, time.perf_counter() - t

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                return await asyncio.gather(*(one(client, i) for i in range(24)))

        results = asyncio.run(main())
        shed = [r for r in results if r[0] == 503]
        served = [r for r in results if r[0] == 200]
        assert shed and served and len(shed) + len(served) == 24
        assert all(retry is not None and int(retry) >= 1 for _, retry, _, _ in shed)
        metrics = httpx.get(srv.url + "/metrics").text
        assert f'tokenmill:requests_shed_total{{model_name="fake",reason="ttft_slo"}} {len(shed)}.0' in metrics
        # the server's own clock: every refusal within 50 ms of its arrival
        refusal = "tokenmill:request_refusal_seconds_bucket"
        assert metric(metrics, refusal, code="slo_overloaded", le="+Inf") == len(shed)
        assert metric(metrics, refusal, code="slo_overloaded", le="0.05") == len(shed)
        # the client's clock, against a baseline from this run: a shed request's answer takes less than an
        # admitted request's whole stream (20 steps of 20 ms at least)
        assert max(first for _, _, first, _ in shed) < min(whole for _, _, _, whole in served)
        assert "tokenmill:batch_size_target" in metrics
        # a request with a looser SLO of its own gets in
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2,
                                                          "slo_ttft_ms": 600_000})
        assert r.status_code == 200, r.text
        # and its own TPOT SLO travels with it; a bad one is the caller's error
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2,
                                                          "slo_ttft_ms": 600_000, "slo_tpot_ms": 40})
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "x", "slo_tpot_ms": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "slo_tpot_ms"


# ---------------------------------------------------------------- the real engine, as `serve` configures it


def test_serve_plans_to_a_100ms_itl_by_default_and_offline_commands_do_not():
    from tokenmill.cli import build_parser
    from tokenmill.config import EngineConfig
    from tokenmill.engine.arg_utils import engine_kwargs

    p = build_parser()
    serve = EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["serve"]))).scheduler
    assert serve.itl_target_ms == 100 and serve.plans_steps and serve.max_num_batched_tokens == 2048
    off = EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["serve", "--itl-target-ms", "0"]))).scheduler
    assert not off.plans_steps and off.max_num_batched_tokens == 256
    producer = EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["serve", "--kv-role", "producer"]))).scheduler
    assert not producer.plans_steps  # a prefill instance has no decodes to protect
    offline = EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["generate", "hi"]))).scheduler
    assert not offline.plans_steps
    # only a server measures the machine's roofline (its /metrics report use of it; a one-shot answer does not)
    assert EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["serve"]))).measure_roofline
    assert not EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["generate", "hi"]))).measure_roofline
    with pytest.raises(ValueError, match="--slo-tpot-ms or --itl-target-ms"):
        EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["serve", "--itl-target-ms", "0",
                                                               "--slo-ttft-ms", "1000"])))


def test_planned_steps_on_the_real_model_keep_the_default_outputs(llm_default):
    """The serve default (a 100 ms ITL target, the cost model measured at startup) on the default model:
    a long prompt arriving beside a decode is cut into chunks the model predicts within the target, and
    every output is the same bits as the fixed budget's (the kernels are batch invariant)."""
    from tokenmill import LLM, SamplingParams

    planned = LLM("smollm2-135m-instruct", kv_cache_memory="256MiB", max_model_len=2048, itl_target_ms=100)
    engine = planned.engine
    assert isinstance(engine.scheduler.planner, SLOPlanner)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    long_prompt = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(120))
    prompts = ["Write a haiku about the sea.", long_prompt]
    engine.add_request(prompts[0], greedy, "short")
    engine.step()  # the short request is decoding when the long prompt arrives
    engine.add_request(prompts[1], greedy, "long")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    stats = list(engine.step_stats)
    mixed = [s for s in stats if s.num_decode_tokens and s.num_prefill_tokens]
    assert mixed and all(s.predicted_duration is not None for s in stats)
    # the long prompt went in pieces under the cap, each planned to the target
    assert all(s.num_prefill_tokens < engine.config.scheduler.max_num_batched_tokens for s in mixed)
    assert all(s.predicted_duration <= 0.1 + 1e-6 or s.num_prefill_tokens <= 16 for s in mixed)
    ref = llm_default.generate(prompts, greedy, use_tqdm=False)
    assert [outs["short"], outs["long"]] == [r.outputs[0].token_ids for r in ref]
