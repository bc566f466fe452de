"""KV-cache bookkeeping: BlockPool / KVCacheManager unit tests, and a stateful property test that
drives the real Scheduler + KVCacheManager through random adds, steps, aborts and early stops with
a pool small enough that preemption happens, checking the invariants after every operation."""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import BlockPool, KVCacheManager, cdiv
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.sched_output import BlockTables, ModelRunnerOutput, SchedulerOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

EOS = 2

# ---- BlockPool ------------------------------------------------------------------------


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_pool_allocate_and_free():
    pool = BlockPool(5)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert len(set(a + b)) == 5 and set(a + b) == set(range(5))
    assert pool.num_free_blocks == 0
    assert all(pool.ref_cnt[x] == 1 for x in a + b)
    assert pool.allocate(0) == []
    pool.free(a)
    assert pool.num_free_blocks == 2
    assert all(pool.ref_cnt[x] == 0 for x in a)
    assert sorted(pool.allocate(2)) == sorted(a)


def test_pool_allocation_failure_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(3)
    free_before, refs_before = list(pool.free_blocks), list(pool.ref_cnt)
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks, only 1 free"):
        pool.allocate(2)
    assert list(pool.free_blocks) == free_before and pool.ref_cnt == refs_before
    pool.free(held)
    assert pool.num_free_blocks == 4


def test_pool_shared_block_is_free_only_when_its_last_holder_lets_go():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.ref_cnt[b] += 1  # a second holder (what prefix caching will do)
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and b not in pool.free_blocks
    pool.free([b])
    assert pool.ref_cnt[b] == 0 and list(pool.free_blocks).count(b) == 1


def test_pool_double_free_raises():
    pool = BlockPool(3)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([2])  # never allocated
    assert pool.num_free_blocks == 3 and pool.ref_cnt == [0, 0, 0]


# ---- KVCacheManager -------------------------------------------------------------------


def test_blocks_needed():
    kv = KVCacheManager(8, 4)
    assert [kv.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert cdiv(7, 2) == 4 and cdiv(8, 2) == 4


def test_allocate_grows_the_table_and_keeps_its_prefix():
    kv = KVCacheManager(8, 4)
    t = kv.allocate_slots("r", 3)
    assert t is not None and len(t) == 1
    first = list(t)
    for n, blocks in [(4, 1), (5, 2), (8, 2), (9, 3), (16, 4)]:
        t2 = kv.allocate_slots("r", n)
        assert t2 is t and len(t) == blocks, n  # the table grows in place
        assert t[: len(first)] == first  # earlier blocks never move
        first = list(t)
        kv.check_invariants()
    assert kv.allocate_slots("r", 2) == first  # asking for fewer never shrinks it
    assert kv.num_free_blocks == 4
    assert kv.block_tables == {"r": first}


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(4, 4)
    t = kv.allocate_slots("a", 12)
    assert len(t) == 3
    table_before, free_before = list(t), list(kv.pool.free_blocks)
    assert kv.allocate_slots("a", 17) is None  # needs 2 more, 1 free
    assert kv.block_tables["a"] == table_before and list(kv.pool.free_blocks) == free_before
    assert kv.allocate_slots("b", 5) is None  # a new request that does not fit leaves no entry
    assert "b" not in kv.block_tables and list(kv.pool.free_blocks) == free_before
    kv.check_invariants()
    assert kv.allocate_slots("b", 4) is not None  # one block still fits
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_free_returns_every_block():
    kv = KVCacheManager(6, 2)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 4)
    assert kv.num_free_blocks == 1
    kv.free("a")
    assert "a" not in kv.block_tables and kv.num_free_blocks == 4
    kv.check_invariants()
    kv.free("a")  # freeing a request twice (or one never seen) is a no-op, not a pool double free
    kv.free("never")
    assert kv.num_free_blocks == 4
    kv.free("b")
    assert kv.num_free_blocks == 6 and kv.block_tables == {}
    assert sorted(kv.pool.free_blocks) == list(range(6)) and kv.pool.ref_cnt == [0] * 6
    kv.check_invariants()


def test_usage_fraction():
    kv = KVCacheManager(8, 4)
    assert kv.usage == 0.0
    kv.allocate_slots("a", 12)
    assert kv.usage == pytest.approx(3 / 8)
    kv.allocate_slots("b", 20)
    assert kv.usage == 1.0
    kv.free("a")
    assert kv.usage == pytest.approx(5 / 8)
    kv.free("b")
    assert kv.usage == 0.0


def _corruptions():
    def ref_too_high(kv):
        kv.pool.ref_cnt[kv.block_tables["a"][0]] += 1

    def wrong_hash_in_map(kv):  # the map sends a hash to a block that carries another
        kv.pool.cached[b"x" * 32] = kv.block_tables["a"][0]

    def hash_not_in_map(kv):
        kv.pool.block_hash[kv.block_tables["a"][1]] = b"y" * 32

    def held_and_free(kv):
        kv.pool.free_blocks[kv.block_tables["a"][0]] = None

    def in_two_tables(kv):
        kv.block_tables["b"].append(kv.block_tables["a"][0])

    def leaked(kv):  # dropped from its table without being freed
        kv.block_tables["a"].pop()

    def lost(kv):  # ref count 0 but not back in the free list
        b = kv.block_tables["b"].pop()
        kv.pool.ref_cnt[b] = 0

    def foreign_free_id(kv):
        kv.pool.free_blocks[kv.num_blocks + 3] = None

    def foreign_table_id(kv):
        kv.block_tables["a"].append(-1)

    return [ref_too_high, wrong_hash_in_map, hash_not_in_map, held_and_free, in_two_tables, leaked, lost, foreign_free_id,
            foreign_table_id]


@pytest.mark.parametrize("corrupt", _corruptions(), ids=lambda f: f.__name__)
def test_check_invariants_catches_corruption(corrupt):
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    kv.allocate_slots("a", 9)
    kv.allocate_slots("b", 5)
    kv.cache_full_blocks("a", list(range(9)), 4)  # a's first block is cached
    kv.check_invariants()
    corrupt(kv)
    with pytest.raises(AssertionError):
        kv.check_invariants()


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4, 16]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 40)), max_size=40),
)
def test_manager_matches_a_model(num_blocks, block_size, ops):
    """Random allocate/free against a plain model of how many blocks each request holds."""
    kv = KVCacheManager(num_blocks, block_size)
    model: dict[str, int] = {}
    for is_alloc, r, n in ops:
        rid = f"r{r}"
        if is_alloc:
            have = model.get(rid, 0)
            want = max(have, cdiv(n, block_size))
            fits = want - have <= num_blocks - sum(model.values())
            before = {k: list(v) for k, v in kv.block_tables.items() if v}
            t = kv.allocate_slots(rid, n)
            if fits:
                assert t is not None and len(t) == want and t[:have] == before.get(rid, [])
                model[rid] = want
            else:
                assert t is None and {k: v for k, v in kv.block_tables.items() if v} == before
        else:
            kv.free(rid)
            model.pop(rid, None)
        kv.check_invariants()
        assert {k: len(v) for k, v in kv.block_tables.items() if v} == {k: v for k, v in model.items() if v}
        assert kv.num_free_blocks == num_blocks - sum(model.values())
        assert kv.usage == pytest.approx(sum(model.values()) / num_blocks)
    for rid in list(model):
        kv.free(rid)
    assert kv.num_free_blocks == num_blocks
    kv.check_invariants()


# ---- scheduler + KV cache under random operations -------------------------------------


def _h(s: str) -> int:
    return zlib.crc32(s.encode())


def model_token(rid: str, idx: int) -> int:
    """The made-up model's output ``idx`` for ``rid``: EOS about one time in ten."""
    h = _h(f"{rid}#{idx}")
    return EOS if h % 10 == 0 else 1000 + h % 30000


class CheckingRunner:
    """A fake model runner that simulates the paged KV cache and checks every step's inputs."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bs = sched.kv_cache.block_size
        self.slots: list[tuple | None] = [None] * (sched.kv_cache.num_blocks * self.bs)
        self.states: dict[str, dict] = {}
        self.ever_new: set[str] = set()
        self.hits = 0  # steps that started a request past a cached prefix
        self.swaps_in = 0
        self.tables = BlockTables()  # kept from the steps' diffs, as the model runner keeps them

    def _slot(self, table: list[int], p: int) -> int:
        return table[p // self.bs] * self.bs + p % self.bs

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        cfg = self.sched.config
        pool = self.sched.kv_cache.pool
        for rid in out.finished_request_ids:
            assert rid in self.states, f"finished {rid!r} was never sent to the runner"
            del self.states[rid]
        swapped_out = {rid for rid, _ in out.swap_out}
        for rid in out.preempted_request_ids:
            if rid not in swapped_out:
                self.states[rid]["computed"] = 0
        for rid, blocks in out.swap_out:  # host copy of the KV of its computed positions
            st_ = self.states[rid]
            assert len(blocks) == -(-st_["computed"] // self.bs) and st_["computed"] > 0
            st_["host"] = [self.slots[self._slot(blocks, p)] for p in range(st_["computed"])]
        for rid, blocks in out.swap_in:  # back into fresh blocks, which nobody else holds
            st_ = self.states[rid]
            assert all(pool.ref_cnt[b] == 1 for b in blocks) and len(blocks) == -(-st_["computed"] // self.bs)
            for p, kv in enumerate(st_.pop("host")):
                self.slots[self._slot(blocks, p)] = kv
            self.swaps_in += 1
        for nr in out.new_requests:
            assert nr.request_id not in self.ever_new, f"{nr.request_id!r} sent as new twice"
            self.ever_new.add(nr.request_id)
            self.states[nr.request_id] = {"tokens": nr.prompt_token_ids + nr.output_token_ids,
                                          "num_prompt": len(nr.prompt_token_ids), "computed": 0}
        self.tables.apply(out)
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) and len(ids) <= cfg.max_num_seqs
        assert sum(len(s.token_ids) for s in out.scheduled) <= cfg.max_num_batched_tokens
        sampled = {}
        for s in out.scheduled:
            st_ = self.states[s.request_id]
            end = s.start_pos + len(s.token_ids)
            assert len(s.token_ids) >= 1
            if st_["computed"] == 0 and s.start_pos > 0:  # (re)admitted on a prefix-cache hit: whole blocks
                assert self.sched.kv_cache.enable_prefix_caching and s.start_pos % self.bs == 0
                self.hits += 1
            else:
                assert s.start_pos == st_["computed"]
            assert s.token_ids == st_["tokens"][s.start_pos:end]
            assert s.needs_logits == (end == len(st_["tokens"]))
            table = self.tables[s.request_id]
            held = self.sched.kv_cache.block_tables.get(s.request_id, table)  # (freed: aborted in flight)
            assert table == held, f"{s.request_id}: the diffs lost a block"
            assert len(table) * self.bs >= end
            for p in range(s.start_pos, end):
                block = table[p // self.bs]
                assert pool.ref_cnt[block] == 1, f"{s.request_id} writes into block {block}, which others hold"
                # A slot's KV is a function of every token up to and including its position.
                self.slots[self._slot(table, p)] = tuple(st_["tokens"][: p + 1])
            st_["computed"] = end
        for s in out.scheduled:
            if s.needs_logits:
                st_ = self.states[s.request_id]
                end = s.start_pos + len(s.token_ids)
                for p in range(end):
                    assert self.slots[self._slot(self.tables[s.request_id], p)] == tuple(st_["tokens"][: p + 1]), \
                        f"{s.request_id}: KV at position {p} is not this request's"
                t = model_token(s.request_id, end - st_["num_prompt"])
                st_["tokens"].append(t)
                sampled[s.request_id] = [t]
        return ModelRunnerOutput(sampled)


MAX_MODEL_LEN = 40


class SchedulerMachine(RuleBasedStateMachine):
    stats: Counter  # set per run by the test
    preemption: str  # likewise: each mode gets its own run (drawn, swap was sometimes never preempted at all)

    @initialize(
        num_blocks=st.integers(3, 8),
        block_size=st.sampled_from([2, 4]),
        max_num_seqs=st.integers(1, 5),
        budget=st.integers(4, 32),
        chunked=st.booleans(),
        prefix_caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget, chunked, prefix_caching, policy):
        preemption = self.preemption
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, chunked, policy=policy,
                                               preemption_mode=preemption), self.kv, MAX_MODEL_LEN)
        self.runner = CheckingRunner(self.sched)
        self.next_id = 0
        self.all: dict[str, Request] = {}
        self.preempted = False

    @rule(prompt_len=st.integers(1, 12), max_tokens=st.integers(1, 12), ignore_eos=st.booleans(),
          min_tokens=st.integers(0, 3), family=st.integers(0, 2), unique=st.integers(0, 3),
          priority=st.integers(-1, 1))
    def add(self, prompt_len, max_tokens, ignore_eos, min_tokens, family, unique, priority):
        rid = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos)
        # Prompts of one family share a prefix (what prefix caching finds), then a unique tail.
        shared = max(prompt_len - unique, 0)
        # Family 2 uses a 2-token alphabet: equal blocks behind different prefixes, which only a chained hash tells apart.
        prompt = [10 + _h(f"f{family}p{i}") % (2 if family == 2 else 900) for i in range(shared)]
        prompt += [10 + _h(f"{rid}p{i}") % 900 for i in range(shared, prompt_len)]
        req = Request(rid, prompt, params, frozenset({EOS}), max_tokens, priority)
        total = prompt_len + max_tokens
        cfg = self.sched.config
        fits = (total <= MAX_MODEL_LEN and self.kv.blocks_needed(total) <= self.kv.num_blocks
                and (cfg.enable_chunked_prefill or total <= cfg.max_num_batched_tokens))
        n_before = len(self.sched.requests)
        if fits:
            self.sched.add_request(req)
            self.all[rid] = req
        else:
            with pytest.raises(ValueError):
                self.sched.add_request(req)
            assert len(self.sched.requests) == n_before and rid not in self.sched.requests
            event("rejected at admission")

    def _step(self):
        busy = self.sched.has_unfinished()
        out = self.sched.schedule()
        result = self.runner.execute(out)
        finished = self.sched.update_from_output(out, result)
        assert not busy or not out.is_empty, "the scheduler stalled with requests left"
        if out.preempted_request_ids:
            self.preempted = True
            event("preempted")
        for r in finished:
            assert r.request_id not in self.sched.requests and r.is_finished
            assert r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)

    @rule()
    def step(self):
        self._step()

    @rule(data=st.data())
    def abort(self, data):
        if self.sched.requests:
            rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
            self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            assert rid not in self.sched.requests and rid not in self.kv.block_tables

    @rule(data=st.data())
    def stop_early(self, data):  # what the engine does on a stop string
        running = [r.request_id for r in self.sched.running]
        if running:
            rid = data.draw(st.sampled_from(running))
            self.sched.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            assert self.all[rid].status is RequestStatus.FINISHED_STOPPED
            assert rid not in self.kv.block_tables

    @invariant()
    def structure_holds(self):
        sched, kv = self.sched, self.kv
        kv.check_invariants()
        running = [r.request_id for r in sched.running]
        waiting = [r.request_id for r in sched.waiting]
        assert set(running) | set(waiting) == set(sched.requests)
        assert len(set(running + waiting)) == len(running) + len(waiting)
        assert len(running) <= sched.config.max_num_seqs
        assert set(kv.block_tables) <= set(running)
        blocks = [b for t in kv.block_tables.values() for b in t]
        if not kv.enable_prefix_caching:
            assert len(blocks) == len(set(blocks)), "a block is in two block tables"
        assert len(set(blocks)) + kv.num_free_blocks == kv.num_blocks
        for t in kv.block_tables.values():  # a table never holds one block twice
            assert len(t) == len(set(t))
        for r in sched.running:
            assert len(kv.block_tables.get(r.request_id, ())) * kv.block_size >= r.num_computed_tokens
            assert r.num_computed_tokens < r.num_tokens
        for r in sched.waiting:
            assert r.request_id not in kv.block_tables
            assert r.num_computed_tokens == 0 or r.request_id in sched.swapped  # swapped keep theirs (host)
        assert sched.swapped <= set(waiting)

    @invariant()
    def tokens_are_the_models(self):
        """Whatever the preemptions, each request's outputs are exactly what the model would say,
        and a request ends exactly when (and only when) a stop condition says so."""
        for rid, r in self.all.items():
            out = r.output_token_ids
            assert out == [model_token(rid, i) for i in range(len(out))], rid
            sp = r.sampling_params
            stops = [i for i, t in enumerate(out) if t == EOS and not sp.ignore_eos and i + 1 >= sp.min_tokens]
            assert stops in ([], [len(out) - 1]), f"{rid} went on past a stop: {out}"
            assert len(out) <= r.max_tokens
            if r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason is not None:
                assert stops == [len(out) - 1]
            elif r.status is RequestStatus.FINISHED_LENGTH:
                assert len(out) == r.max_tokens and not stops
            elif not r.is_finished:
                assert not stops and len(out) < r.max_tokens

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self._step()
            self.structure_holds()
        self.tokens_are_the_models()
        assert not self.sched.has_unfinished() and self.sched.requests == {}
        assert self.kv.num_free_blocks == self.kv.num_blocks and self.kv.block_tables == {}
        assert sorted(self.kv.pool.free_blocks) == list(range(self.kv.num_blocks))
        self.kv.check_invariants()
        out = self.sched.schedule()  # flush the last finished ids to the runner
        assert out.is_empty
        self.runner.execute(out)
        assert self.runner.states == {}, "the runner was never told some requests finished"
        assert self.runner.tables == {}, "the runner kept the table of a request that ended"
        self.stats["examples"] += 1
        self.stats["with_preemption"] += self.preempted
        self.stats["with_prefix_hits"] += self.runner.hits > 0
        self.stats["with_swap_in"] += self.runner.swaps_in > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_random_operations_keep_the_cache_consistent(preemption):
    stats: Counter = Counter()
    machine = type("Machine", (SchedulerMachine,), {"stats": stats, "preemption": preemption})
    # derandomize: the coverage asserts below must not depend on a lucky draw (a random run once had no prefix hit)
    run_state_machine_as_test(machine, settings=settings(max_examples=100, stateful_step_count=30, deadline=None,
                                                         derandomize=True))
    assert stats["examples"] > 0
    assert stats["with_preemption"] > 0, "no example preempted anything: the pool is too big to test it"
    assert stats["with_prefix_hits"] > 0, "no example hit the prefix cache: the prompts share too little"
    if preemption == "swap":
        assert stats["with_swap_in"] > 0, "no example swapped a preempted request back in"


def test_preemption_happens_and_everything_is_freed():
    """Deterministic companion: many requests through a 6-block pool."""
    kv = KVCacheManager(6, 2)
    sched = Scheduler(SchedulerConfig(4, 16, True), kv, MAX_MODEL_LEN)
    runner = CheckingRunner(sched)
    reqs = []
    for i in range(10):
        r = Request(f"q{i}", [10 + i] * (2 + i % 5), SamplingParams(max_tokens=6, ignore_eos=True),
                    frozenset({EOS}), 6)
        reqs.append(r)
        sched.add_request(r)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        kv.check_invariants()
    assert not sched.has_unfinished()
    assert sched.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.output_token_ids == [model_token(r.request_id, i) for i in range(6)] for r in reqs)
    assert kv.num_free_blocks == kv.num_blocks and not sched.requests


# ---- prefix caching: deterministic cases -----------------------------------------------


def _cached_request(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Allocate and fully 'compute' a request, so its full blocks are registered."""
    table = kv.allocate_slots(rid, len(tokens))
    kv.cache_full_blocks(rid, tokens, len(tokens))
    return table


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(10, 4, enable_prefix_caching=True)
    a = _cached_request(kv, "a", list(range(12)))  # 3 full blocks
    assert kv.get_computed_blocks("b", list(range(12))) == a[:2]  # never the whole prompt: 1 token left
    assert kv.get_computed_blocks("c", list(range(13))) == a  # 13th token is computed
    assert kv.get_computed_blocks("d", [0, 1, 2, 3, 9, 9, 9, 9, 9]) == a[:1]  # diverges in block 2
    assert kv.get_computed_blocks("e", [5, 1, 2, 3, 4]) == []
    hits = kv.get_computed_blocks("c", list(range(13)))
    t = kv.allocate_slots("c", 13, hits)
    assert t[:3] == a and len(t) == 4 and all(kv.pool.ref_cnt[b] == 2 for b in a)
    kv.check_invariants()
    kv.free("a")
    assert all(kv.pool.ref_cnt[b] == 1 for b in a)  # still held by c: not freed
    kv.free("c")
    kv.check_invariants()
    assert kv.num_free_blocks == 10 and kv.pool.num_cached_blocks == 3  # free, but still cached
    assert kv.get_computed_blocks("f", list(range(13))) == a


def test_hits_off_when_prefix_caching_is_off():
    kv = KVCacheManager(10, 4)
    _cached_request(kv, "a", list(range(12)))
    assert kv.get_computed_blocks("b", list(range(13))) == [] and kv.pool.num_cached_blocks == 0


def test_idle_hit_blocks_count_against_free_room():
    kv = KVCacheManager(4, 4, enable_prefix_caching=True)
    _cached_request(kv, "a", list(range(8)))  # blocks 2 cached
    kv.free("a")  # both idle in the free queue now; 4 free in all
    hits = kv.get_computed_blocks("b", list(range(9)))
    assert len(hits) == 2
    # b needs 2 hit blocks + 2 new ones = all 4 free blocks: fits exactly
    assert kv.allocate_slots("b", 16, hits) is not None
    kv.free("b")
    hits = kv.get_computed_blocks("c", list(range(9)))
    free_before = list(kv.pool.free_blocks)
    assert kv.allocate_slots("c", 20, hits) is None  # 2 hits + 3 new > 4: nothing changes
    assert list(kv.pool.free_blocks) == free_before and "c" not in kv.block_tables
    kv.check_invariants()


def test_eviction_is_lru_and_tail_blocks_go_first():
    kv = KVCacheManager(6, 2, enable_prefix_caching=True)
    old = _cached_request(kv, "old", [1, 2, 3, 4, 5, 6])  # 3 blocks
    new = _cached_request(kv, "new", [7, 8, 9, 10])  # 2 blocks
    kv.free("old")
    kv.free("new")
    # 1 block never used sits at the head; then old's blocks tail first, then new's.
    grabbed = kv.allocate_slots("x", 4)  # 2 blocks: the unused one, then old's last block
    assert grabbed[1] == old[2]
    assert kv.pool.num_evictions == 1
    assert kv.get_computed_blocks("y", [1, 2, 3, 4, 5, 6, 0]) == old[:2]  # its head survived
    assert kv.get_computed_blocks("z", [7, 8, 9, 10, 0]) == new
    kv.check_invariants()


def test_a_hit_refreshes_recency():
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    a = _cached_request(kv, "a", [1, 2])
    b = _cached_request(kv, "b", [3, 4])
    kv.free("a")
    kv.free("b")
    kv.allocate_slots("a2", 3, kv.get_computed_blocks("a2", [1, 2, 0]))  # touches a's block
    kv.free("a2")
    kv.allocate_slots("x", 6)  # 3 blocks: the two never cached ones, then the least recent (b's)
    assert b[0] in kv.block_tables["x"] and a[0] not in kv.block_tables["x"]
    kv.check_invariants()


def test_duplicate_blocks_keep_the_first_registration():
    kv = KVCacheManager(8, 2, enable_prefix_caching=True)
    a = kv.allocate_slots("a", 4)
    b = kv.allocate_slots("b", 4)  # same tokens computed side by side (admitted in one step)
    kv.cache_full_blocks("a", [1, 2, 3, 4], 4)
    kv.cache_full_blocks("b", [1, 2, 3, 4], 4)
    assert kv.get_computed_blocks("c", [1, 2, 3, 4, 5]) == a
    assert all(kv.pool.block_hash[x] is None for x in b)
    kv.check_invariants()


def test_salt_separates_caches():
    one = KVCacheManager(4, 2, enable_prefix_caching=True, cache_salt=b"model-a")
    two = KVCacheManager(4, 2, enable_prefix_caching=True, cache_salt=b"model-b")
    _cached_request(one, "a", [1, 2])
    _cached_request(two, "a", [1, 2])
    assert set(one.pool.cached).isdisjoint(two.pool.cached)
