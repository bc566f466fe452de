"""Scheduler levers without a model: prefix caching, the priority policy and its starvation
guard, preemption order. The real Scheduler and KVCacheManager, driven by the checking fake
runner of test_kv_cache (it verifies every slot's KV content, so a wrong prefix hit fails)."""

from __future__ import annotations

import pytest
from test_kv_cache import EOS, CheckingRunner, model_token

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request, RequestStatus, RequestTimings
from tokenmill.sampling_params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, chunked=False, prefix=False, policy="fcfs",
         starvation_timeout=None, max_model_len=256):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    cfg = SchedulerConfig(max_num_seqs, budget, chunked, policy=policy, starvation_timeout=starvation_timeout)
    sched = Scheduler(cfg, kv, max_model_len)
    sched.clock = FakeClock()
    return sched, CheckingRunner(sched)


def req(rid, prompt, max_tokens=4, priority=0, arrival=None):
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset({EOS}),
                max_tokens, priority, timings=RequestTimings(arrival=arrival or 1000.0))
    return r


def step(sched, runner):
    out = sched.schedule()
    finished = sched.update_from_output(out, runner.execute(out))
    sched.kv_cache.check_invariants()
    return out, finished


def run_all(sched, runner, max_steps=1000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched, runner)
    raise AssertionError("did not finish")


# ---- prefix caching --------------------------------------------------------------------


SYSTEM = list(range(100, 132))  # 32 shared tokens = 8 blocks of 4


def test_second_request_starts_after_the_cached_prefix():
    sched, runner = make(prefix=True)
    sched.add_request(req("a", SYSTEM + [1, 2, 3]))
    run_all(sched, runner)
    sched.add_request(req("b", SYSTEM + [7, 8]))
    out, _ = step(sched, runner)
    (s,) = out.scheduled
    assert s.start_pos == 32 and s.token_ids == [7, 8]  # 8 blocks hit, only the question computed
    assert out.num_prefill_tokens == 2
    st = sched.kv_cache.stats
    assert st.requests == 2 and st.queries == 35 + 34 and st.hits == 32
    run_all(sched, runner)
    assert sched.requests == {} and runner.hits == 1


def test_identical_prompt_recomputes_its_last_token():
    sched, runner = make(prefix=True)
    sched.add_request(req("a", SYSTEM))
    run_all(sched, runner)
    sched.add_request(req("b", SYSTEM))
    out, _ = step(sched, runner)
    (s,) = out.scheduled
    # 32 tokens = 8 full blocks, all cached; 7 are taken so the last block's tokens give fresh logits
    assert s.start_pos == 28 and len(s.token_ids) == 4 and s.needs_logits
    run_all(sched, runner)


def test_same_outputs_with_caching_on_and_off_through_preemption_and_eviction():
    """A tiny pool: prefixes are evicted and requests preempted; every KV read is checked by the
    runner, and the sampled tokens (a function of the request) are the same either way."""
    results = {}
    for prefix in (False, True):
        sched, runner = make(num_blocks=14, block_size=4, max_num_seqs=4, budget=16, chunked=True, prefix=prefix)
        reqs = [req(f"r{i}", SYSTEM[: 8 + 4 * (i % 4)] + [i, i + 1, i + 2], max_tokens=10) for i in range(12)]
        for r in reqs:
            sched.add_request(r)
        run_all(sched, runner)
        assert all(r.output_token_ids == [model_token(r.request_id, j) for j in range(10)] for r in reqs)
        assert sched.kv_cache.num_free_blocks == 14
        results[prefix] = ([r.output_token_ids for r in reqs], sched.num_preemptions, runner.hits,
                           sched.kv_cache.pool.num_evictions)
    assert results[False][0] == results[True][0]
    assert results[True][1] > 0, "the pool is too big: nothing was preempted"
    assert results[True][2] > 0 and results[True][3] > 0, "no prefix hit or no eviction happened"
    assert results[False][2] == 0


def test_preempted_request_resumes_from_its_own_cached_blocks():
    sched, runner = make(num_blocks=6, block_size=4, max_num_seqs=2, budget=32, chunked=True, prefix=True)
    a = req("a", list(range(1, 13)), max_tokens=8)  # 12 + 8 = 20 tokens = 5 blocks
    b = req("b", list(range(50, 58)), max_tokens=8, arrival=1001.0)
    sched.add_request(a)
    sched.add_request(b)
    run_all(sched, runner)
    assert sched.num_preemptions > 0 and runner.hits > 0
    assert a.output_token_ids == [model_token("a", j) for j in range(8)]
    assert b.output_token_ids == [model_token("b", j) for j in range(8)]


# ---- priority policy ---------------------------------------------------------------------


def test_priority_orders_admission_and_fcfs_breaks_ties():
    sched, runner = make(max_num_seqs=1, policy="priority")
    for rid, prio, t in [("low", 5, 1000.0), ("high-late", 0, 1002.0), ("high-early", 0, 1001.0), ("mid", 2, 999.0)]:
        sched.add_request(req(rid, [1, 2, 3], max_tokens=1, priority=prio, arrival=t))
    order = []
    while sched.has_unfinished():
        _, fin = step(sched, runner)
        order += [r.request_id for r in fin]
    assert order == ["high-early", "high-late", "mid", "low"]


def test_fcfs_ignores_priority():
    sched, runner = make(max_num_seqs=1)
    for i, prio in enumerate([5, 0, 3]):
        sched.add_request(req(f"r{i}", [1, 2], max_tokens=1, priority=prio, arrival=1000.0 + i))
    order = []
    while sched.has_unfinished():
        _, fin = step(sched, runner)
        order += [r.request_id for r in fin]
    assert order == ["r0", "r1", "r2"]


def test_priority_preempts_the_least_urgent_running_request():
    # 6 blocks of 4: three requests of 8 tokens fill it; growth forces one out.
    sched, runner = make(num_blocks=6, block_size=4, policy="priority")
    sched.add_request(req("lazy", list(range(8)), max_tokens=8, priority=9, arrival=1000.0))
    step(sched, runner)  # lazy is admitted first, alone
    sched.add_request(req("urgent", list(range(8)), max_tokens=8, priority=0, arrival=1002.0))
    sched.add_request(req("normal", list(range(8)), max_tokens=8, priority=1, arrival=1001.0))
    preempted = []
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        preempted += out.preempted_request_ids
    assert preempted and preempted[0] == "lazy"  # under fcfs it would be the most recently admitted
    assert "urgent" not in preempted


def test_starvation_guard_promotes_a_low_priority_request():
    sched, runner = make(max_num_seqs=1, policy="priority", starvation_timeout=5.0)
    clock = sched.clock
    low = req("low", [1, 2, 3], max_tokens=1, priority=10, arrival=clock.t)
    sched.add_request(low)
    n = 0
    while not low.is_finished:
        assert n < 50, "the low-priority request starved"
        # a steady stream of urgent work: a new high-priority request every step
        sched.add_request(req(f"hi{n}", [4, 5], max_tokens=1, priority=0, arrival=clock.t))
        step(sched, runner)
        clock.t += 1.0
        n += 1
    assert low.promoted and 5 <= n <= 8  # finished soon after waiting past 5 s, not before
    run_all(sched, runner)


def test_without_the_guard_the_same_stream_starves_it():
    sched, runner = make(max_num_seqs=1, policy="priority", starvation_timeout=None)
    low = req("low", [1, 2, 3], max_tokens=1, priority=10, arrival=sched.clock.t)
    sched.add_request(low)
    for n in range(20):
        sched.add_request(req(f"hi{n}", [4, 5], max_tokens=1, priority=0, arrival=sched.clock.t))
        step(sched, runner)
        sched.clock.t += 1.0
    assert not low.is_finished and low.status is RequestStatus.WAITING
    run_all(sched, runner)
    assert low.is_finished


def test_bad_policy_values_are_rejected():
    with pytest.raises(ValueError, match="scheduling policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="disk")
    with pytest.raises(ValueError, match="starvation_timeout"):
        SchedulerConfig(starvation_timeout=0)


def test_chunked_prefill_is_on_by_default_with_its_own_budget():
    import argparse

    from tokenmill.engine.arg_utils import add_engine_args, engine_kwargs
    from tokenmill.config import CHUNKED_BUDGET, UNCHUNKED_BUDGET, EngineConfig

    assert SchedulerConfig().enable_chunked_prefill
    assert SchedulerConfig().max_num_batched_tokens == CHUNKED_BUDGET
    assert SchedulerConfig(enable_chunked_prefill=False).max_num_batched_tokens == UNCHUNKED_BUDGET
    assert SchedulerConfig(max_num_batched_tokens=64).max_num_batched_tokens == 64
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for argv, chunked, budget in (([], True, CHUNKED_BUDGET), (["--no-enable-chunked-prefill"], False, UNCHUNKED_BUDGET),
                                  (["--max-num-batched-tokens", "1024"], True, 1024)):
        sched = EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(argv))).scheduler
        assert (sched.enable_chunked_prefill, sched.max_num_batched_tokens) == (chunked, budget)
