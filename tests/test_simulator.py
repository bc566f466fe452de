"""The simulator: the real scheduler's schedule, roofline arithmetic by hand, the CLI's answers and
errors, and its speed."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tokenmill.bench.datasets import SampleRequest
from tokenmill.config import ModelConfig, SchedulerConfig
from tokenmill.core.step_cost import CalibratedCost, StepShape
from tokenmill.sim.cost import RooflineCost, layer_params
from tokenmill.sim.hardware import KNOWN, load_hardware
from tokenmill.sim.simulator import Simulator

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
    with pytest.raises(ValueError, match="tensor and pipeline parallelism together"):
        RooflineCost(llama3_8b(), load_hardware("h100"), tensor_parallel_size=2, pipeline_parallel_size=2)


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


def test_calibrated_fit_recovers_a_linear_cost():
    rng = np.random.default_rng(1)
    shapes = [StepShape(int(p), int(d), int(d) + 1, int(d) * 300 + int(p) * 50, 0, int(d) * 300, int(d) + 1)
              for p, d in rng.integers(0, 256, (40, 2))]
    truth = [0.002 + 1e-4 * s.prefill_tokens + 3e-4 * s.decode_tokens + 1e-5 * s.decode_context / 1e3 for s in shapes]
    model = CalibratedCost.fit(shapes, truth)
    assert [model(s) for s in shapes] == pytest.approx(truth, rel=1e-6)


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
    assert main(base + ["--hardware", "h100", "--slo", "ttft:0.001"]) == 0
    assert "no rate meets the SLOs" in capsys.readouterr().out
    assert main(base + ["--hardware", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in KNOWN)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(base + ["--profile", str(bad)]) == 2
    assert "tokenmill profile" in capsys.readouterr().err
    assert main(base + ["--dataset", "trace", "--dataset-path", str(bad), "--hardware", "h100"]) == 2
    assert capsys.readouterr().err


def test_ten_thousand_requests_simulate_in_under_a_minute():
    rng = np.random.default_rng(2)
    reqs = [SampleRequest("", int(n), int(o)) for n, o in zip(rng.integers(50, 2000, 10_000), rng.integers(10, 400, 10_000))]
    arrivals = np.cumsum(rng.exponential(1 / 20, 10_000)).tolist()  # 20 req/s
    cost = RooflineCost(llama3_8b(), KNOWN["h100"])
    t = time.perf_counter()
    out = Simulator(cost, SchedulerConfig(max_num_batched_tokens=8192), 30_000, 16, 8192).run(reqs, arrivals)
    assert time.perf_counter() - t < 60
    assert sum(r.success for r in out.results) == 10_000
