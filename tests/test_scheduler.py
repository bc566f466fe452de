"""Scheduler unit tests: the real Scheduler + KVCacheManager driven by a fake model runner.

The fake runner plays the model's part honestly: it keeps per-request state the way the real
runner does (created from ``new_requests``, dropped on ``finished_request_ids``), simulates the
paged KV cache slot by slot, checks everything a step hands it (positions are contiguous, the ids
are the request's known tokens, the block table covers the chunk, the KV of earlier positions is
still intact) and "samples" a deterministic token per (request id, output index), so a request
that is preempted and recomputed must continue with exactly the tokens it would have produced.
No torch, no model: everything here runs in milliseconds.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager, cdiv
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.sched_output import BlockTables, ModelRunnerOutput, SchedulerOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

EOS = 2
STOP = 3


def _h(s: str) -> int:
    return zlib.crc32(s.encode())


def fake_token(rid: str, idx: int) -> int:
    """The made-up model's output number ``idx`` for request ``rid``: never EOS or STOP."""
    return 1000 + _h(f"{rid}#{idx}") % 30000


def make_prompt(rid: str, n: int) -> list[int]:
    return [10 + _h(f"{rid}p{i}") % 900 for i in range(n)]


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, **sp) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sp)
    return Request(rid, make_prompt(rid, prompt_len), params, frozenset({EOS}), max_tokens)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, chunked: bool = False,
                   max_model_len: int = 256) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked), kv, max_model_len)


class FakeRunner:
    """Stands in for ModelRunner.execute and checks what the scheduler hands it."""

    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        kv = sched.kv_cache
        self.bs = kv.block_size
        self.slots: list[tuple | None] = [None] * (kv.num_blocks * kv.block_size)
        self.states: dict[str, dict] = {}
        self.new_counts: Counter[str] = Counter()
        self.finished_seen: list[str] = []
        self.script = script or {}  # rid -> forced output tokens, by output index
        self.outputs: list[SchedulerOutput] = []
        self.tables = BlockTables()  # kept from the steps' diffs, as the model runner keeps them

    def token_for(self, rid: str, idx: int) -> int:
        forced = self.script.get(rid)
        if forced is not None and idx < len(forced):
            return forced[idx]
        return fake_token(rid, idx)

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(out)
        cfg = self.sched.config
        for rid in out.finished_request_ids:
            assert rid in self.states, f"told to drop {rid!r}, which it was never told about"
            del self.states[rid]
            self.finished_seen.append(rid)
        for rid in out.preempted_request_ids:
            assert rid in self.states, f"preempted {rid!r} was never sent to the runner"
            self.states[rid]["computed"] = 0
        for nr in out.new_requests:
            assert nr.request_id not in self.states, f"{nr.request_id!r} sent as new twice"
            self.new_counts[nr.request_id] += 1
            self.states[nr.request_id] = {
                "tokens": list(nr.prompt_token_ids) + list(nr.output_token_ids),
                "num_prompt": len(nr.prompt_token_ids),
                "computed": 0,
            }
        self.tables.apply(out)
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"a request scheduled twice in one step: {ids}"
        assert len(ids) <= cfg.max_num_seqs
        total = sum(len(s.token_ids) for s in out.scheduled)
        assert total <= cfg.max_num_batched_tokens, f"{total} tokens > budget {cfg.max_num_batched_tokens}"
        assert total == out.num_batched_tokens == out.num_prefill_tokens + out.num_decode_tokens
        for s in out.scheduled:
            st = self.states.get(s.request_id)
            assert st is not None, f"{s.request_id!r} scheduled before the runner was told about it"
            n = len(s.token_ids)
            end = s.start_pos + n
            assert n >= 1
            assert s.start_pos == st["computed"], f"{s.request_id}: start {s.start_pos} != computed {st['computed']}"
            assert s.token_ids == st["tokens"][s.start_pos:end], f"{s.request_id}: wrong token ids"
            assert s.needs_logits == (end == len(st["tokens"]))
            table = self.tables[s.request_id]
            held = self.sched.kv_cache.block_tables.get(s.request_id, table)  # (freed: aborted in flight)
            assert table == held, f"{s.request_id}: the diffs lost a block"
            assert len(table) * self.bs >= end, f"{s.request_id}: block table too short for {end} tokens"
            for p in range(s.start_pos, end):
                self.slots[self._slot(table, p)] = (s.request_id, p, s.token_ids[p - s.start_pos])
            st["computed"] = end
        sampled: dict[str, list[int]] = {}
        for s in out.scheduled:
            if not s.needs_logits:
                continue
            st = self.states[s.request_id]
            end = s.start_pos + len(s.token_ids)
            for p in range(end):  # "attention" reads every earlier position's KV
                got = self.slots[self._slot(self.tables[s.request_id], p)]
                assert got == (s.request_id, p, st["tokens"][p]), f"{s.request_id}: KV at position {p} is {got}"
            t = self.token_for(s.request_id, end - st["num_prompt"])
            st["tokens"].append(t)
            sampled[s.request_id] = [t]
        return ModelRunnerOutput(sampled)


def check_state(sched: Scheduler) -> None:
    """Structural invariants of the scheduler + KV cache between steps."""
    kv = sched.kv_cache
    kv.check_invariants()
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
    assert not running & waiting
    assert running | waiting == set(sched.requests)
    assert len(sched.running) <= sched.config.max_num_seqs
    assert set(kv.block_tables) <= running, "a request that is not running holds KV blocks"
    all_blocks = [b for t in kv.block_tables.values() for b in t]
    assert len(all_blocks) == len(set(all_blocks)), "a block is in two block tables"
    assert len(all_blocks) + kv.num_free_blocks == kv.num_blocks
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(kv.block_tables[r.request_id]) * kv.block_size >= r.num_computed_tokens
        assert r.num_computed_tokens < r.num_tokens
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0


def step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    result = runner.execute(out)
    finished = sched.update_from_output(out, result)
    check_state(sched)
    return out, finished


def drain(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> dict[str, Request]:
    done: dict[str, Request] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out, finished = step(sched, runner)
        assert not out.is_empty, "the scheduler stalled with requests left"
        done.update((r.request_id, r) for r in finished)
    assert not sched.has_unfinished()
    return done


def steps_while(cond, limit: int = 200):
    """Yield while ``cond()`` holds, failing (instead of hanging) after ``limit`` rounds."""
    for i in range(limit):
        if not cond():
            return
        yield i
    raise AssertionError(f"still going after {limit} steps")


def scheduled(out: SchedulerOutput) -> dict[str, object]:
    return {s.request_id: s for s in out.scheduled}


# ---- budget, caps, order --------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True])
def test_token_budget_and_seq_cap_respected_every_step(chunked):
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=12, chunked=chunked)
    runner = FakeRunner(sched)
    for i in range(9):
        prompt = (3 + 5 * i) % 23 + 1 if chunked else (i % 7) + 2
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=3))
    max_seqs = max_tokens = 0
    for _ in steps_while(sched.has_unfinished):
        out, _ = step(sched, runner)  # the runner asserts budget and cap on every step
        n = sum(len(s.token_ids) for s in out.scheduled)
        assert n <= 12 and len(out.scheduled) <= 3 and len(sched.running) <= 3
        max_seqs = max(max_seqs, len(out.scheduled))
        max_tokens = max(max_tokens, n)
    assert max_seqs == 3  # the cap was reached, so it was what held the batch back
    if chunked:
        assert max_tokens == 12  # chunking fills the budget exactly
    assert len(runner.new_counts) == 9


def test_running_requests_scheduled_before_waiting():
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 4, max_tokens=10))
    sched.add_request(make_request("a2", 4, max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", 15, max_tokens=1))  # fits an empty budget (16), not 16 - 2
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["a", "a2"]
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 0
    assert sched.waiting[0].request_id == "b"


def test_running_first_with_chunking_gives_prompt_the_rest():
    sched = make_scheduler(max_num_batched_tokens=16, chunked=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 4, max_tokens=10))
    sched.add_request(make_request("a2", 4, max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", 40, max_tokens=1))
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["a", "a2", "b"]
    assert [len(s.token_ids) for s in out.scheduled] == [1, 1, 14]
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 14


def test_fifo_admission_blocked_head_is_not_overtaken_by_budget():
    sched = make_scheduler(max_num_batched_tokens=12)
    runner = FakeRunner(sched)
    sched.add_request(make_request("c1", 3, max_tokens=3))
    sched.add_request(make_request("c2", 3, max_tokens=3))
    step(sched, runner)
    sched.add_request(make_request("a", 11, max_tokens=1))  # needs 11 > 12 - 2 decodes
    sched.add_request(make_request("b", 2, max_tokens=1))  # would fit, but queues behind a
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["c1", "c2"]
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
    first_seen = []
    for _ in steps_while(sched.has_unfinished):
        out, _ = step(sched, runner)
        first_seen += [s.request_id for s in out.scheduled if s.request_id not in first_seen]
    assert first_seen.index("a") < first_seen.index("b")


def test_fifo_admission_blocked_head_is_not_overtaken_by_kv():
    # 4 blocks of 4: "big" holds 2 after its prompt; "head" needs 3, "small" would fit in the 2 left
    sched = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("big", 8, max_tokens=4))
    step(sched, runner)
    sched.add_request(make_request("head", 9, max_tokens=2))
    sched.add_request(make_request("small", 2, max_tokens=2))
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["big"]
    assert [r.request_id for r in sched.waiting] == ["head", "small"]
    assert sched.kv_cache.num_free_blocks == 1  # big grew to 3 blocks for its 9th token
    drain(sched, runner)


def test_admission_order_within_a_step_is_arrival_order():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    for rid in ["x", "y", "z", "w"]:
        sched.add_request(make_request(rid, 3))
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["x", "y", "z", "w"]
    assert [n.request_id for n in out.new_requests] == ["x", "y", "z", "w"]
    assert [r.request_id for r in sched.running] == ["x", "y", "z", "w"]


# ---- prefill, chunking ----------------------------------------------------------------


def test_first_token_sampled_only_when_whole_prompt_is_computed():
    sched = make_scheduler(max_num_batched_tokens=4, chunked=True)
    runner = FakeRunner(sched)
    r = make_request("p", 10, max_tokens=3)
    sched.add_request(r)
    chunks, logits, outs = [], [], []
    for _ in range(3):
        out, _ = step(sched, runner)
        (s,) = out.scheduled
        chunks.append((s.start_pos, len(s.token_ids)))
        logits.append(s.needs_logits)
        outs.append(r.num_output_tokens)
    assert chunks == [(0, 4), (4, 4), (8, 2)]
    assert logits == [False, False, True]
    assert outs == [0, 0, 1]
    assert r.num_computed_tokens == 10
    assert r.output_token_ids == [fake_token("p", 0)]
    out, _ = step(sched, runner)
    (s,) = out.scheduled
    assert (s.start_pos, s.token_ids, s.needs_logits) == (10, [fake_token("p", 0)], True)
    assert out.num_decode_tokens == 1


def test_whole_prompt_in_one_step_without_chunking():
    sched = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(sched)
    r = make_request("p", 20, max_tokens=3)
    sched.add_request(r)
    out, _ = step(sched, runner)
    (s,) = out.scheduled
    assert (s.start_pos, len(s.token_ids), s.needs_logits) == (0, 20, True)
    assert out.num_prefill_tokens == 20 and out.num_decode_tokens == 0
    assert r.num_output_tokens == 1


def test_chunked_prefill_splits_long_prompt_and_keeps_decodes_going():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=8, chunked=True)
    runner = FakeRunner(sched)
    a = make_request("a", 3, max_tokens=20)
    sched.add_request(a)
    step(sched, runner)
    b = make_request("b", 30, max_tokens=2)
    sched.add_request(b)
    starts = []
    for _ in steps_while(lambda: b.num_output_tokens == 0, 10):
        before = a.num_output_tokens
        out, _ = step(sched, runner)
        by_id = scheduled(out)
        assert out.scheduled[0].request_id == "a" and len(by_id["a"].token_ids) == 1  # the decode goes every step
        assert a.num_output_tokens == before + 1
        assert out.num_decode_tokens == 1
        s = by_id["b"]
        starts.append((s.start_pos, len(s.token_ids), s.needs_logits))
    assert starts == [(0, 7, False), (7, 7, False), (14, 7, False), (21, 7, False), (28, 2, True)]
    assert b.output_token_ids == [fake_token("b", 0)]
    done = drain(sched, runner)
    assert done["a"].output_token_ids == [fake_token("a", i) for i in range(20)]


# ---- preemption -----------------------------------------------------------------------


def _preemption_setup():
    """3 blocks of 4. a (4-token prompt), b and c (2 each) take one block each in step 1; in step 2
    a's 5th token needs a second block, so c (the most recently admitted) is preempted, not b."""
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    reqs = {rid: make_request(rid, n, max_tokens=6) for rid, n in [("a", 4), ("b", 2), ("c", 2)]}
    for r in reqs.values():
        sched.add_request(r)
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    assert sched.kv_cache.num_free_blocks == 0
    reqs["d"] = make_request("d", 2, max_tokens=6)
    sched.add_request(reqs["d"])
    return sched, runner, reqs


def test_preemption_picks_most_recently_admitted_and_requeues_it_at_the_front():
    sched, runner, reqs = _preemption_setup()
    c = reqs["c"]
    c_out = list(c.output_token_ids)
    assert sched.num_preemptions == 0
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["c"]
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # front, ahead of the older waiting d
    assert c.status is RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == c_out == [fake_token("c", 0)]  # its tokens are kept
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert "c" not in sched.kv_cache.block_tables
    assert len(sched.kv_cache.block_tables["a"]) == 2


def test_a_request_preempted_max_times_runs_first():
    """c was preempted MAX_PREEMPTIONS - 1 times: preempted once more it is promoted, readmitted ahead
    of the running requests, and from then on others are preempted before it."""
    from tokenmill.core.scheduler import MAX_PREEMPTIONS

    sched, runner, reqs = _preemption_setup()
    c = reqs["c"]
    c.num_preemptions = MAX_PREEMPTIONS - 1
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["c"] and c.promoted
    for _ in steps_while(lambda: c.status is not RequestStatus.RUNNING):
        step(sched, runner)
    assert sched.running[0] is c  # the last victim now


def test_thrashing_is_bounded():
    """A long low-priority request and a stream of urgent ones through a small pool: without a bound
    the long one loses its KV at every arrival; with it, at most MAX_PREEMPTIONS times, and all finish."""
    from tokenmill.core.scheduler import MAX_PREEMPTIONS

    kv = KVCacheManager(8, 4)
    sched = Scheduler(SchedulerConfig(8, 64, False, policy="priority"), kv, 256)
    runner = FakeRunner(sched)
    low = make_request("low", 8, max_tokens=16)
    low.priority = 1
    sched.add_request(low)
    done, k = {}, 0
    for n in range(2000):  # (with no bound, this workload preempts the long request 10 times)
        if n % 4 == 0 and k < 30:
            sched.add_request(make_request(f"urgent{k}", 4, max_tokens=8))
            k += 1
        if not sched.has_unfinished():
            break
        _, finished = step(sched, runner)
        done.update((r.request_id, r) for r in finished)
    assert len(done) == 31 and kv.num_free_blocks == 8
    assert 0 < low.num_preemptions <= MAX_PREEMPTIONS


def test_no_admission_in_a_step_that_preempted():
    # 5 blocks of 2, budget 6, chunked. Step 1: a's prompt (1 block) and 4 of b's 7 (2 blocks).
    # Step 2: a's decode takes a 4th block; b's next 3 tokens need 2 more, 1 is free, so b (the newest)
    # preempts itself. Its 2 blocks come back (3 free), and with 5 tokens of budget left b could be
    # readmitted at once, but a step that preempted admits nothing: b waits for the next one.
    sched = make_scheduler(num_blocks=5, block_size=2, max_num_batched_tokens=6, chunked=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 2, max_tokens=4))
    sched.add_request(make_request("b", 7, max_tokens=3))
    out, _ = step(sched, runner)
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("a", 0, 2), ("b", 0, 4)]
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["b"]
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert sched.kv_cache.num_free_blocks == 3
    assert [r.request_id for r in sched.waiting] == ["b"] and sched.requests["b"].num_computed_tokens == 0
    out, _ = step(sched, runner)
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("a", 3, 1), ("b", 0, 5)]
    done = drain(sched, runner)
    assert done["b"].output_token_ids == [fake_token("b", i) for i in range(3)]


def test_preempting_the_request_that_needs_room_when_it_is_the_newest():
    # a, b admitted; b is the newest and is the one that needs a block: b preempts itself
    sched = make_scheduler(num_blocks=2, block_size=4)
    runner = FakeRunner(sched)
    a = make_request("a", 2, max_tokens=5)
    b = make_request("b", 4, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["b"]
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert not out.new_requests
    assert b.num_computed_tokens == 0 and b.output_token_ids == [fake_token("b", 0)]


def test_preempted_request_is_recomputed_and_continues_with_the_same_tokens():
    sched, runner, reqs = _preemption_setup()
    c = reqs["c"]
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["c"]
    snapshot = list(c.output_token_ids)
    seen_preempted = {"c"}
    rechecked = set()
    done: dict[str, Request] = {}
    for _ in steps_while(sched.has_unfinished):
        before = {rid: list(r.output_token_ids) for rid, r in sched.requests.items()}
        out, finished = step(sched, runner)
        done.update((r.request_id, r) for r in finished)
        for s in out.scheduled:
            if s.request_id in seen_preempted and s.request_id not in rechecked:
                r = reqs[s.request_id]
                # the recompute chunk covers the prompt and every earlier output, then samples the next one
                assert s.start_pos == 0
                assert s.token_ids == r.prompt_token_ids + before[s.request_id]
                assert s.needs_logits
                assert r.output_token_ids[: len(before[s.request_id]) + 1] == before[s.request_id] + [
                    fake_token(s.request_id, len(before[s.request_id]))
                ]
                rechecked.add(s.request_id)
        seen_preempted |= set(out.preempted_request_ids)
        rechecked -= set(out.preempted_request_ids)
    assert "c" in rechecked or "c" in done
    assert done["c"].output_token_ids[: len(snapshot)] == snapshot
    for rid, r in reqs.items():
        assert done[rid].status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [fake_token(rid, i) for i in range(6)], rid
    assert sched.num_preemptions >= 1
    assert sched.num_preemptions == sum(len(o.preempted_request_ids) for o in runner.outputs)
    assert sched.num_preemptions == sum(r.num_preemptions for r in reqs.values())
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_outputs_with_preemption_equal_outputs_without():
    def run(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, block_size=2, max_num_seqs=6, max_num_batched_tokens=16,
                               chunked=True)
        runner = FakeRunner(sched)
        for i in range(8):
            sched.add_request(make_request(f"q{i}", 3 + (7 * i) % 11, max_tokens=4 + i % 5))
        done = drain(sched, runner)
        return {rid: r.output_token_ids for rid, r in done.items()}, sched.num_preemptions

    ref, n_ref = run(200)
    got, n_got = run(10)
    assert n_ref == 0 and n_got > 0
    assert got == ref


def test_new_requests_sent_exactly_once_even_across_preemption():
    sched, runner, reqs = _preemption_setup()
    drain(sched, runner)
    assert sched.num_preemptions >= 1
    assert runner.new_counts == Counter({rid: 1 for rid in reqs})
    first = {n.request_id: n for o in runner.outputs for n in o.new_requests}
    for rid, r in reqs.items():
        n = first[rid]
        assert n.prompt_token_ids == r.prompt_token_ids
        assert n.output_token_ids == []
        assert n.sampling_params is r.sampling_params
        assert n.eos_token_ids == frozenset({EOS})


def test_a_step_carries_only_the_blocks_added_since_the_last():
    """The contract's per-step diff: a request's whole table on its first step, then only blocks appended since
    (none most decode steps), and its whole new table again after a preemption freed the old one."""
    sched, runner, reqs = _preemption_setup()
    first = scheduled(runner.outputs[0])
    assert first["a"].new_table and first["a"].new_block_ids == sched.kv_cache.block_tables["a"]
    out, _ = step(sched, runner)  # a's 5th token takes a second block; c is preempted for it
    a = scheduled(out)["a"]
    assert not a.new_table and len(a.new_block_ids) == 1
    assert a.new_block_ids == sched.kv_cache.block_tables["a"][1:]
    assert scheduled(out)["b"].new_block_ids == [] and not scheduled(out)["b"].new_table
    assert out.preempted_request_ids == ["c"] and "c" not in runner.tables
    for _ in steps_while(lambda: "c" not in {s.request_id for s in out.scheduled}):
        out, _ = step(sched, runner)
    c = scheduled(out)["c"]
    assert c.new_table and c.new_block_ids == sched.kv_cache.block_tables["c"]
    # a scheduler whose diffs dropped the flag would leave the runner extending c's freed table
    wrong = BlockTables({"c": [99]})
    wrong.apply(SchedulerOutput([dataclasses.replace(c, new_table=False)]))
    assert wrong["c"] != sched.kv_cache.block_tables["c"]


# ---- admission checks -----------------------------------------------------------------


def test_check_fits_rejects_over_context_length():
    sched = make_scheduler(max_model_len=32, max_num_batched_tokens=64)
    sched.check_fits(24, 8)  # exactly the context: fine
    with pytest.raises(ValueError, match=r"prompt \(25 tokens\) \+ max_tokens \(8\) = 33 exceeds .*context length of 32"):
        sched.check_fits(25, 8)


def test_check_fits_rejects_more_than_the_whole_pool():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    sched.check_fits(10, 6)  # 16 tokens = 4 blocks
    with pytest.raises(ValueError, match=r"needs 5 KV blocks \(17 tokens\) but the whole KV cache has 4"):
        sched.check_fits(10, 7)


def test_check_fits_rejects_over_budget_only_without_chunking():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.check_fits(12, 4)
    with pytest.raises(ValueError, match=r"exceeds max_num_batched_tokens \(16\) and chunked prefill is off"):
        sched.check_fits(12, 5)
    make_scheduler(max_num_batched_tokens=16, chunked=True).check_fits(60, 5)


@pytest.mark.parametrize(
    "kwargs,prompt,max_tokens,match",
    [
        ({"max_model_len": 16}, 10, 7, "context length"),
        ({"num_blocks": 2, "block_size": 4}, 6, 3, "whole KV cache"),
        ({"max_num_batched_tokens": 8}, 6, 3, "chunked prefill is off"),
    ],
)
def test_add_request_rejects_and_queues_nothing(kwargs, prompt, max_tokens, match):
    sched = make_scheduler(**kwargs)
    with pytest.raises(ValueError, match=match):
        sched.add_request(make_request("r", prompt, max_tokens))
    assert not sched.requests and not sched.waiting and not sched.has_unfinished()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert sched.schedule().is_empty


def test_add_request_rejects_duplicate_id():
    sched = make_scheduler()
    sched.add_request(make_request("r", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r", 4))
    assert len(sched.waiting) == 1 and sched.waiting[0].num_prompt_tokens == 3


# ---- stop conditions ------------------------------------------------------------------


def run_one(request: Request, script: list[int] | None = None, **sched_kwargs) -> Request:
    sched = make_scheduler(**sched_kwargs)
    runner = FakeRunner(sched, {request.request_id: script} if script else None)
    sched.add_request(request)
    done = drain(sched, runner)
    assert list(done) == [request.request_id]
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert not sched.requests
    return done[request.request_id]


def test_stops_at_eos():
    r = run_one(make_request("e", 4, max_tokens=10), script=[100, 101, EOS, 103])
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [100, 101, EOS]
    assert r.stop_reason == EOS


def test_ignore_eos_runs_to_max_tokens():
    r = run_one(make_request("e", 4, max_tokens=5, ignore_eos=True), script=[EOS, 101, EOS, 103])
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [EOS, 101, EOS, 103, fake_token("e", 4)]
    assert r.stop_reason is None


def test_stops_at_stop_token_ids_even_with_ignore_eos():
    r = run_one(make_request("s", 4, max_tokens=10, ignore_eos=True, stop_token_ids=[STOP]),
                script=[EOS, 101, STOP, 103])
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [EOS, 101, STOP]
    assert r.stop_reason == STOP


def test_max_tokens_gives_exactly_max_tokens():
    for n in (1, 2, 7):
        r = run_one(make_request(f"m{n}", 4, max_tokens=n))
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [fake_token(f"m{n}", i) for i in range(n)]


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    r = run_one(make_request("m", 4, max_tokens=10, min_tokens=3, stop_token_ids=[STOP]),
                script=[EOS, STOP, EOS, 104])
    # the first two would stop; the third is the min_tokens-th token, so it may
    assert r.output_token_ids == [EOS, STOP, EOS]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == EOS
    r = run_one(make_request("m2", 4, max_tokens=10, min_tokens=3), script=[EOS, 101, 102, 103, EOS])
    assert r.output_token_ids == [EOS, 101, 102, 103, EOS]
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_eos_on_the_last_allowed_token_is_a_stop():
    r = run_one(make_request("e", 4, max_tokens=3), script=[100, 101, EOS])
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [100, 101, EOS]


def test_context_length_stops_generation():
    # max_tokens resolved bigger than the context allows (bypassing check_fits): the context check ends it
    sched = make_scheduler(max_model_len=10)
    runner = FakeRunner(sched)
    r = make_request("c", 4, max_tokens=6)
    sched.add_request(r)
    r.max_tokens = 50
    done = drain(sched, runner)
    assert done["c"].status is RequestStatus.FINISHED_LENGTH
    assert r.num_tokens == 10 and r.num_output_tokens == 6
    assert max(s.start_pos + len(s.token_ids) for o in runner.outputs for s in o.scheduled) <= 10


# ---- finishing from outside, finished ids ---------------------------------------------


def test_finish_waiting_request_never_seen_by_runner():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("w", 4))
    step(sched, runner)
    w = sched.requests["w"]
    sched.finish_request("w", RequestStatus.FINISHED_ABORTED)
    assert w.status is RequestStatus.FINISHED_ABORTED and w.timings.finished is not None
    assert "w" not in sched.requests and not sched.waiting
    check_state(sched)
    out, _ = step(sched, runner)
    assert out.finished_request_ids == []  # the runner never heard of w
    drain(sched, runner)
    assert "w" not in runner.finished_seen and "w" not in runner.new_counts


def test_finish_running_request_frees_blocks_and_tells_runner_once():
    sched = make_scheduler(num_blocks=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 9, max_tokens=10))
    sched.add_request(make_request("b", 5, max_tokens=10))
    step(sched, runner)
    step(sched, runner)
    assert len(sched.kv_cache.block_tables["a"]) == 3
    free_before = sched.kv_cache.num_free_blocks
    a = sched.requests["a"]
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert sched.kv_cache.num_free_blocks == free_before + 3  # freed now, not at the next step
    assert "a" not in sched.kv_cache.block_tables and a not in sched.running
    check_state(sched)
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)  # already finished: no-op
    sched.finish_request("nope", RequestStatus.FINISHED_ABORTED)  # unknown: no-op
    assert a.status is RequestStatus.FINISHED_STOPPED
    out, _ = step(sched, runner)
    assert out.finished_request_ids == ["a"]
    assert "a" not in scheduled(out)
    out, _ = step(sched, runner)
    assert out.finished_request_ids == []
    assert "a" not in runner.states


def test_finish_preempted_request_tells_runner():
    sched, runner, reqs = _preemption_setup()
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["c"]
    sched.finish_request("c", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == ["d"]
    out, _ = step(sched, runner)
    assert out.finished_request_ids == ["c"]
    assert "c" not in runner.states


def test_abort_while_the_step_runs():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 4, max_tokens=10))
    sched.add_request(make_request("b", 4, max_tokens=10))
    step(sched, runner)
    out = sched.schedule()
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)  # e.g. the client went away mid-step
    result = runner.execute(out)
    finished = sched.update_from_output(out, result)
    assert finished == []
    assert sched.requests["b"].num_output_tokens == 2
    check_state(sched)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks - 2
    out2, _ = step(sched, runner)
    assert out2.finished_request_ids == ["a"]
    assert [s.request_id for s in out2.scheduled] == ["b"]


def test_naturally_finished_requests_reach_runner_next_step():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("short", 3, max_tokens=1))
    sched.add_request(make_request("long", 3, max_tokens=4))
    out, finished = step(sched, runner)
    assert [r.request_id for r in finished] == ["short"]
    assert out.finished_request_ids == []
    out, _ = step(sched, runner)
    assert out.finished_request_ids == ["short"]
    drain(sched, runner)
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == ["long"]
    runner.execute(out)
    assert runner.states == {}
    assert sorted(runner.finished_seen) == ["long", "short"]
    assert sched.schedule().finished_request_ids == []


def test_prefill_and_decode_token_accounting():
    sched = make_scheduler(max_num_batched_tokens=10, chunked=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 3, max_tokens=5))
    out, _ = step(sched, runner)
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (3, 0)
    sched.add_request(make_request("b", 19, max_tokens=2))
    out, _ = step(sched, runner)
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (9, 1)
    assert cdiv(9, 4) == len(sched.kv_cache.block_tables["b"])
    out, _ = step(sched, runner)
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (9, 1)  # b: 9 more of its prompt, a: decode
    out, _ = step(sched, runner)
    # b's last prompt token is a 1-token chunk, but still prefill work
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert out.scheduled[1].start_pos == 18 and out.scheduled[1].needs_logits
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (1, 1)


def test_one_token_prompt_counts_as_prefill():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("one", 1, max_tokens=3))
    out, _ = step(sched, runner)
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (1, 0)
    out, _ = step(sched, runner)
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)


# ---- steps in flight (pipeline parallelism: engine/core.py) -------------------------------------


def _sampled(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput({s.request_id: [fake_token(s.request_id, 0)] for s in out.scheduled if s.needs_logits})


def test_lanes_take_turns_and_top_each_other_up():
    """Two lanes: the first step admits half the requests, the next the other half; a lane whose requests
    all ended is topped up from the other's requests not in flight; a step never holds a request in flight."""
    s = make_scheduler(max_num_batched_tokens=256)
    s.lanes = 2
    for k in range(4):
        s.add_request(make_request(f"r{k}", 6, max_tokens=50))
    a = s.schedule()
    b = s.schedule()
    ids = lambda out: {x.request_id for x in out.scheduled}  # noqa: E731
    assert ids(a) == {"r0", "r1"} and ids(b) == {"r2", "r3"} and s.in_flight == {"r0", "r1", "r2", "r3"}
    assert s.schedule().is_empty  # everyone in flight
    with pytest.raises(ValueError, match="already in use"):
        s.finish_request("r2", RequestStatus.FINISHED_ABORTED)
        s.add_request(make_request("r2", 6))  # its step is still in flight
    s.finish_request("r3", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(a, _sampled(a))
    s.update_from_output(b, _sampled(b))
    assert not s.in_flight
    # lane 1 lost both its requests; its turn takes one of lane 0's (the other stays for lane 0's turn)
    c, d = s.schedule(), s.schedule()
    assert len(c.scheduled) == len(d.scheduled) == 1 and ids(c) | ids(d) == {"r0", "r1"}


def test_a_request_waits_for_blocks_held_in_flight_rather_than_preempt_itself():
    """Blocks run out while the request after it in preemption order is in flight: it is not preempted
    (losing its KV while a lower-priority request keeps its own); once that step is applied, the usual
    preemption takes the last request."""
    s = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    s.lanes = 2
    s.add_request(make_request("first", 8, max_tokens=12))
    s.add_request(make_request("second", 8, max_tokens=4))
    a = s.schedule()  # lane 0: first's prompt (2 blocks)
    b = s.schedule()  # lane 1: second's prompt (2 blocks), kept in flight below
    assert [x.request_id for x in a.scheduled] == ["first"] and [x.request_id for x in b.scheduled] == ["second"]
    s.update_from_output(a, _sampled(a))
    for _ in range(4):  # first decodes positions 8-11 into the last free block; lane 1 has nothing free
        a = s.schedule()
        assert [x.request_id for x in a.scheduled] == ["first"]
        s.update_from_output(a, _sampled(a))
    out = s.schedule()  # first needs a fourth block: only second's in-flight blocks could give it one
    assert out.is_empty and not out.preempted_request_ids
    assert [r.request_id for r in s.running] == ["first", "second"] and s.in_flight == {"second"}
    s.update_from_output(b, _sampled(b))
    out = s.schedule()  # lane 1's turn: second needs a block too, and is the last: it goes
    assert out.preempted_request_ids == ["second"] and not out.scheduled
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["first"]
    s.kv_cache.check_invariants()
