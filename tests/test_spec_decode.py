"""Speculative decoding: the n-gram drafter, the acceptance rule (the target's distribution exactly), and
the engine with speculation on giving the very outputs it gives with it off."""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.rejection import verify_drafts

DEFAULT = "smollm2-135m-instruct"


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(3, 2, 4)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], 10) == [5, 7, 1]  # latest "1 2 3", longest n
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], 2) == [5, 7]  # capped by the room left
    assert p.propose([5, 6, 7, 8], 10) == []  # nothing recurs
    assert p.propose([4, 4, 4], 10) == [4, 4, 4]  # a loop: the copy reads on into itself
    assert p.propose([7, 1, 2, 1, 2], 10) == [1, 2, 1]
    assert NgramProposer(3, 3, 3).propose([1, 2, 9, 1, 2], 10) == []  # shorter than prompt_lookup_min


def test_greedy_acceptance_takes_drafts_while_they_are_the_argmax():
    greedy = torch.tensor([5, 6, 7, 8])
    assert verify_drafts(None, greedy, [5, 6, 7], True, None) == [5, 6, 7, 8]  # all + bonus
    assert verify_drafts(None, greedy, [5, 1, 7], True, None) == [5, 6]  # the argmax at the miss
    assert verify_drafts(None, greedy[:1], [], True, None) == [5]


CHI2_CRITICAL_DF5_P001 = 20.515  # chi-square, 5 degrees of freedom, significance 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_drafts_sampled_from_q_are_accepted_by_p_over_q():
    """Drafts drawn from a drafter's distribution q (not p), accepted with min(1, p/q) and resampled from
    max(0, p - q): the emitted token follows p, and more drafts are accepted than by the point-draft rule
    (accept with p(x), also exact for any drafts); resampling from p itself after a rejection is caught."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.3, 0.2, 0.3, 0.05, 0.05, 0.1])
    probs = torch.stack([p, p])

    def wrong(probs, greedy_tokens, drafts, greedy, gen, q):  # min(1, p/q), then p instead of the residual
        x = drafts[0]
        if torch.rand((), generator=gen) * q[0, x] < probs[0, x]:
            return [x]
        return [int(torch.multinomial(probs[0], 1, generator=gen))]

    def counts(rule, q_for_rule):
        gen = torch.Generator().manual_seed(5)
        out, accepted = torch.zeros(len(p)), 0
        for _ in range(6000):
            x = int(torch.multinomial(q, 1, generator=gen))
            emitted = rule(probs, probs.argmax(-1), [x], False, gen, q_for_rule)
            out[emitted[0]] += 1
            accepted += len(emitted) - 1
        return out, accepted

    with_q, accepted_q = counts(verify_drafts, q[None])
    point, accepted_point = counts(verify_drafts, None)
    assert chi_square(with_q, p) < CHI2_CRITICAL_DF5_P001
    assert chi_square(point, p) < CHI2_CRITICAL_DF5_P001
    assert accepted_q > 1.5 * accepted_point  # sum min(p, q) = 0.85 against sum q p = 0.25
    assert chi_square(counts(wrong, q[None])[0], p) > CHI2_CRITICAL_DF5_P001


def first_token_counts(rule, p: torch.Tensor, draft: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.stack([p, p])  # the draft position and the one after
    counts = torch.zeros(len(p))
    for _ in range(n):
        counts[rule(probs, probs.argmax(-1), [draft], False, gen)[0]] += 1
    return counts


def wrong_rule(probs, greedy_tokens, drafts, greedy, gen):
    """Accepts like the right rule but resamples from p itself (draft included) after a rejection."""
    x = drafts[0]
    if torch.rand((), generator=gen) < probs[0, x]:
        return [x]
    return [int(torch.multinomial(probs[0], 1, generator=gen))]


@pytest.mark.parametrize("draft", [0, 3])  # the likeliest token, and an unlikely one
def test_accepted_or_resampled_tokens_follow_the_target_distribution(draft):
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    counts = first_token_counts(verify_drafts, p, draft, 6000, seed=draft)
    assert chi_square(counts, p) < CHI2_CRITICAL_DF5_P001
    # negative control: a rule that keeps the draft in the resampling distribution is caught
    wrong = first_token_counts(wrong_rule, p, draft, 6000, seed=draft)
    assert chi_square(wrong, p) > CHI2_CRITICAL_DF5_P001


@pytest.mark.parametrize("kw,match", [
    (dict(speculative_method="ngram", num_speculative_tokens=0), "--num-speculative-tokens"),
    (dict(speculative_method="ngram", num_speculative_tokens=-2), "--num-speculative-tokens"),
    (dict(speculative_method="draft"), "--speculative-model"),
    (dict(speculative_method="ngram", speculative_model="smollm2-135m-instruct"), "--speculative-model"),
    (dict(speculative_model="smollm2-135m-instruct", speculative_quantization="int3"), "--speculative-quantization"),
    (dict(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "--prompt-lookup-min"),
])
def test_bad_speculative_flags_are_refused_naming_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kw)


# ---- the real model ------------------------------------------------------------------------------

REPEAT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings "
          "and arrows of outrageous fortune, or to take arms against a sea of troubles")
PROMPTS = [f"Copy this line three times.\n{REPEAT}\n{REPEAT}\n", "def add(a, b):\n    return a + b\n\ndef add(",
           "one two three four one two three four one two", "The capital of France is"]


@pytest.fixture(scope="module")
def spec_llm():
    from tokenmill import LLM

    return LLM(kv_cache_memory="128MiB", max_model_len=2048, speculative_method="ngram", num_speculative_tokens=4)


def outputs(llm, prompts, sp):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.slow
def test_greedy_outputs_are_the_same_bits_with_speculation(llm_default, spec_llm):
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    ref = [outputs(llm_default, [p], sp)[0] for p in PROMPTS]
    assert [outputs(spec_llm, [p], sp)[0] for p in PROMPTS] == ref  # alone
    assert outputs(spec_llm, PROMPTS, sp) == ref  # batched


@pytest.mark.slow
def test_speculation_drafts_and_accepts_on_repeating_text(spec_llm):
    engine = spec_llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    req = engine.scheduler.requests[rid]
    while engine.has_unfinished_requests():
        engine.step()
    assert req.num_drafts > 0 and req.num_accepted_drafts > 0
    assert req.num_output_tokens == 48  # max_tokens lands exactly, inside accepted runs or not


@pytest.mark.slow
def test_stops_and_limits_inside_accepted_runs(llm_default, spec_llm):
    """A stop string or token that lands inside an accepted run ends the output where it would without
    speculation; max_tokens likewise."""
    for sp in (SamplingParams(max_tokens=60, temperature=0, stop=["arrows"]),
               SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
               SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[1004], ignore_eos=True)):
        assert outputs(spec_llm, PROMPTS[:1], sp) == outputs(llm_default, PROMPTS[:1], sp), sp


@pytest.mark.slow
def test_seeded_sampling_with_speculation_repeats_run_to_run(spec_llm):
    sp = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    assert outputs(spec_llm, PROMPTS, sp) == outputs(spec_llm, PROMPTS, sp)


@pytest.mark.slow
def test_speculation_through_preemption_and_prefix_hits(llm_default):
    """A pool too small for every request: preempted (recomputed) requests and prefix-cache hits with
    drafts in flight still give the greedy outputs of the default engine."""
    from tokenmill import LLM

    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    prompts = PROMPTS + [PROMPTS[0] + "Again:"]
    ref = [outputs(llm_default, [p], sp)[0] for p in prompts]
    small = LLM(kv_cache_memory=str(14 * 16 * llm_default.engine.kv_bytes_per_token), max_model_len=2048,
                speculative_method="ngram", num_speculative_tokens=4)
    assert outputs(small, prompts, sp) == ref
    assert small.engine.num_preemptions > 0 and small.engine.kv_cache.stats.hits > 0
    small.engine.kv_cache.check_invariants()
    assert small.engine.kv_cache.num_free_blocks == small.engine.kv_cache.num_blocks


def test_the_off_rule_drafts_only_what_pays():
    from tokenmill.core.draft_policy import PROBE_EVERY, constant_cost, worthwhile_drafts

    assert worthwhile_drafts(1.0, 0, limit=5) == 5  # every draft accepted: as many as allowed
    assert worthwhile_drafts(0.8, 0) == 2  # 2.44 tokens in 2 steps' time beats 1.8 in 1.5 and 2.95 in 2.5
    assert worthwhile_drafts(0.3, 0) == 0  # 1.3 tokens in 1.5 steps' time: worse than decoding
    assert worthwhile_drafts(0.3, PROBE_EVERY) == 1  # a probe, to notice repetition coming back
    assert worthwhile_drafts(0.9, 0, cost=constant_cost(0.25)) == 6  # cheap drafts: more of them
    assert worthwhile_drafts(1.0, PROBE_EVERY, cost=constant_cost(1.2)) == 0  # dearer than a step: never


def test_the_draft_cost_follows_measured_step_times_and_the_batch():
    from tokenmill.core.draft_policy import DraftCostModel, worthwhile_drafts

    target = {1: 10.0, 4: 12.0, 16: 40.0, 64: 160.0}  # memory-bound to 4 tokens, then compute-bound
    model = DraftCostModel(target, None, 3)
    assert model(1)(3) == pytest.approx((12 - 10) / 10)  # alone, drafts are nearly free
    assert model(1)(1) == pytest.approx((10 + 2 / 3 - 10) / 10)
    assert model(16)(3) == pytest.approx((160 - 40) / 40)  # at 16 requests each draft costs a full token
    assert model(32)(3) == pytest.approx(3.0)  # past the largest size: the last slope
    assert worthwhile_drafts(0.9, 0, 3, model(1)) == 3 and worthwhile_drafts(0.9, 0, 3, model(16)) == 0
    with_drafter = DraftCostModel(target, {1: 2.5, 4: 3.0, 16: 10.0, 64: 40.0}, 3)
    assert with_drafter(1)(3) == pytest.approx(0.2 + 3 * 0.25)  # plus a drafter pass per draft


@pytest.mark.slow
def test_a_drafter_that_is_always_wrong_is_soon_switched_off(spec_llm, llm_default):
    class Wrong(NgramProposer):
        def propose(self, token_ids, max_tokens):
            return [0] * min(4, max_tokens)  # token 0 is never the model's choice here

    sched, core = spec_llm.engine.scheduler, spec_llm.engine.core
    saved, core.proposer = core.proposer, Wrong(4, 2, 4)
    try:
        engine = spec_llm.engine
        sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        rid = engine.add_request(PROMPTS[3], sp)
        req = sched.requests[rid]
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        core.proposer = saved
    assert req.num_accepted_drafts == 0
    assert req.num_drafts <= 4 + 64 // 8  # the first step's drafts, then one probe every 8 steps at most
    assert req.output_token_ids == llm_default.generate([PROMPTS[3]], sp, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
def test_spec_decode_counters_on_metrics(spec_llm):
    import json

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.app import ServerConfig, build_app
    from tokenmill.server.run import BackgroundServer

    ae = AsyncEngine(spec_llm.engine, max_waiting_requests=8, log_interval=None)
    srv = BackgroundServer(build_app(ae, ServerConfig())).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": PROMPTS[0],
                                                          "max_tokens": 48, "temperature": 0}, timeout=120)
        assert r.status_code == 200
        # streamed, an accepted run arrives as one chunk: fewer text chunks than tokens
        body = {"model": "smollm2-135m-instruct", "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        chunks, usage = 0, None
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    chunks += any(c.get("text") for c in event.get("choices", []))
                    usage = event.get("usage") or usage
        assert usage["completion_tokens"] == 48 and 0 < chunks < 48
        text = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop(60)
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:spec_decode"):
                samples[(s.name, s.labels.get("position"))] = s.value
    drafts = samples[("vllm:spec_decode_num_drafts_total", None)]
    draft_tokens = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    per_pos = [v for (name, pos), v in samples.items() if name.endswith("per_pos_total")]
    assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens and sum(per_pos) == accepted


@pytest.mark.slow
def test_sampled_tokens_with_speculation_carry_the_targets_logprobs(spec_llm, llm_default):
    """Seeded sampling with drafts in flight: every emitted token's logprob is the target's at its own
    position (score() over the same text gives the same bits), so each verification read the right row;
    and some drafts were accepted while sampling."""
    sp = SamplingParams(max_tokens=40, temperature=0.7, top_k=20, seed=3, ignore_eos=True, logprobs=0)
    engine = spec_llm.engine
    ids = spec_llm.tokenizer.encode(PROMPTS[0])
    rid = engine.add_request(ids, sp)
    req = engine.scheduler.requests[rid]
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    out = outs[0].outputs[0]
    assert req.num_accepted_drafts > 0
    scored = llm_default.engine.score(ids + out.token_ids)[len(ids) - 1:]
    assert scored.tolist() == [lp[t] for t, lp in zip(out.token_ids, out.logprobs)]


@pytest.mark.slow
def test_n_completions_with_speculation_equal_those_without(llm_default, spec_llm):
    sampled = spec_llm.generate(PROMPTS[:1], SamplingParams(n=3, max_tokens=24, temperature=0.9, seed=7,
                                                            ignore_eos=True), use_tqdm=False)[0]
    assert len(sampled.outputs) == 3 and all(len(o.token_ids) == 24 for o in sampled.outputs)
    greedy = SamplingParams(n=2, max_tokens=24, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in spec_llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs] == \
           [o.token_ids for o in llm_default.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs]


def test_acceptance_summary():
    from tokenmill.core.sched_output import ScheduledRequest
    from tokenmill.spec_decode.stats import step_acceptance, summarize

    sched = [ScheduledRequest("a", [5, 1, 2, 3], 10, [0], True, 3), ScheduledRequest("b", [7], 4, [1], True),
             ScheduledRequest("c", [9, 9], 8, [2], True, 1)]
    step = step_acceptance(sched, {"a": [1, 2, 8], "b": [3], "c": [4]}, k=3)  # a: 2 of 3 accepted, c: 0 of 1
    assert (step.num_drafts, step.num_draft_tokens, step.accepted_per_pos) == (2, 4, [1, 1, 0])
    s = summarize([step, step])
    assert s["spec_acceptance_rate"] == 0.5 and s["spec_mean_acceptance_length"] == 2.0
    assert s["spec_acceptance_rate_per_pos"] == [0.5, 0.5, 0.0]


@pytest.mark.slow
def test_greedy_identity_over_random_batches_and_budgets(llm_default, spec_llm):
    """The default-mode invariance property, speculation on: random compositions, token budgets (drafts
    compete with prefill chunks for them) and staggered arrivals give each prompt's greedy tokens and
    logprobs alone without speculation."""
    import random

    from test_default_mode import WORDS, run

    rng = random.Random(5)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(4)]
    texts.append(PROMPTS[0])  # one that drafts a lot
    alone = {t: run(llm_default, [t])[0] for t in texts}
    for _ in range(4):
        batch = rng.sample(texts, rng.randint(2, len(texts)))
        got = run(spec_llm, batch, budget=rng.choice([3, 16, 37, 256]), stagger=rng.randint(0, 3))
        assert got == [alone[t] for t in batch]


# ---- the draft-model drafter ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_llm():
    """The lossless pair: float weights as the target, the same file's own blocks as the drafter."""
    from tokenmill import LLM

    return LLM(DEFAULT, dtype="float32", quantization="none", kv_cache_memory="256MiB", max_model_len=2048,
               speculative_model=DEFAULT, num_speculative_tokens=5)


@pytest.mark.slow
def test_draft_model_keeps_the_float_targets_greedy_bits(llm_fp32, draft_llm):
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    ref = [outputs(llm_fp32, [p], sp)[0] for p in PROMPTS]
    draft_llm.engine.step_stats.clear()
    assert [outputs(draft_llm, [p], sp)[0] for p in PROMPTS] == ref  # alone
    assert outputs(draft_llm, PROMPTS, sp) == ref  # batched
    from tokenmill.spec_decode.stats import summarize

    spec = summarize([s.spec for s in draft_llm.engine.step_stats if s.spec is not None])
    assert spec["spec_acceptance_rate"] > 0.8, spec  # the quantized copy agrees with the float model
    kv = draft_llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not draft_llm.engine.core.proposer.cached


@pytest.mark.slow
def test_draft_model_through_preemption_prefix_hits_stops_and_seeds(llm_fp32, draft_llm):
    from tokenmill import LLM

    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    prompts = PROMPTS + [PROMPTS[0] + "Again:"]
    ref = [outputs(llm_fp32, [p], sp)[0] for p in prompts]
    # the pool holds target and drafter KV per block: 14 blocks' worth of both
    small = LLM(DEFAULT, dtype="float32", quantization="none", max_model_len=2048, speculative_model=DEFAULT,
                num_speculative_tokens=4, kv_cache_memory=str(14 * 16 * draft_llm.engine.kv_bytes_per_token))
    assert small.engine.kv_bytes_per_token == 2 * llm_fp32.engine.kv_bytes_per_token
    assert outputs(small, prompts, sp) == ref
    assert small.engine.num_preemptions > 0 and small.engine.kv_cache.stats.hits > 0
    assert small.engine.kv_cache.num_free_blocks == small.engine.kv_cache.num_blocks
    stop = SamplingParams(max_tokens=60, temperature=0, stop=["arrows"])
    assert outputs(draft_llm, PROMPTS[:1], stop) == outputs(llm_fp32, PROMPTS[:1], stop)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True, n=2)
    first = [[c.token_ids for c in o.outputs] for o in draft_llm.generate(PROMPTS, seeded, use_tqdm=False)]
    assert first == [[c.token_ids for c in o.outputs] for o in draft_llm.generate(PROMPTS, seeded, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Two tiny random models on one tokenizer: the target and a drafter that disagrees with it."""
    from tiny_models import random_hf_model, save_hf_folder

    root = tmp_path_factory.mktemp("spec")
    target = random_hf_model(seed=0, embed_std=0.3)
    save_hf_folder(target, root / "target")
    save_hf_folder(random_hf_model(seed=1, embed_std=0.3), root / "drafter")
    return target, root / "target", root / "drafter"


def chi2_critical_p001(df: int) -> float:
    """The chi-square quantile at 0.999 (Wilson-Hilferty; within 1% for df >= 3)."""
    h = 2 / (9 * df)
    return df * (1 - h + 3.0902 * h ** 0.5) ** 3


def _top_k_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    keep = logits >= logits.topk(k).values[-1]
    return torch.where(keep, logits, torch.tensor(float("-inf"))).softmax(-1).double()


@pytest.mark.slow
def test_sampled_outputs_with_a_draft_model_follow_the_target_distribution(tiny_pair, monkeypatch):
    """Engine level: seeded samples of the 2nd and 3rd tokens (drafted by a model that disagrees with the
    target, verified in the batch) against their exact marginals under the target alone, by chi-square;
    a verifier that accepts every sampled draft is caught."""
    from tiny_models import hf_logits

    from tokenmill import LLM

    target, target_dir, drafter_dir = tiny_pair
    prompt, K, N = [5, 77, 140, 9], 6, 1500
    # exact: P(t2) and P(t3) summed over the paths before them, with top-k K at temperature 1
    p1 = _top_k_probs(hf_logits(target, prompt)[-1], K)
    p2, p3 = torch.zeros_like(p1), torch.zeros_like(p1)
    for a in p1.nonzero().flatten().tolist():
        pa = _top_k_probs(hf_logits(target, prompt + [a])[-1], K)
        p2 += p1[a] * pa
        for b in pa.nonzero().flatten().tolist():
            p3 += p1[a] * pa[b] * _top_k_probs(hf_logits(target, prompt + [a, b])[-1], K)
    llm = LLM(str(target_dir), speculative_model=str(drafter_dir), num_speculative_tokens=2,
              kv_cache_memory="16MiB", max_num_seqs=64)
    llm.engine.core.proposer.draft_cost = lambda batch: (lambda d: 0.0)  # always draft

    def sample_counts():
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=K, seed=i, ignore_eos=True) for i in range(N)]
        outs = llm.generate([prompt] * N, params, use_tqdm=False)
        c2, c3 = torch.zeros_like(p1), torch.zeros_like(p1)
        for o in outs:
            t = o.outputs[0].token_ids
            c2[t[1]] += 1
            c3[t[2]] += 1
        return c2, c3

    def chi2(counts, probs):  # cells expected under 5 pooled into one
        expected = probs * counts.sum()
        big = expected >= 5
        e = torch.cat([expected[big], expected[~big].sum()[None]])
        c = torch.cat([counts[big], counts[~big].sum()[None]])
        keep = e > 0
        if c[~keep].sum() > 0:  # a token the target can never emit
            return float("inf"), int(keep.sum()) - 1
        return float(((c[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1

    c2, c3 = sample_counts()
    drafted = sum(s.spec.num_draft_tokens for s in llm.engine.step_stats if s.spec is not None)
    assert drafted >= N  # every request's second step carried a draft
    for counts, probs in ((c2, p2), (c3, p3)):
        stat, df = chi2(counts, probs)
        assert stat < chi2_critical_p001(df), (stat, df)

    import tokenmill.worker.model_runner as mr

    real = mr.verify_drafts
    def accept_all(probs, greedy_tokens, drafts, greedy, gen, q=None):  # the wrong rule: t2 follows the drafter
        d = len(drafts)
        return list(drafts) + real(probs[d:], greedy_tokens[d:], [], greedy, gen)

    monkeypatch.setattr(mr, "verify_drafts", accept_all)
    c2, _ = sample_counts()
    stat, df = chi2(c2, p2)
    assert stat > chi2_critical_p001(df), (stat, df)


def test_a_draft_model_must_share_the_targets_vocabulary_and_fit_its_context(tiny_pair):
    from tokenmill import LLM

    _, target_dir, drafter_dir = tiny_pair
    with pytest.raises(ValueError, match="different vocabulary"):
        LLM(str(target_dir), speculative_model=DEFAULT, kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        LLM(str(target_dir), speculative_model=str(drafter_dir), num_speculative_tokens=300, kv_cache_memory="16MiB")
