"""The engine on the real default model: batching, preemption, sampling features, bad input."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MIXED = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "def add(a, b):",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void;",
    "Paris is",
    "Write a short poem about autumn leaves falling from the trees in the park",
]


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def mixed_alone(llm_fp32):
    return [llm_fp32.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in MIXED]


def test_mixed_batch_equals_each_alone(llm, mixed_alone):
    together = llm.generate(MIXED, GREEDY, use_tqdm=False)
    assert texts(together) == mixed_alone


def test_staggered_arrivals_join_running_batch(llm, mixed_alone):
    engine = llm.engine
    ids = {}
    done = {}
    for i, p in enumerate(MIXED):
        ids[engine.add_request(p, GREEDY)] = i
        for out in engine.step():  # one step between arrivals: each joins a running batch
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0].token_ids
    assert [done[i] for i in range(len(MIXED))] == mixed_alone
    # newcomers' prefill tokens shared steps with the running requests' decode tokens
    stats = list(engine.step_stats)[-40:]
    assert sum(1 for s in stats if s.num_prefill_tokens and s.num_decode_tokens) >= len(MIXED) - 1


def test_preemption_gives_same_outputs(llm, mixed_alone):
    # 14 blocks of 16 tokens cannot hold all six requests at once: some must be preempted.
    block_bytes = llm.engine.kv_bytes_per_token * 16
    small = LLM(dtype="float32", quantization="none", kv_cache_memory=str(14 * block_bytes), max_model_len=2048)
    outs = small.generate(MIXED, GREEDY, use_tqdm=False)
    assert small.engine.num_preemptions > 0
    assert sum(m.num_preemptions for o in outs for m in o.metrics) == small.engine.num_preemptions
    assert texts(outs) == mixed_alone
    small.engine.kv_cache.check_invariants()
    assert small.engine.kv_cache.num_free_blocks == small.engine.kv_cache.num_blocks


def test_swap_preemption_gives_same_outputs_without_recompute(llm, mixed_alone, monkeypatch):
    """--preemption-mode swap: a preempted request's KV goes to host memory and comes back, so no
    prompt is computed twice. On the CPU the engine refuses it (pointless); the test lets the same
    code run here."""
    from tokenmill.engine import builder as engine_builder

    block_bytes = llm.engine.kv_bytes_per_token * 16
    kw = dict(dtype="float32", quantization="none", kv_cache_memory=str(14 * block_bytes), max_model_len=2048,
              preemption_mode="swap")
    with pytest.raises(ValueError, match="already in host memory"):
        LLM(**kw)
    monkeypatch.setattr(engine_builder, "SWAP_DEVICES", ("cuda", "cpu"))
    small = LLM(**kw)
    outs = small.generate(MIXED, GREEDY, use_tqdm=False)
    eng = small.engine
    assert eng.num_preemptions > 0
    assert texts(outs) == mixed_alone
    # recompute would prefill the preempted prompts (and outputs so far) again
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert sum(s.num_prefill_tokens for s in eng.step_stats) == prompt_tokens
    assert eng.runner.swapped == {} and eng.scheduler.swapped == set()
    eng.kv_cache.check_invariants()
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks


def test_max_tokens_and_length_finish(llm):
    out = llm.generate("Count: one, two,", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_eos_stops_and_ignore_eos_continues(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.tokenizer.stop_token_ids
    assert "Paris" in short.text
    long = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=len(short.token_ids) + 5, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0]
    assert long.finish_reason == "length" and len(long.token_ids) == len(short.token_ids) + 5


def test_stop_string_truncates_text(llm):
    base = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = base.text[6:10]
    assert stop.strip()
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    incl = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                                   include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert incl.text == base.text[: base.text.index(stop) + len(stop)]


def test_stop_token_ids(llm):
    base = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.stop_reason == stop_id


def test_seeded_sampling_is_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate("Tell me a story", p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["Hello there", "Tell me a story", "Why is the sky blue?"], [others, p, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate("Tell me a story", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99,
                                                               ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_n_completions(llm):
    p = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    out = llm.generate("My favourite colour is", p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) > 1 and all(len(s) == 12 for s in seqs)
    again = llm.generate("My favourite colour is", p, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    assert len(out.metrics) == 3


def test_logprobs(llm):
    out = llm.generate("The sun rises in the", SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())
        assert lp[tok] == pytest.approx(max(lp.values()))  # greedy picks the most likely token
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)))


def test_repetition_penalty_reduces_repeats(llm):
    prompt = "one one one one one one one"

    def repeats(params):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        seen, n = set(out.prompt_token_ids), 0
        for t in out.outputs[0].token_ids:
            n += t in seen
            seen.add(t)
        return n

    plain = repeats(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    penalized = repeats(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0))
    assert plain >= 4 and penalized < plain / 2


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    via_chat = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    templated = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    via_generate = llm.generate(templated, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
                                add_special_tokens=False)[0]
    assert via_chat.prompt_token_ids == via_generate.prompt_token_ids
    assert via_chat.outputs[0].token_ids == via_generate.outputs[0].token_ids
    assert "<|im_start|>assistant" in templated


def test_timings_recorded(llm):
    out = llm.generate("Timing test", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics[0]
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 8 and m.token_times == sorted(m.token_times)
    assert m.ttft > 0 and m.tpot > 0 and len(m.itls) == 7
    s = llm.engine.step_stats[-1]
    assert s.duration > 0 and s.num_decode_tokens == 1


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "at least one prompt"),
        ([10**9], SamplingParams(), "outside the vocabulary"),
        ("x " * 3000, SamplingParams(max_tokens=16), "context length"),
        ("hello", SamplingParams(max_tokens=2048), "context length"),
    ],
)
def test_bad_requests_are_rejected_cleanly(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    # the engine still serves
    assert llm.generate("ok", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 5.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logprobs": 100}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}="):
        SamplingParams(**kwargs)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rid = engine.add_request("A long story begins here", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks
    out = engine.abort_request(rid)
    assert out.outputs[0].finish_reason == "abort"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.has_unfinished_requests()
