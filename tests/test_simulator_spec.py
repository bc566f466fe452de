"""Speculative decoding in the simulator: the verify and draft cost formulas by hand, the acceptance model
against its formula, the real scheduler's accounting of drafts, and end-to-end TPOT on a bandwidth-bound
GPU profile."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import calculate_metrics
from tokenmill.config import ModelConfig, SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.perf.step_cost import CalibratedCost, StepShape
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.perf.cost import (RooflineCost, draft_passes, draft_weight_ratio, expected_tokens_per_step, layer_params,
                                verify_shape)
from tokenmill.perf.hardware import load_hardware
from tokenmill.sim.spec import SimProposer, SpecDecoding, accepted_drafts, draft_cost_model
from tokenmill.spec_decode.step import propose_drafts

LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0}
# Llama 3.2 1B's shape: the 8B's vocabulary, so it can draft for it
LLAMA32_1B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
              "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
              "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True}


def llama3_8b() -> ModelConfig:
    return ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 8192)


def llama32_1b() -> ModelConfig:
    return ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 131072, tie_word_embeddings=True)


# ---- the formulas, by hand -------------------------------------------------------------------------

def test_verify_step_of_llama3_8b_by_hand():
    """8 decoding requests at 1000 tokens of context, 4 drafts each, on an H100: 5x the tokens of a
    decode step for about 1.06x its time, since the weights are read once either way."""
    cost = RooflineCost(llama3_8b(), load_hardware("h100"))
    v = verify_shape(8, 1000, 4)
    assert v == StepShape(prefill_tokens=0, decode_tokens=40, sampled=40, attention_context=8 * (5 * 1000 + 15),
                          kv_read_tokens=8 * 1005, decode_context=8 * 1001, num_seqs=8)
    # 2 T L P + 2 S d V + 4 L H h C = 2*40*32*218_103_808 + 2*40*4096*128256 + 4*32*32*128*40120
    assert layer_params(llama3_8b()) == 218_103_808
    assert cost.flops(v) == 558_345_748_480 + 42_026_926_080 + 21_034_434_560 == 621_407_109_120
    # weights once (2 bytes x 7_504_658_432) + (KV read 8040 + written 40) x 131072 bytes a token
    assert cost.bytes(v) == 15_009_316_864 + 8080 * 131_072 == 16_068_378_624
    b = cost.breakdown(v)
    assert b["compute_s"] == pytest.approx(621_407_109_120 / 989.4e12)  # 0.63 ms
    assert b["seconds"] == b["memory_s"] == pytest.approx(16_068_378_624 / 3.35e12)  # 4.80 ms: bandwidth-bound
    decode = cost(verify_shape(8, 1000, 0))
    assert cost.bytes(verify_shape(8, 1000, 0)) == 15_009_316_864 + (8 * 1001 + 8) * 131_072 == 16_059_990_016
    assert cost(v) / decode == pytest.approx(16_068_378_624 / 16_059_990_016)  # +0.05%
    # a large batch at short contexts is compute-bound: there the drafts cost nearly what they weigh
    assert cost(verify_shape(256, 100, 4)) / cost(verify_shape(256, 100, 0)) > 3


def test_the_schedulers_verify_step_has_the_formulas_shape():
    """The real Scheduler and drafting step with the simulator's proposer: each decoding request is scheduled with 1 + k
    tokens, its drafts' KV slots reserved, and StepShape.of of that step is verify_shape."""
    spec = SpecDecoding("ngram", 4, 0.8)
    kv = KVCacheManager(400, 16, False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096), kv, 8192)
    proposer = SimProposer(spec, 16, draft_cost_model(lambda s: 1e-3, None, 4, 8192))
    for i in range(3):
        sched.add_request(Request(str(i), list(range(1000)), SamplingParams(max_tokens=50), frozenset(), 50))
    out = sched.schedule()
    assert out.num_prefill_tokens == 3000
    sched.update_from_output(out, ModelRunnerOutput({str(i): [7] for i in range(3)}))
    propose_drafts(sched, proposer)  # the step hook: the next step's drafts, their slots reserved
    out = sched.schedule()
    assert [(s.start_pos, len(s.token_ids), s.num_draft_tokens) for s in out.scheduled] == [(1000, 5, 4)] * 3
    assert out.num_decode_tokens == 15
    assert all(len(kv.block_tables[str(i)]) == -(-1005 // 16) for i in range(3))  # slots for the drafts
    assert StepShape.of(out) == verify_shape(3, 1000, 4)
    # 2 of 4 accepted: 3 tokens, and the rejected drafts' slots are written again next step
    sched.update_from_output(out, ModelRunnerOutput({str(i): [7, 7, 7] for i in range(3)}))
    assert [sched.requests[str(i)].num_computed_tokens for i in range(3)] == [1003] * 3
    assert [sched.requests[str(i)].num_output_tokens for i in range(3)] == [4] * 3


def test_drafting_cost_by_hand():
    """A Llama-3.2-1B-shaped drafter for the 8B, 8 requests at 1000 tokens, 4 drafts: four batched
    decode passes of its own, each memory-bound on its 2.47 GB of weights."""
    draft = RooflineCost(llama32_1b(), load_hardware("h100"))
    assert layer_params(llama32_1b()) == 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 == 60_817_408
    assert draft.weight_bytes == 2 * (16 * 60_817_408 + 2048 * 128256) == 2_471_493_632
    assert draft.kv_token_bytes == 2 * 16 * 8 * 64 * 2 == 32_768
    # steady state: pass 0 catches up on the one new token and drafts the first, passes 1-3 feed drafts back
    passes = draft_passes([(1, 1000, 4)] * 8)
    assert passes == [StepShape(0, 8, 8, 8 * (1001 + j), 8 * (1001 + j), 8 * (1001 + j), 8) for j in range(4)]
    assert [draft.bytes(p) for p in passes] == [2_471_493_632 + (8 * (1001 + j) + 8) * 32_768 for j in range(4)] \
        == [2_734_161_920, 2_734_424_064, 2_734_686_208, 2_734_948_352]
    assert sum(draft(p) for p in passes) == pytest.approx(10_938_220_544 / 3.35e12)  # 3.27 ms
    target = RooflineCost(llama3_8b(), load_hardware("h100"))
    assert sum(draft(p) for p in passes) / target(verify_shape(8, 1000, 4)) == pytest.approx(0.680, abs=1e-3)
    # first sight: pass 0 is a 1000-token prefill of the request (logits at its end); a request with
    # fewer drafts drops out of the later passes
    first = draft_passes([(1000, 0, 4), (1, 500, 2)])
    assert first[0] == StepShape(1000, 1, 2, 1000 * 1001 // 2 + 501, 1000 + 501, 501, 2)
    assert first[1:] == [StepShape(0, 2, 2, 1001 + 502, 1001 + 502, 1001 + 502, 2),
                         StepShape(0, 1, 1, 1002, 1002, 1002, 1), StepShape(0, 1, 1, 1003, 1003, 1003, 1)]
    assert draft_passes([(1, 1000, 0)]) == []
    # a calibrated profile prices a drafter pass by the weight bytes: 1_235_746_816 / 7_504_658_432
    assert draft_weight_ratio(llama3_8b(), llama32_1b()) == pytest.approx(0.164664, abs=1e-6)
    assert draft_weight_ratio(llama3_8b(), llama32_1b(), "fp32", "int4") == pytest.approx(0.164664 / 8, abs=1e-6)


def test_the_off_rule_prices_drafts_as_the_engine_measures_them():
    """Its curve: the target's and the drafter's times over n tokens of one request at position 0."""
    target = RooflineCost(llama3_8b(), load_hardware("h100"))
    drafter = RooflineCost(llama32_1b(), load_hardware("h100"))
    ngram = draft_cost_model(target, None, 4, 8192)
    assert ngram.target[0] == (1, target(StepShape(1, 0, 1, 1, 1, 0, 1))) and ngram.drafter is None
    assert ngram(1)(4) < 0.01  # a bandwidth-bound step: 4 more tokens are nearly free
    model = draft_cost_model(target, drafter, 4, 8192)
    assert model(1)(4) == pytest.approx(4 * drafter(StepShape(1, 0, 1, 1, 1, 0, 1)) / target(StepShape(1, 0, 1, 1, 1, 0, 1))
                                        + ngram(1)(4))  # 4 drafter passes of about 0.165 decode steps each
    assert 0.6 < model(1)(4) < 0.75


def test_expected_tokens_per_step_against_the_simulators_sampler():
    # 1 + A + A^2 + A^3 + A^4 at A = 0.8
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096) == \
        pytest.approx((1 - 0.8 ** 5) / 0.2) == pytest.approx(3.3616)
    assert expected_tokens_per_step(0.0, 4) == 1.0 and expected_tokens_per_step(1.0, 4) == 5.0
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.2, 4)
    rng = np.random.default_rng(0)
    for a, k in ((0.8, 4), (0.5, 3), (0.95, 8)):
        draws = np.array([accepted_drafts(rng, k, a) for _ in range(60_000)])
        assert draws.min() >= 0 and draws.max() <= k
        assert (1 + draws).mean() == pytest.approx(expected_tokens_per_step(a, k), abs=0.03)
        for i in range(1, k + 1):  # draft i is accepted with probability A^i
            assert (draws >= i).mean() == pytest.approx(a ** i, abs=0.01)
    assert accepted_drafts(rng, 4, 0.0) == 0 and accepted_drafts(rng, 4, 1.0) == 4 and accepted_drafts(rng, 0, 0.9) == 0


def test_a_draft_model_catches_up_as_the_engines_does():
    """Pass 0 runs over the tokens the drafter has no KV for: the whole context on first sight, then the
    token after the accepted drafts (two when all were accepted), everything again after a preemption
    put the request on other blocks."""
    spec = SpecDecoding("draft", 4, 0.8, drafter=lambda s: 1e-3)
    p = SimProposer(spec, 16, None)
    req = SimpleNamespace(request_id="r", num_tokens=100, num_accepted_drafts=0, max_tokens=500,
                          num_output_tokens=0)
    table = list(range(7))
    assert p.propose_batch([(req, 4, table)]) == [([1] * 4, None)]
    assert p.take_passes() == draft_passes([(100, 0, 4)]) and p.take_passes() == []
    req.num_tokens, req.num_accepted_drafts = 103, 2  # 2 accepted + the target's token
    p.propose_batch([(req, 4, table)])
    assert p.take_passes() == draft_passes([(1, 102, 4)])
    req.num_tokens, req.num_accepted_drafts = 108, 6  # all 4 accepted + the bonus token
    p.propose_batch([(req, 3, table)])
    assert p.take_passes() == draft_passes([(2, 106, 3)])
    req.num_tokens = 109  # none of 3 accepted
    p.propose_batch([(req, 4, [99] + table[1:])])  # block 0 changed: recomputed after a preemption
    assert p.take_passes() == draft_passes([(109, 0, 4)])
    p.finish("r")
    assert not p.cached


# ---- end to end ---------------------------------------------------------------------------------------

def build_args(tmp_path, *flags: str) -> argparse.Namespace:
    from tokenmill.sim.args import add_simulate_args

    (tmp_path / "l8").mkdir(exist_ok=True)
    (tmp_path / "l1").mkdir(exist_ok=True)
    (tmp_path / "l8" / "config.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "l1" / "config.json").write_text(json.dumps(LLAMA32_1B))
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return p.parse_args(["--model", str(tmp_path / "l8" / "config.json"), "--hardware", "h100",
                         *[f.replace("DRAFT", str(tmp_path / "l1" / "config.json")) for f in flags]])


def simulate(tmp_path, *flags: str):  # noqa: ANN201
    from tokenmill.sim.cli import build

    _, sim, _, _ = build(build_args(tmp_path, *flags))
    rng = np.random.default_rng(3)
    reqs = [SampleRequest("", int(n), int(o)) for n, o in zip(rng.integers(100, 600, 24), rng.integers(20, 160, 24))]
    arrivals = np.cumsum(rng.exponential(2.0, 24)).tolist()  # 0.5 req/s: a batch of one or two
    out = sim.run(reqs, arrivals, seed=0)
    assert [r.completion_tokens for r in out.results] == [q.output_len for q in reqs]  # never past max_tokens
    return calculate_metrics(out.results, out.duration, {}, [50, 99]), out


def test_speculation_lowers_tpot_at_low_load_on_a_bandwidth_bound_gpu(tmp_path):
    off, base = simulate(tmp_path)
    assert base.spec is None and all(len(r.itl_s) == r.completion_tokens - 1 for r in base.results)
    ngram, out = simulate(tmp_path, "--speculative-method", "ngram", "--num-speculative-tokens", "4",
                          "--speculative-acceptance-rate", "0.8")
    # about 3.36 tokens a step for about the time of one
    assert ngram["mean_tpot_ms"] < 0.4 * off["mean_tpot_ms"]
    assert out.spec["spec_mean_acceptance_length"] == pytest.approx(expected_tokens_per_step(0.8, 4), abs=0.1)
    assert out.spec["spec_acceptance_rate_per_pos"][0] == pytest.approx(0.8, abs=0.03)
    # the scheduler ran the drafts: 1 + 4 tokens per decoding request, fewer only near max_tokens
    sizes = [n for s in out.steps if not s.prefill_tokens for _, n in s.scheduled]
    assert max(sizes) == 5 and sizes.count(5) > 0.8 * len(sizes)
    assert sum(s.num_draft_tokens for s in out.steps) == out.spec["spec_num_draft_tokens"]
    # one streamed chunk a step: fewer chunks than tokens, and the ITL is the step time, not 0
    assert sum(len(r.itl_s) for r in out.results) < 0.5 * sum(r.completion_tokens - 1 for r in out.results)
    assert ngram["median_itl_ms"] == pytest.approx(off["median_itl_ms"], rel=0.01)
    assert ngram["output_throughput"] == pytest.approx(off["output_throughput"], rel=0.05)  # arrival-bound

    draft, out = simulate(tmp_path, "--speculative-model", "DRAFT", "--num-speculative-tokens", "4",
                          "--spec-acceptance-rate", "0.8")
    assert draft["mean_tpot_ms"] < 0.7 * off["mean_tpot_ms"]
    assert draft["mean_tpot_ms"] > ngram["mean_tpot_ms"]  # the drafter's passes cost
    assert sum(s.draft_s for s in out.steps) > 0.2 * sum(s.duration for s in out.steps)


def test_nothing_accepted_costs_verification_and_drafting(tmp_path):
    off, _ = simulate(tmp_path)
    draft, out = simulate(tmp_path, "--speculative-model", "DRAFT", "--num-speculative-tokens", "4",
                          "--spec-acceptance-rate", "0")
    assert out.spec["spec_num_accepted_tokens"] == 0 and out.spec["spec_num_draft_tokens"] > 0
    assert draft["mean_tpot_ms"] > 1.01 * off["mean_tpot_ms"]  # the drafter's passes, for nothing
    # n-gram drafts cost only their verification: on a bandwidth-bound step nearly nothing, and the off
    # rule turns them off (one probe draft every 8 steps)
    ngram, out = simulate(tmp_path, "--speculative-method", "ngram", "--spec-acceptance-rate", "0")
    assert off["mean_tpot_ms"] < ngram["mean_tpot_ms"] < 1.01 * off["mean_tpot_ms"]
    drafted = [s for s in out.steps if s.num_draft_tokens]
    assert 0 < len(drafted) < 0.5 * sum(1 for s in out.steps if s.decode_tokens)


def test_a_calibrated_profile_prices_the_drafter_by_weight_bytes(tmp_path):
    from tokenmill.sim.cli import build

    profile = CalibratedCost([0.004, 2e-4, 1e-3, 1e-4, 1e-5, 1e-4], {"kv_bytes_per_token": 1000.0,
                                                                      "kv_cache_bytes": 2**30})
    profile.save(tmp_path / "p.json")
    a = build_args(tmp_path, "--speculative-model", "DRAFT", "--weight-dtype", "fp32",
                   "--speculative-weight-dtype", "int8")
    a.hardware, a.profile = None, str(tmp_path / "p.json")
    cost, sim, what, kv_token = build(a)
    ratio = 1_235_746_816 * 1 / (7_504_658_432 * 4)
    assert f"draft passes at {ratio:.3g} x its steps" in what
    shape = verify_shape(4, 700, 0)
    assert sim.spec.drafter(shape) == pytest.approx(ratio * cost(shape))
    # the verify step: decode tokens x (1 + k), the decoding requests' contexts, the drafts' attention
    v = verify_shape(4, 700, 3)
    assert cost(v) == pytest.approx(0.004 + 1e-3 * 16 + 1e-4 * 4 * 701 / 1e3 + 1e-5 * 4 * (3 * 700 + 2 + 3 + 4) / 1e3
                                    + 1e-4 * 16)
    # the drafter's KV rides on the target's blocks (8 KV heads x 64 over 8 x 128, half the layers)
    assert kv_token == pytest.approx(1000 * (1 + 0.25))
    assert sim.num_blocks == 2**30 // (1250 * 16)


def test_cli_flags_are_serves_and_bad_ones_are_refused(tmp_path, capsys):
    from tokenmill.cli import main
    from tokenmill.engine.arg_utils import add_engine_args
    from tokenmill.sim.args import add_simulate_args

    serve, sim = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_engine_args(serve)
    add_simulate_args(sim)
    defs = lambda p: {a.dest: (a.option_strings, a.choices, a.default, a.type, a.help)  # noqa: E731
                      for a in p._actions if a.dest in ("speculative_method", "speculative_model",
                                                        "num_speculative_tokens")}
    assert defs(sim) == defs(serve) and len(defs(sim)) == 3

    build_args(tmp_path)
    base = ["simulate", "--model", str(tmp_path / "l8" / "config.json"), "--hardware", "h100", "--dataset", "random",
            "--num-prompts", "8", "--input-len", "256", "--output-len", "64", "--tokenizer", "smollm2-135m-instruct",
            "--request-rate", "0.5", "--duration", "10"]
    draft = f"--speculative-method draft --speculative-model {tmp_path / 'l1' / 'config.json'}"
    assert main(base + ["--speculative-method", "ngram", "--compare", draft]) == 0
    text = capsys.readouterr().out
    assert text.count("speculative decoding:") == 2 and "speculative ngram, up to 3 drafts, acceptance 0.8" in text
    for bad, why in ((["--speculative-method", "ngram", "--spec-acceptance-rate", "1.5"], "[0, 1]"),
                     (["--spec-acceptance-rate", "0.7"], "needs speculative decoding"),
                     (["--speculative-method", "draft"], "--speculative-model"),
                     (["--speculative-model", "smollm2-135m-instruct"], "vocabulary"),
                     (["--speculative-method", "ngram", "--speculative-weight-dtype", "fp6"], "fp6")):
        assert main(base + bad) == 2
        assert why in capsys.readouterr().err
