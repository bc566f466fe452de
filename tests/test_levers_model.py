"""Scheduler levers on the real default model: prefix caching, chunked prefill and the priority
policy each give exactly the greedy outputs of the plain engine (``llm_fp32``: no caching, no
chunking, FCFS), while a small KV pool forces evictions and preemptions."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.models.registry import DEFAULT_MODEL

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for a public library. Answer in one or two short sentences. "
    "The library opens at nine in the morning and closes at eight in the evening on weekdays; on "
    "Saturdays it closes at five and on Sundays it is closed. Members may borrow up to twelve books "
    "for three weeks, renew twice online, and reserve titles that are on loan. Late returns cost "
    "twenty cents a day per book. The reading room on the second floor is silent; group study rooms "
    "on the third floor can be booked for two hours at a time. Printing costs ten cents a page. "
)
QUESTIONS = ["When does the library open?", "How many books can I borrow?", "Is it open on Sunday?",
             "What does printing cost?", "Where can a group study?", "What is the fine for late books?"]
GREEDY = SamplingParams(temperature=0, max_tokens=40)
POOL_BLOCKS = 16  # 4 requests of ~12 blocks share a ~8-block prefix: preemption and eviction must happen


@pytest.fixture(scope="module")
def lever_llm(llm_fp32):
    block_bytes = llm_fp32.engine.kv_bytes_per_token * 16
    return LLM(DEFAULT_MODEL, dtype="float32", quantization="none", kv_cache_memory=str(POOL_BLOCKS * block_bytes), max_model_len=2048,
               max_num_seqs=4, max_num_batched_tokens=48, enable_chunked_prefill=True, enable_prefix_caching=True,
               scheduling_policy="priority", starvation_timeout=4.0)


@pytest.fixture()
def lever(lever_llm):
    yield lever_llm
    e = lever_llm.engine
    assert not e.has_unfinished_requests()
    e.kv_cache.check_invariants()
    assert e.kv_cache.num_free_blocks == e.kv_cache.num_blocks, "KV blocks leaked"


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prefix_caching_same_outputs_through_eviction_and_preemption(llm, lever):
    prompts = [SYSTEM + q for q in QUESTIONS]
    want = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    kv = lever.engine.kv_cache
    hits0, evict0, pre0 = kv.stats.hits, kv.pool.num_evictions, lever.engine.num_preemptions
    got = tokens(lever.generate(prompts, GREEDY, use_tqdm=False))
    assert got == want
    assert kv.stats.hits > hits0, "no prefix hit"
    assert kv.pool.num_evictions > evict0, "the pool never had to evict a cached block"
    assert lever.engine.num_preemptions > pre0, "nothing was preempted"
    # a second round finds the shared prefix again
    hits1 = kv.stats.hits
    again = lever.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert tokens(again) == want[:1]
    assert kv.stats.hits - hits1 >= len(lever.tokenizer.encode(SYSTEM)) // 16 * 16 - 16


def test_chunked_prefill_same_outputs_and_really_chunks(llm, lever):
    long_prompt = SYSTEM + "Summarise the rules."  # ~140 tokens: several 48-token chunks
    prompts = ["The capital of France is", "def add(a, b):", long_prompt]  # short ones decode meanwhile
    want = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    lever.engine.kv_cache.pool.cached.clear()  # cold cache: the whole prompt is computed in chunks
    lever.engine.kv_cache.pool.block_hash = [None] * lever.engine.kv_cache.num_blocks
    n0 = len(lever.engine.step_stats)
    outs = lever.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == want
    steps = list(lever.engine.step_stats)[n0:]
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) <= 48
    assert sum(1 for s in steps if s.num_prefill_tokens and s.num_decode_tokens) > 0, \
        "no step mixed prefill chunks with decodes"
    m = outs[2].metrics[0]
    prefill_steps = [s for s in steps if s.start_time < m.first_token_time and s.start_time + s.duration >= m.first_scheduled_time]
    assert len(prefill_steps) >= 3, "the long prompt was not split across steps"


def test_priority_runs_urgent_requests_first(lever):
    e = lever.engine
    ids = {}
    for i, prio in enumerate([3, 3, 0, 2, 0, 1, 5, 0]):
        ids[e.add_request(f"Item {i}:", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                          priority=prio)] = prio
    first_scheduled = {}
    while e.has_unfinished_requests():
        e.step()
        for r in e.scheduler.running:
            first_scheduled.setdefault(r.request_id, r.timings.first_scheduled)
    order = sorted(first_scheduled, key=lambda rid: first_scheduled[rid])
    # the first 4 admitted (max_num_seqs) are the 4 most urgent; the least urgent comes last
    assert sorted(ids[r] for r in order[:4]) == [0, 0, 0, 1]
    (lazy,) = [r for r, p in ids.items() if p == 5]
    assert first_scheduled[lazy] == max(first_scheduled.values())  # admitted in the last admission step


def test_low_priority_request_finishes_under_a_steady_urgent_stream(lever):
    e = lever.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for n in range(8):  # every slot busy and a queue before the low-priority request arrives
        e.add_request(f"Early {n}:", params, priority=0)
    e.step()
    low = e.add_request("A patient request:", params, priority=10)
    low_req = e.scheduler.requests[low]
    try:
        for n in range(1000):  # two urgent arrivals per step: more than 4 slots can serve
            e.add_request(f"Urgent {n}:", params, priority=0)
            e.add_request(f"Urgent {n}b:", params, priority=0)
            e.step()
            if low_req.is_finished:
                break
        assert low_req.is_finished and low_req.promoted
        waited = low_req.timings.first_scheduled - low_req.timings.arrival
        assert waited >= 4.0, "it ran before the starvation bound: the urgent stream did not hold it back"
        assert len(e.scheduler.waiting) > 0, "the urgent stream never queued up"
    finally:
        while e.has_unfinished_requests():
            e.step()
