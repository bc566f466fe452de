"""The simulator: the real scheduler's schedule, roofline arithmetic by hand, the CLI's answers and
errors, and its speed."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tokenmill.bench.datasets import SampleRequest
from tokenmill.config import ModelConfig, SchedulerConfig
from tokenmill.perf.step_cost import CalibratedCost, StepShape
from tokenmill.perf.cost import (RooflineCost, kv_bytes_per_token, kv_transfer_bytes, kv_transfer_seconds,
                                 kv_transfer_tokens, layer_params)
from tokenmill.perf.hardware import KNOWN, load_hardware
from tokenmill.sim.simulator import Disaggregation, Simulator

LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0}


def llama3_8b() -> ModelConfig:
    return ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 8192)


def test_roofline_of_a_llama3_8b_decode_step_by_hand():
    cost = RooflineCost(llama3_8b(), load_hardware("h100"))
    assert layer_params(llama3_8b()) == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 == 218_103_808
    assert cost.linear_params == 32 * 218_103_808 + 4096 * 128256 == 7_504_658_432  # 8.03B less the embedding
    one = StepShape(prefill_tokens=0, decode_tokens=1, sampled=1, attention_context=1000, kv_read_tokens=1000,
                    decode_context=1000, num_seqs=1)
    assert cost.flops(one) == 2 * 32 * 218_103_808 + 2 * 4096 * 128256 + 4 * 32 * 32 * 128 * 1000 == 15_533_604_864
    kv_token = 2 * 32 * 8 * 128 * 2
    assert cost.bytes(one) == 2 * 7_504_658_432 + (1000 + 1) * kv_token == 15_140_519_936
    b = cost.breakdown(one)
    assert b["memory_s"] == pytest.approx(15_140_519_936 / 3.35e12)  # 4.52 ms: bandwidth-bound
    assert b["seconds"] == pytest.approx(b["memory_s"]) and b["compute_s"] < b["memory_s"] / 100
    # a 4096-token prefill is compute-bound
    big = StepShape(4096, 0, 1, 4096 * 4097 // 2, 4096, 0, 1)
    assert cost.breakdown(big)["compute_s"] > cost.breakdown(big)["memory_s"]
    # tensor parallel 2: half the compute and bandwidth time, plus 64 ring all-reduces of 4096 x 4096 bf16
    tp = RooflineCost(llama3_8b(), load_hardware("h100"), tensor_parallel_size=2)
    ring = 2 * 1 / 2 * 4096 * 4096 * 2 / 450e9 + 2 * 5e-6
    assert tp.breakdown(big)["comm_s"] == pytest.approx(64 * ring)
    assert tp.breakdown(big)["compute_s"] == pytest.approx(cost.breakdown(big)["compute_s"] / 2)


def test_a_fitted_profile_prices_steps_by_its_efficiencies_and_overheads():
    """h100-fitted: the datasheet's peaks times the fitted efficiencies (fp8 its own), plus the per-step and
    per-request overheads; the datasheet profile itself stays the pure roofline."""
    hw, roof = load_hardware("h100-fitted"), load_hardware("h100")
    assert roof.bandwidth_efficiency == roof.flops_efficiency == 1.0 and roof.step_overhead == 0.0
    assert hw.memory_bandwidth == roof.memory_bandwidth and 0 < hw.bandwidth_efficiency < 1
    batch = StepShape(0, 64, 64, 64 * 1000, 64 * 1000, 64 * 1000, 64)
    fitted, datasheet = RooflineCost(llama3_8b(), hw), RooflineCost(llama3_8b(), roof)
    b = fitted.breakdown(batch)
    assert b["memory_s"] == pytest.approx(datasheet.breakdown(batch)["memory_s"] / hw.bandwidth_efficiency)
    assert b["seconds"] == pytest.approx(max(b["compute_s"], b["memory_s"]) + hw.step_overhead
                                         + 64 * hw.sequence_overhead)
    big = StepShape(4096, 0, 1, 4096 * 4097 // 2, 4096, 0, 1)
    fp8 = RooflineCost(llama3_8b(), hw, "fp8", "fp8", "fp8").breakdown(big)["compute_s"]
    assert fp8 == pytest.approx(datasheet.flops(big) / (1978.9e12 * hw.low_precision_flops_efficiency))
    bf16 = fitted.breakdown(big)["compute_s"]
    assert bf16 == pytest.approx(datasheet.flops(big) / (989.4e12 * hw.flops_efficiency))


def test_fp8_compute_by_hand():
    """--compute-dtype fp8 (W8A8): a compute-bound prefill takes the fp8 peak (1,978.9 TFLOP/s on an H100,
    twice bf16's); activations between devices stay bf16; a GPU without an fp8 peak says which it has."""
    s = StepShape(4096, 0, 1, 4096 * 4097 // 2, 4096, 0, 1)
    bf16 = RooflineCost(llama3_8b(), load_hardware("h100"), "fp8", "fp8")
    fp8 = RooflineCost(llama3_8b(), load_hardware("h100"), "fp8", "fp8", "fp8", tensor_parallel_size=2)
    assert fp8.breakdown(s)["compute_s"] == pytest.approx(bf16.flops(s) / (2 * 1978.9e12))
    assert fp8.breakdown(s)["compute_s"] == pytest.approx(bf16.breakdown(s)["compute_s"] / 4, rel=1e-4)  # 2 devices
    assert fp8.act_bytes == 2
    with pytest.raises(ValueError, match="A100 80GB SXM has no fp8 peak in its profile"):
        RooflineCost(llama3_8b(), load_hardware("a100"), compute_dtype="fp8")


def test_pipeline_parallel_roofline_by_hand():
    """PP=2 on two H100s, a decode step of 8 requests at context 1000: m micro-batches each read a stage's
    weights (half of them) again, the step takes m + 1 stage turns (one is the bubble), and the last
    micro-batch's hidden states and logits cross the link."""
    one = RooflineCost(llama3_8b(), load_hardware("h100"))
    s = StepShape(0, 8, 8, 8 * 1000, 8 * 1000, 8 * 1000, 8)
    weights, kv = 2 * 7_504_658_432, (8 * 1000 + 8) * 2 * 32 * 8 * 128 * 2
    for m in (1, 2, 4):
        pp = RooflineCost(llama3_8b(), load_hardware("h100"), pipeline_parallel_size=2, micro_batches=m)
        stage = (weights / 2 + kv / (2 * m)) / 3.35e12  # bandwidth-bound
        comm = (8 / m * 4096 * 2 / 450e9 + 5e-6) + (8 / m * 128256 * 4 / 450e9 + 5e-6)
        b = pp.breakdown(s)
        assert b["seconds"] == pytest.approx((m + 1) * stage + comm)
        assert b["bubble_s"] == pytest.approx(stage)
    # one micro-batch: the two stages' turns add up to one device's step (plus the transfers); more
    # micro-batches only add weight reads on a bandwidth-bound decode
    m1 = RooflineCost(llama3_8b(), load_hardware("h100"), pipeline_parallel_size=2, micro_batches=1)
    assert m1(s) == pytest.approx(one(s) + m1.pipeline_seconds(s)["comm_s"])
    assert RooflineCost(llama3_8b(), load_hardware("h100"), pipeline_parallel_size=2, micro_batches=4)(s) > m1(s)
    # 4 prompts of 1024 tokens are compute-bound: 4 micro-batches turn 2 turns of 1/2 into 5 of 1/8 (one
    # prompt would be one micro-batch: requests are not split)
    big = StepShape(4096, 0, 4, 4 * 1024 * 1025 // 2, 4096, 0, 4)
    flops = one.flops(big)
    m4 = RooflineCost(llama3_8b(), load_hardware("h100"), pipeline_parallel_size=2, micro_batches=4)
    assert m4.pipeline_seconds(big)["stage_s"] == pytest.approx(flops / (4 * 2 * 989.4e12))
    assert m4.pipeline_seconds(StepShape(4096, 0, 1, 4096 * 4097 // 2, 4096, 0, 1))["turns"] == 2
    # steps in flight: the first stage takes the next step after its one turn; the step's latency is both
    # turns and the transfers
    assert m1.pipeline_times(s) == pytest.approx((m1.pipeline_seconds(s)["stage_s"], m1(s)))
    # tensor x pipeline, 2 x 2 H100s: a stage's turn splits its weights and KV over its 2 devices and adds
    # their all-reduces over its 16 layers (8 tokens x 4096 bf16)
    both = RooflineCost(llama3_8b(), load_hardware("h100"), tensor_parallel_size=2, pipeline_parallel_size=2)
    ring = 2 * 1 / 2 * 8 * 4096 * 2 / 450e9 + 2 * 5e-6
    assert both.pipeline_seconds(s)["stage_s"] == pytest.approx((weights / 2 + kv / 2) / (2 * 3.35e12) + 32 * ring)


def test_roofline_of_the_embedded_model_by_hand(gguf_path):
    from tokenmill.sim.cli import model_config

    cfg, _ = model_config("smollm2-135m-instruct")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == \
        (576, 1536, 30, 9, 3)
    cost = RooflineCost(cfg, load_hardware("l4"))
    assert cost.linear_params == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 576 * 49152 == 134_479_872
    step = StepShape(0, 8, 8, 8 * 512, 8 * 512, 8 * 512, 8)
    assert cost(step) == pytest.approx((2 * 134_479_872 + (8 * 512 + 8) * 2 * 30 * 3 * 64 * 2) / 300e9)


def test_model_config_alone_is_enough(tmp_path):
    from tokenmill.sim.cli import model_config

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    cfg, _ = model_config(str(tmp_path / "config.json"))
    assert cfg == llama3_8b().__class__(**{**llama3_8b().__dict__, "rope_theta": 500000.0, "rms_norm_eps": 1e-6})


def test_the_simulator_runs_the_engines_schedule(tmp_path):
    """The same workload through the real engine (a tiny model, a fake clock) and through the simulator:
    the same steps, with the same requests and tokens in each."""
    from tiny_models import random_hf_model, save_hf_folder

    from tokenmill import LLM, SamplingParams

    folder = save_hf_folder(random_hf_model(max_position_embeddings=512), tmp_path / "m")
    llm = LLM(str(folder), kv_cache_memory=str(20 * 16 * 2 * 2 * 2 * 16 * 4), max_num_batched_tokens=64,
              max_num_seqs=6)
    engine = llm.engine
    rng = np.random.default_rng(0)
    reqs = [SampleRequest("", int(n), int(o), prompt_ids=rng.integers(5, 300, int(n)).tolist())
            for n, o in zip(rng.integers(10, 120, 12), rng.integers(3, 40, 12))]
    steps, clock = [], [0.0]
    engine.scheduler.clock = lambda: clock[0]
    real = engine.scheduler.schedule

    def recording():
        out = real()
        steps.append((out.num_prefill_tokens, out.num_decode_tokens,
                      tuple((s.request_id, len(s.token_ids)) for s in out.scheduled)))
        clock[0] += 1.0
        return out

    engine.scheduler.schedule = recording
    for k, r in enumerate(reqs):
        engine.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(k))
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.kv_cache
    sim = Simulator(lambda shape: 1.0, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64),
                    kv.num_blocks, kv.block_size, engine.max_model_len, kv.enable_prefix_caching)
    out = sim.run(reqs, [0.0] * len(reqs))
    assert [(s.prefill_tokens, s.decode_tokens, s.scheduled) for s in out.steps] == [s for s in steps if s[2]]
    assert engine.num_preemptions == out.num_preemptions > 0  # the small pool made it preempt: same victims
    assert all(r.success and r.completion_tokens == q.output_len for r, q in zip(out.results, reqs))


def test_simulated_timings_follow_the_cost_model():
    reqs = [SampleRequest("", 32, 4)]
    out = Simulator(lambda s: 0.01 * s.tokens, SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024).run(
        reqs, [2.0])
    r = out.results[0]
    assert r.ttft_s == pytest.approx(0.32) and r.itl_s == pytest.approx([0.01] * 3)
    assert r.e2el_s == pytest.approx(0.35) and out.duration == pytest.approx(2.35)
    # 8 ms of front end a request: the first reaches the scheduler at 2.008 s and its prefill ends at 2.328;
    # the second, arriving at 2.3, reaches it at 2.308, so its prefill joins the first's decode in one step
    # of 33 tokens (2.328 to 2.658), then both decode (0.02 s a step)
    slow = Simulator(lambda s: 0.01 * s.tokens, SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024,
                     request_overhead_s=0.008)
    first, second = slow.run(reqs * 2, [2.0, 2.3]).results
    assert first.ttft_s == pytest.approx(0.328) and first.itl_s == pytest.approx([0.33, 0.02, 0.02])
    assert first.e2el_s == pytest.approx(0.698) and first.start_s == 2.0
    assert second.ttft_s == pytest.approx(2.658 - 2.3) and second.start_s == 2.3
    assert second.itl_s == pytest.approx([0.02, 0.02, 0.01])
    # the front end on the engine's cores: the second request's 8 ms also slow the first's prefill, running
    # when it reaches the scheduler (2.328 -> 2.336), and everything after moves with it
    shared = Simulator(lambda s: 0.01 * s.tokens, SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024,
                       request_overhead_s=0.008, front_end_shares_cpu=True)
    out = shared.run(reqs * 2, [2.0, 2.3])
    first, second = out.results
    assert first.ttft_s == pytest.approx(0.336) and first.itl_s == pytest.approx([0.33, 0.02, 0.02])
    assert second.ttft_s == pytest.approx(2.666 - 2.3)
    assert out.steps[0].duration == pytest.approx(0.328)
    # plus 0.5 ms a prompt token: 8 + 16 ms before the scheduler sees a 32-token prompt
    longer = Simulator(lambda s: 0.01 * s.tokens, SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024,
                       request_overhead_s=0.008, request_overhead_per_token_s=0.0005)
    assert longer.run(reqs, [2.0]).results[0].ttft_s == pytest.approx(0.024 + 0.32)
    with pytest.raises(ValueError, match=r"request overhead \(--request-overhead-ms\) must be >= 0"):
        Simulator(lambda s: 0.01, SchedulerConfig(), 64, 16, 1024, request_overhead_s=-1)


def test_kv_bytes_a_request_ships_by_hand(gguf_path):
    """L x 2 x G x h elements a token, plus for an int8/fp8 cache a float32 scale per token and KV head for
    K and for V in every layer; the same as the engine counts and allocates them."""
    import torch

    from tokenmill.sim.cli import model_config
    from tokenmill.worker.model_runner import allocate_kv_cache, kv_cache_bytes_per_token

    smol, _ = model_config("smollm2-135m-instruct")
    assert (smol.num_layers, smol.num_kv_heads, smol.head_dim) == (30, 3, 64)
    assert kv_bytes_per_token(smol, "fp32") == 30 * 2 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(smol, "bf16") == 30 * 2 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(smol, "int8") == kv_bytes_per_token(smol, "fp8") == 30 * 2 * 3 * (64 + 4) == 12_240
    llama = llama3_8b()
    assert kv_bytes_per_token(llama, "bf16") == 32 * 2 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(llama, "int8") == 32 * 2 * 8 * (128 + 4) == 67_584
    # the engine's count, and the tensors it allocates for one block of one token
    for kv_dtype, dtype in (("auto", torch.float32), ("int8", torch.float32), ("fp8", torch.bfloat16)):
        ours = kv_bytes_per_token(smol, {"auto": "fp32"}.get(kv_dtype, kv_dtype))
        assert kv_cache_bytes_per_token(smol, dtype, kv_dtype) == ours
        pool = allocate_kv_cache(smol, 1, 1, dtype, torch.device("cpu"), kv_dtype)
        assert sum(t.numel() * t.element_size() for layer in pool for t in layer) == ours
    # a 2048-token prompt ships tokens 0..2046: the decode instance recomputes the last one
    assert kv_transfer_tokens(2048) == 2047 and kv_transfer_tokens(2048, cached=1024) == 1023
    assert kv_transfer_tokens(1) == 0
    assert kv_transfer_bytes(llama, 2048) == 2047 * 131_072 == 268_304_384
    assert kv_transfer_bytes(llama, 2048, "int8") == 2047 * 67_584


def test_kv_transfer_time_over_a_link_by_hand():
    nbytes = 2047 * 131_072
    assert KNOWN["h100"].kv_link_bandwidth == 400e9 / 8 == 50e9  # a ConnectX-7 at 400 Gb/s a GPU
    assert kv_transfer_seconds(nbytes, 50e9, 5e-6) == pytest.approx(268_304_384 / 50e9 + 5e-6)  # 5.37 ms
    assert kv_transfer_seconds(nbytes, 100e9 / 8) == pytest.approx(0.021_464_350_72)  # 100 Gb/s Ethernet
    d = Disaggregation(1, 1, 131_072, 50e9, 5e-6)
    assert d.transfer(2048) == (268_304_384, pytest.approx(0.005_371_087_68))
    with pytest.raises(ValueError, match="positive bandwidth"):
        kv_transfer_seconds(nbytes, 0.0)
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        Disaggregation(0, 1, 1.0, 1.0)


def test_disaggregated_timings_by_hand():
    """32-token prompt, 4 tokens, 0.01 s a token: the producer's prefill (0.32 s), the KV of 31 tokens at
    1000 B over 31 kB/s (1 s) + 0.25 s, then the decode instance computes token 31 and samples (0.01 s)
    and decodes 3 more."""
    cost = lambda s: 0.01 * s.tokens  # noqa: E731
    reqs = [SampleRequest("", 32, 4)]
    dis = Disaggregation(1, 1, kv_token_bytes=1000, link_bandwidth=31_000, link_latency=0.25)
    out = Simulator(cost, SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024, disaggregation=dis).run(
        reqs, [2.0])
    r = out.results[0]
    assert r.success and r.completion_tokens == 4
    assert r.ttft_s == pytest.approx(0.32 + 1.25 + 0.01) and r.itl_s == pytest.approx([0.01] * 3)
    assert r.e2el_s == pytest.approx(1.61) and out.duration == pytest.approx(3.61)
    (t,) = out.transfers
    assert (t.producer, t.consumer, t.bytes) == (0, 1, 31_000)
    assert (t.prefilled, t.start, t.end) == pytest.approx((2.32, 2.32, 3.57))
    assert out.roles == ("prefill", "decode")
    # the producer computes the prompt; the decode instance computes one token at position 31, then decodes
    assert [(s.instance, s.prefill_tokens, s.decode_tokens, s.scheduled) for s in out.steps] == \
        [(0, 32, 0, (("0", 32),)), (1, 1, 0, (("0", 1),))] + [(1, 0, 1, (("0", 1),))] * 3
    # the same request on one instance: TTFT less by the transfer and the decode instance's first step
    one = Simulator(cost, SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024).run(reqs, [2.0]).results[0]
    assert r.ttft_s - one.ttft_s == pytest.approx(1.25 + 0.01)


def test_disaggregated_llama3_8b_ttft_grows_by_the_transfer():
    """One 2048-token prompt on H100s: TTFT = the prefill step + 2047 x 131072 B over the link + 5 us + one
    step of one token at position 2047; a 100 Gb/s link adds 2047 x 131072 (1 / 12.5e9 - 1 / 50e9) s."""
    from tokenmill.perf.step_cost import StepShape as S

    cost = RooflineCost(llama3_8b(), KNOWN["h100"])
    reqs = [SampleRequest("", 2048, 16)]
    config = SchedulerConfig(max_num_batched_tokens=8192)

    def ttft(gbps: float | None) -> float:
        dis = None if gbps is None else Disaggregation(1, 1, 131_072, gbps * 1e9 / 8, 5e-6)
        return Simulator(cost, config, 10_000, 16, 8192, disaggregation=dis).run(reqs, [0.0]).results[0].ttft_s

    alone, fast, slow = ttft(None), ttft(400), ttft(100)
    assert alone == pytest.approx(cost(S(2048, 0, 1, 2048 * 2049 // 2, 2048, 0, 1)))  # the prefill: ~30 ms
    first_step = cost(S(1, 0, 1, 2048, 2048, 2048, 1))  # token 2047 over a context of 2047: ~4.6 ms
    assert fast == pytest.approx(alone + 268_304_384 / 50e9 + 5e-6 + first_step)
    assert slow - fast == pytest.approx(268_304_384 * (1 / 12.5e9 - 1 / 50e9))  # 16.1 ms more


def test_a_full_decode_instance_queues_and_one_that_cannot_fit_rejects():
    """max_num_seqs 1: the second request reaches the decode instance while the first decodes and waits in
    its queue; only once admitted (its blocks reserved) does it pull its KV, which its producer holds till
    then. A request whose prompt and output could never fit a decode instance's pool is refused (400)
    before any prefill."""
    cost = lambda s: 0.01 * s.tokens  # noqa: E731
    dis = Disaggregation(1, 1, kv_token_bytes=1000, link_bandwidth=3_100_000)  # 31 tokens: 0.01 s
    sim = Simulator(cost, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256), 8, 16, 1024,
                    disaggregation=dis)
    out = sim.run([SampleRequest("", 32, 50), SampleRequest("", 32, 50), SampleRequest("", 32, 200)], [0.0, 0.0, 0.0])
    a, b, c = out.results
    # a: prefill [0, 0.32], KV [0.32, 0.33], first token 0.34, last 0.83
    assert a.ttft_s == pytest.approx(0.34) and a.e2el_s == pytest.approx(0.83)
    # b: prefill [0.32, 0.64], queued at the decode instance till a ends at 0.83, KV [0.83, 0.84], first
    # token 0.85
    assert b.ttft_s == pytest.approx(0.85) and b.itl_s == pytest.approx([0.01] * 49)
    assert [t.index for t in out.transfers] == [0, 1]
    assert [x for t in out.transfers for x in (t.prefilled, t.admitted, t.start, t.end)] == pytest.approx(
        [0.32, 0.32, 0.32, 0.33, 0.64, 0.83, 0.83, 0.84])
    assert max(s.num_waiting for s in out.steps if s.instance == 1) == 1
    # the producer held a's 2 blocks (its 32 prompt tokens) through b's prefill: they were sent at 0.33,
    # after b's step began
    assert [s.kv_blocks_used for s in out.steps if s.instance == 0] == [2, 4]
    assert not c.success and c.status == 400 and "KV blocks" in c.error
    # two producers share one decode instance's link: the second transfer waits for the first
    two = Simulator(cost, SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024,
                    disaggregation=Disaggregation(2, 1, 1000, 31_000)).run(
        [SampleRequest("", 32, 4)] * 2, [0.0, 0.0])
    assert [(t.producer, t.consumer) for t in two.transfers] == [(0, 2), (1, 2)]
    assert [x for t in two.transfers for x in (t.start, t.end)] == pytest.approx([0.32, 1.32, 1.32, 2.32])


def test_disaggregated_prefix_cache_ships_only_what_the_decode_instance_lacks():
    """The same 64-token prompt twice: the second is prefilled from the producer's cache (48 tokens: 3 full
    blocks) and the decode instance, which cached tokens 0..62 of the first, pulls only tokens 48..62."""
    ids = list(range(100, 164))
    dis = Disaggregation(1, 1, kv_token_bytes=1000, link_bandwidth=1e6)
    out = Simulator(lambda s: 0.01 * s.tokens, SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024,
                    disaggregation=dis).run([SampleRequest("", 64, 4, prompt_ids=ids)] * 2, [0.0, 1.0])
    assert [t.bytes for t in out.transfers] == [63 * 1000, 15 * 1000]
    assert [s.prefill_tokens for s in out.steps if s.instance == 0] == [64, 16]
    assert all(r.success for r in out.results)


def test_calibrated_fit_recovers_a_linear_cost():
    rng = np.random.default_rng(1)
    shapes = [StepShape(int(p), int(d), int(d) + 1, int(d) * 300 + int(p) * 50, 0, int(d) * 300, int(d) + 1)
              for p, d in rng.integers(0, 256, (40, 2))]
    truth = [0.002 + 1e-4 * s.prefill_tokens + 3e-4 * s.decode_tokens + 1e-5 * s.decode_context / 1e3 for s in shapes]
    model = CalibratedCost.fit(shapes, truth)
    assert [model(s) for s in shapes] == pytest.approx(truth, rel=1e-6)
    # two machines' steps that no one line fits: the weights choose whose error counts
    other = [2 * t for t in truth]
    both = [s for s in shapes for _ in (0, 1)]
    seconds = [t for pair in zip(truth, other) for t in pair]
    for w_truth, expect in ((1.0, truth), (0.0, other)):
        weights = [w for _ in shapes for w in (w_truth, 1.0 - w_truth)]
        model = CalibratedCost.fit(both, seconds, weights=weights)
        assert [model(s) for s in shapes] == pytest.approx(expect, rel=1e-6)
    unweighted = CalibratedCost.fit(both, seconds)
    assert all(t < unweighted(s) < 2 * t for s, t in zip(shapes, truth))


def test_served_steps_are_charged_their_cycle_by_hand(tmp_path, capsys):
    from tokenmill.cli import main
    from tokenmill.engine.step_log import read_step_log, step_cycles

    def step(start: float, duration: float, running: int, waiting: int, decodes: int) -> dict:
        return {"start": start, "duration": duration, "running": running, "waiting": waiting, "prefill_tokens": 0,
                "decode_tokens": decodes, "sampled": decodes, "attention_context": 100 * decodes,
                "kv_read_tokens": 100 * decodes, "decode_context": 100 * decodes, "num_seqs": decodes}

    # busy steps run on at once: start to the next start (gaps 1, 3, 2 ms); an idle end, the last step
    # and one followed by a pause (0.988 s, over 10 median gaps) get their duration plus the median gap
    # of the busy steps (1, 2, 3, 988 ms: 2.5)
    steps = [step(0.0, 0.010, 2, 0, 2), step(0.011, 0.010, 2, 1, 2), step(0.024, 0.010, 0, 0, 2),
             step(1.0, 0.005, 1, 0, 1), step(1.007, 0.005, 1, 0, 1), step(2.0, 0.005, 0, 0, 1)]
    log = tmp_path / "steps.jsonl"
    text = "\n".join(json.dumps(r) for r in [{"engine": {"model": "m", "kv_bytes_per_token": 8}}, *steps])
    log.write_text(text + '\n{"start": 3.0, "dur')  # cut short while written: dropped
    head, records = read_step_log(log)
    assert head["model"] == "m" and len(records) == 6
    shapes, cycles = step_cycles(records)
    assert cycles == pytest.approx([0.011, 0.013, 0.0125, 0.007, 0.0075, 0.0075])
    assert [s.decode_tokens for s in shapes] == [2, 2, 2, 1, 1, 1]
    log.write_text(text.replace('"running": 2, "waiting": 1', '"waiting": 1', 1))
    with pytest.raises(ValueError, match="line 3: not a step written by `tokenmill serve --step-log`"):
        read_step_log(log)
    with pytest.raises(ValueError, match="cannot read the step log"):
        read_step_log(tmp_path / "missing.jsonl")
    # enough of them to fit: a step of d decodes served in 3 ms + 2 ms a decode
    rows, t = [], 0.0
    for i in range(20):  # 1 ms between steps
        rows.append(step(t, 0.002 + 0.002 * (1 + i % 5), 1, 0, 1 + i % 5))
        t += rows[-1]["duration"] + 0.001
    log.write_text("\n".join(json.dumps(r) for r in [{"engine": {"model": "m", "kv_bytes_per_token": 8}}, *rows]))
    out = tmp_path / "served.json"
    assert main(["profile", "--from-step-log", str(log), "--output", str(out)]) == 0
    assert "held-out steps: time-weighted mean error 0.0%" in capsys.readouterr().out
    model = CalibratedCost.load(out)
    assert model.meta["source"] == "served steps" and model.meta["kv_bytes_per_token"] == 8
    assert model(StepShape(0, 3, 3, 300, 300, 300, 3)) == pytest.approx(0.009, rel=1e-6)
    log.write_text(json.dumps(rows[0]))
    assert main(["profile", "--from-step-log", str(log)]) == 2
    assert "tokenmill serve --step-log" in capsys.readouterr().err


def test_cli_answers_and_errors(tmp_path, capsys):
    from tokenmill.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    base = ["simulate", "--model", str(tmp_path / "config.json"), "--dataset", "random", "--num-prompts", "50",
            "--input-len", "512", "--output-len", "128", "--tokenizer", "smollm2-135m-instruct", "--duration", "5"]
    assert main(base + ["--hardware", "h100", "--slo", "ttft:500", "tpot:50"]) == 0
    text = capsys.readouterr().out
    rate = float(text.split("highest rate meeting the SLOs at p99: ")[1].split()[0])
    assert rate > 1 and "users supported:" in text and "where the time goes" in text
    assert main(base + ["--hardware", "h100", "--compare", "--hardware l4 --weight-dtype fp8", "--slo",
                        "ttft:500", "tpot:50"]) == 0
    text = capsys.readouterr().out
    assert "== A:" in text and "== B:" in text and "L4" in text
    # --save-result: bench serve's (vLLM's flat) layout, which the scripts for measured results read
    assert main(base + ["--hardware", "h100", "--request-rate", "4", "--save-result", str(tmp_path / "r.json"),
                        "--compare", "--hardware l4"]) == 0
    a_doc, b_doc = (json.loads((tmp_path / f"r-{k}.json").read_text()) for k in "AB")
    assert a_doc["backend"] == "tokenmill-simulate" and a_doc["simulated"]["hardware"] == "h100"
    assert len(a_doc["ttfts"]) == a_doc["completed"] == 50 and a_doc["mean_ttft_ms"] > 0
    assert b_doc["simulated"]["hardware"] == "l4" and b_doc["mean_tpot_ms"] > a_doc["mean_tpot_ms"]  # L4 is slower
    capsys.readouterr()
    assert main(base + ["--hardware", "h100", "--slo", "ttft:0.001"]) == 0
    assert "no rate meets the SLOs" in capsys.readouterr().out
    assert main(base + ["--hardware", "h100", "--request-overhead-ms", "5", "5", "5"]) == 2
    assert "FIXED and optionally PER_1K" in capsys.readouterr().err
    assert main(base + ["--hardware", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in KNOWN)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(base + ["--profile", str(bad)]) == 2
    assert "tokenmill profile" in capsys.readouterr().err
    assert main(base + ["--dataset", "trace", "--dataset-path", str(bad), "--hardware", "h100"]) == 2
    assert capsys.readouterr().err


def test_cli_disaggregated(tmp_path, capsys):
    from tokenmill.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    base = ["simulate", "--model", str(tmp_path / "config.json"), "--dataset", "random", "--num-prompts", "1",
            "--input-len", "2048", "--output-len", "16", "--tokenizer", "smollm2-135m-instruct", "--request-rate",
            "inf", "--hardware", "h100"]
    assert main(base + ["--disaggregated", "1:1"]) == 0
    text = capsys.readouterr().out
    assert "disaggregated 1:1" in text and "mean 268.3 MB each" in text and "transfer mean 5.37 ms" in text
    assert "decode instances:" in text
    assert main(base + ["--disaggregated", "2:1", "--kv-link-gbps", "100", "--kv-link-latency-us", "0"]) == 0
    assert "transfer mean 21.46 ms" in capsys.readouterr().out
    assert main(base + ["--disaggregated", "1"]) == 2
    assert "P:D" in capsys.readouterr().err
    assert main(base + ["--kv-link-gbps", "100"]) == 2
    assert "--disaggregated" in capsys.readouterr().err


def test_ten_thousand_requests_simulate_in_under_a_minute():
    rng = np.random.default_rng(2)
    reqs = [SampleRequest("", int(n), int(o)) for n, o in zip(rng.integers(50, 2000, 10_000), rng.integers(10, 400, 10_000))]
    arrivals = np.cumsum(rng.exponential(1 / 20, 10_000)).tolist()  # 20 req/s
    cost = RooflineCost(llama3_8b(), KNOWN["h100"])
    t = time.perf_counter()
    out = Simulator(cost, SchedulerConfig(max_num_batched_tokens=8192), 30_000, 16, 8192).run(reqs, arrivals)
    assert time.perf_counter() - t < 60
    assert sum(r.success for r in out.results) == 10_000


def test_steps_in_flight_across_pipeline_stages():
    """The engine's default under pipeline parallelism, simulated: N = 2 steps in flight, the scheduler's
    two lanes taking turns. Stage 0 is free 1 s after a step starts; a step comes back 2.5 s after it
    starts (and after the one before it plus a turn: stages run steps in order). Lane 0's requests start at
    0, lane 1's at 1; each gets a token every 2.5 s (the latency, above N turns)."""

    class Stages:
        def __call__(self, shape):
            raise AssertionError("steps in flight take pipeline_times")

        def pipeline_times(self, shape):
            return 1.0, 2.5

    reqs = [SampleRequest("", 16, 5) for _ in range(4)]
    out = Simulator(Stages(), SchedulerConfig(max_num_batched_tokens=256), 64, 16, 1024,
                    steps_in_flight=2).run(reqs, [0.0] * 4)
    lanes = [set(rid for rid, _ in st.scheduled) for st in out.steps]
    assert lanes[0] == {"0", "1"} and lanes[1] == {"2", "3"} and all(lane in lanes[:2] for lane in lanes)
    assert [st.start for st in out.steps[:4]] == [0.0, 1.0, 2.5, 3.5]
    for k, r in enumerate(out.results):
        assert r.ttft_s == pytest.approx(2.5 if k < 2 else 3.5)
        assert r.itl_s == pytest.approx([2.5] * 4)
    with pytest.raises(ValueError, match="steps in flight need a pipeline-parallel roofline"):
        Simulator(lambda shape: 1.0, SchedulerConfig(), 64, 16, 1024, steps_in_flight=2)



def test_steps_in_flight_with_uneven_lanes_and_a_full_pool_finish_every_request():
    """Requests of very different lengths (the lanes drift apart as they end) through a pool that makes
    later ones wait for blocks, arriving over time: every request gets all its tokens, no step holds a
    request twice, and the run never stalls with work left."""

    class Stages:
        def __call__(self, shape):
            raise AssertionError("steps in flight take pipeline_times")

        def pipeline_times(self, shape):
            return 0.01 + 1e-5 * shape.tokens, 0.03 + 3e-5 * shape.tokens

    # (this draw stalled once: a lane's only request preempted itself, and the lane with work waited for a
    # turn that never came)
    rng = np.random.default_rng(0)
    reqs = [SampleRequest("", int(rng.integers(4, 60)), int(rng.integers(1, 80))) for _ in range(6)]
    arrivals = np.cumsum(rng.exponential(0.3, len(reqs))).tolist()
    out = Simulator(Stages(), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128), 8, 16, 1024,
                    steps_in_flight=2).run(reqs, arrivals)
    assert all(r.success and r.completion_tokens == q.output_len for r, q in zip(out.results, reqs))
    assert out.num_preemptions > 0
    for st in out.steps:
        assert len({rid for rid, _ in st.scheduled}) == len(st.scheduled)


def test_the_simulator_runs_the_engines_schedule_with_steps_in_flight(tmp_path):
    """Pipeline parallelism's steps in flight, through the real engine (two stages of a tiny model) and the
    simulator (a pipeline cost: the first stage free after 1 s, a step back after 2.5 s): the same steps,
    lane by lane, with the same requests and tokens in each, preemptions included."""
    from tiny_models import random_hf_model, save_hf_folder

    from tokenmill import LLM, SamplingParams

    class Stages:
        def __call__(self, shape):
            raise AssertionError("steps in flight take pipeline_times")

        def pipeline_times(self, shape):
            return 1.0, 2.5

    folder = save_hf_folder(random_hf_model(max_position_embeddings=512), tmp_path / "m")
    # stage 0 holds one of the 2 layers: 20 blocks of 16 tokens
    llm = LLM(str(folder), kv_cache_memory=str(20 * 16 * 2 * 1 * 2 * 16 * 4), max_num_batched_tokens=64,
              max_num_seqs=6, pipeline_parallel_size=2)
    try:
        engine = llm.engine
        assert engine.kv_cache.num_blocks == 20 and engine.scheduler.lanes == 2
        rng = np.random.default_rng(1)
        reqs = [SampleRequest("", int(n), int(o), prompt_ids=rng.integers(5, 300, int(n)).tolist())
                for n, o in zip(rng.integers(10, 120, 12), rng.integers(3, 40, 12))]
        steps = []
        real = engine.scheduler.schedule

        def recording():
            out = real()
            steps.append((out.num_prefill_tokens, out.num_decode_tokens,
                          tuple((s.request_id, len(s.token_ids)) for s in out.scheduled)))
            return out

        engine.scheduler.schedule = recording
        for k, r in enumerate(reqs):
            engine.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                               request_id=str(k))
        while engine.has_unfinished_requests():
            engine.step()
        kv = engine.kv_cache
        sim = Simulator(Stages(), SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64), kv.num_blocks,
                        kv.block_size, engine.max_model_len, kv.enable_prefix_caching, steps_in_flight=2)
        out = sim.run(reqs, [0.0] * len(reqs))
        assert [(s.prefill_tokens, s.decode_tokens, s.scheduled) for s in out.steps] == [s for s in steps if s[2]]
        assert engine.num_preemptions == out.num_preemptions > 0
        assert all(r.success and r.completion_tokens == q.output_len for r, q in zip(out.results, reqs))
    finally:
        llm.shutdown()
