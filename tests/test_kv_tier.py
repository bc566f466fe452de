"""The KV tier on local disk (--kv-offload-size): evicted prefix blocks written there come back on a hit with the
same output bits, survive a restart, are read by no other model or KV layout, are never served when a file fails
its check, and stay within the size bound. The engine tests run the default model (batch invariant on the CPU
kernels) with a pool of a few blocks; the file-level ones run the tier's two halves on small tensors."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.core.kv_cache import BlockPool, hash_block
from tokenmill.core.kv_tier import HEADER, KVTier, check_kv_offload, tier_key
from tokenmill.core.sched_output import KVOffloadStats, KVRecv, SchedulerOutput
from tokenmill.models.registry import DEFAULT_MODEL
from tokenmill.worker.kv_tier import KVTierStore, block_payload_bytes

POOL_BLOCKS = 12  # 192 tokens: the system prompt and the filler do not fit together
SYSTEM = ("You are the ship's navigator. Answer every question about the voyage in one short sentence, name the "
          "instrument you would use, and never guess a position you cannot fix. ") * 3
FILLER = "The harbour master counted the barrels, the ropes, the sails and the lanterns once more. " * 9
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=2)


def tier_llm(path, **kw) -> LLM:
    block_bytes = 46080 * 16  # the default model's float32 KV per block (checked below)
    return LLM(DEFAULT_MODEL, kv_cache_memory=str(POOL_BLOCKS * block_bytes), max_model_len=2048,
               kv_offload_size=0.5, kv_offload_path=str(path), **kw)


def run(llm: LLM, prompt: str):
    """One request alone: its output and the position its first step started at (what it did not compute)."""
    n = len(llm.engine.step_stats)
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    starts = [r[1] for s in list(llm.engine.step_stats)[n:] for r in (s.requests or ()) if r[0] == out.request_id]
    return out, starts[0]


def tier_totals(llm: LLM) -> KVOffloadStats:
    total = KVOffloadStats()
    for s in llm.engine.step_stats:
        if s.kv_offload is not None:
            for f in ("queries", "hits", "bytes_read", "bytes_written", "failures"):
                setattr(total, f, getattr(total, f) + getattr(s.kv_offload, f))
    return total


def same_bits(a, b) -> None:
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].logprobs == b.outputs[0].logprobs


def idle(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.kv_cache.check_invariants()
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks


@pytest.fixture(scope="module")
def reference(llm_default):
    """Outputs without any tier, on a pool that holds everything."""
    assert llm_default.engine.kv_bytes_per_token == 46080
    return {q: llm_default.generate(SYSTEM + q, GREEDY, use_tqdm=False)[0]
            for q in ("Which way is north?", "How deep is the water?", "When is high tide?")}


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory):
    """One tier directory for the engine tests: the first fills it, the others read what it left (or fill it
    themselves when run alone)."""
    return tmp_path_factory.mktemp("kv_tier")


def filled(tier_dir):
    """``tier_dir`` holding the system prompt's blocks, as the first test leaves it (written at shutdown)."""
    if not any(tier_dir.glob("*/*.kv")):
        llm = tier_llm(tier_dir)
        try:
            run(llm, SYSTEM + "Which way is north?")
        finally:
            llm.shutdown()
    return tier_dir


def test_an_evicted_prefix_is_read_back_with_the_same_bits_and_survives_a_restart(reference, tier_dir):
    llm = tier_llm(tier_dir)
    try:
        first, _ = run(llm, SYSTEM + "Which way is north?")
        run(llm, FILLER)  # evicts the system prompt's blocks: they go to the tier
        before = tier_totals(llm)
        assert before.bytes_written > 0 and before.hits == 0
        again, start = run(llm, SYSTEM + "How deep is the water?")
        totals = tier_totals(llm)
        assert totals.hits > 0 and totals.bytes_read >= totals.hits * block_payload_bytes(llm.engine.runner.kv_caches)
        # the blocks read from the tier were not computed: the request started after them
        assert start >= totals.hits * 16
        same_bits(first, reference["Which way is north?"])
        same_bits(again, reference["How deep is the water?"])
        assert llm.engine.scheduler.kv_tier.reading == {}
        idle(llm)
    finally:
        llm.shutdown()  # writes the pool's cached blocks the tier lacks
    restarted = tier_llm(tier_dir)
    try:
        out, start = run(restarted, SYSTEM + "When is high tide?")
        hits = tier_totals(restarted).hits
        assert hits > 0 and start == hits * 16  # nothing in its pool yet: the whole prefix came from disk
        same_bits(out, reference["When is high tide?"])
        # aborted while its blocks are read: they are freed once the read ends, nothing leaks
        eng = restarted.engine
        run(restarted, FILLER)
        rid = eng.add_request(SYSTEM + "Which way is north?", GREEDY)
        eng.step()
        assert eng.scheduler.waiting_for_kv  # its blocks are being read
        eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
        idle(restarted)
    finally:
        restarted.shutdown()


def test_another_kv_layout_gets_its_own_directory(tier_dir):
    before = {p.name for p in filled(tier_dir).iterdir()}  # the float32 engine's
    llm = tier_llm(tier_dir, kv_cache_dtype="int8")
    try:
        _, start = run(llm, SYSTEM + "How deep is the water?")
        assert tier_totals(llm).hits == 0 and start == 0
        assert llm.engine.scheduler.kv_tier.directory.name not in before
    finally:
        llm.shutdown()


def test_a_corrupt_file_is_never_served(reference, tier_dir):
    llm = tier_llm(filled(tier_dir))
    try:
        tier, kv = llm.engine.scheduler.kv_tier, llm.engine.kv_cache
        first = tier.path(hash_block(kv.cache_salt, llm.tokenizer.encode(SYSTEM)[:16]))  # the prompt's first block
        assert first.exists()  # (written by an engine's shutdown: the first test's, or filled's)
        data = bytearray(first.read_bytes())
        data[-1] ^= 0x40  # one bit of the payload, after the engine indexed the file
        first.write_bytes(bytes(data))
        out, start = run(llm, SYSTEM + "Which way is north?")
        totals = tier_totals(llm)
        assert totals.hits > 0 and totals.failures == 1 and totals.bytes_read == 0
        assert start == 0  # computed, not served
        same_bits(out, reference["Which way is north?"])
        assert not first.exists() and first.stem not in {h.hex() for h in tier.files}
        idle(llm)
    finally:
        llm.shutdown()


# ---- the two halves on small tensors ------------------------------------------------------------------


def small_caches(seed: int = 0, blocks: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """Two layers laid out as an int8 KV cache is: int8 K and V, float32 scales."""
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, 4, 2, 8)
    return [(torch.randint(-128, 127, shape, generator=g, dtype=torch.int8),
             torch.randint(-128, 127, shape, generator=g, dtype=torch.int8),
             torch.rand(shape[:3], generator=g), torch.rand(shape[:3], generator=g)) for _ in range(2)]


def open_store(path, caches, key=b"k" * 32, capacity_files=100, pool=None) -> KVTierStore:
    file_bytes = HEADER.size + block_payload_bytes(caches)
    return KVTierStore(caches, KVTier(path, capacity_files * file_bytes, file_bytes, key, pool))


def write(store: KVTierStore, blocks: dict[int, bytes]) -> None:
    """The pool evicts ``blocks`` (block -> hash) while a step is scheduled; the runner's launch copies them."""
    tier, out = store.tier, SchedulerOutput()
    tier.open_step()
    for b, h in blocks.items():
        tier.evicted(b, h)
    tier.close_step(out)
    store.before_forward(out)


def read(store: KVTierStore, blocks: dict[int, bytes]) -> str | None:
    """Read ``blocks`` (block -> hash) as a request admitted with those hits would; the error, or None."""
    store.start_receive(KVRecv("r", list(blocks), 0, 16 * len(blocks), [], None, list(blocks.values())))
    store.before_forward(SchedulerOutput())
    while store.pending():
        store.wait(1.0)
        events = store.poll()
        if events:
            return events[0][2]


def blocks_equal(a, b, i: int, j: int) -> bool:
    return all(torch.equal(x[i], y[j]) for la, lb in zip(a, b) for x, y in zip(la, lb))


def test_blocks_round_trip_bit_for_bit_and_a_queued_write_is_read_from_memory(tmp_path):
    caches = small_caches()
    store = open_store(tmp_path, caches)
    gate = threading.Event()
    store._writer.submit(gate.wait)  # the writer is busy: the next writes stay queued
    write(store, {1: b"a" * 32, 2: b"b" * 32})
    assert not any(tmp_path.glob("*.kv"))
    assert read(store, {5: b"a" * 32}) is None and blocks_equal(caches, caches, 1, 5)  # from the host copy
    gate.set()
    store.shutdown()
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == [(b"a" * 32).hex() + ".kv", (b"b" * 32).hex() + ".kv"]
    # a new store over other tensors of the same layout (a restart) reads them from disk
    other = small_caches(seed=1)
    store = open_store(tmp_path, other)
    assert set(store.tier.files) == {b"a" * 32, b"b" * 32}
    assert read(store, {3: b"b" * 32, 4: b"a" * 32}) is None
    assert blocks_equal(caches, other, 2, 3) and blocks_equal(caches, other, 1, 4)
    store.shutdown()


def test_a_writer_behind_drops_blocks_instead_of_holding_them(tmp_path, monkeypatch):
    from tokenmill.worker import kv_tier

    store = open_store(tmp_path, small_caches())
    monkeypatch.setattr(kv_tier, "MAX_BACKLOG_BYTES", store.payload_bytes)
    gate = threading.Event()
    store._writer.submit(gate.wait)
    write(store, {0: b"a" * 32, 1: b"b" * 32})  # two blocks' copies: over the bound
    assert set(store.tier.files) == {b"a" * 32, b"b" * 32} and not store._unwritten
    store.tier.open_step()  # the next step's scheduling forgets them
    assert store.tier.files == {}
    gate.set()
    store.shutdown()
    assert not any(tmp_path.glob("*.kv"))


def test_evictions_outside_a_steps_scheduling_are_not_offloaded(tmp_path):
    pool = BlockPool(4)
    store = open_store(tmp_path, small_caches(), pool=pool)
    pool.register(pool.allocate(1)[0], b"x" * 32)
    pool.free([0])
    pool.allocate(4)  # (a draft's slots, score(): nothing copies the block before it is written)
    assert store.tier.files == {}
    store.tier.pool = None  # (nothing to persist)
    store.shutdown()


def test_files_of_another_key_or_failing_their_check_are_not_served(tmp_path):
    caches = small_caches()
    store = open_store(tmp_path / "a", caches, key=b"1" * 32)
    write(store, {0: b"a" * 32, 1: b"b" * 32, 2: b"c" * 32})
    store.shutdown()
    # the same layout under another key (another model): its files copied over are refused by their header
    (tmp_path / "b").mkdir()
    for p in (tmp_path / "a").glob("*.kv"):
        (tmp_path / "b" / p.name).write_bytes(p.read_bytes())
    other = open_store(tmp_path / "b", small_caches(seed=1), key=b"2" * 32)
    assert "another model" in read(other, {4: b"a" * 32})
    assert not (tmp_path / "b" / ((b"a" * 32).hex() + ".kv")).exists()  # dropped, not tried again
    other.shutdown()
    a = tmp_path / "a"
    flip = a / ((b"b" * 32).hex() + ".kv")
    data = bytearray(flip.read_bytes())
    data[HEADER.size + 7] ^= 1
    flip.write_bytes(bytes(data))
    short = a / ((b"c" * 32).hex() + ".kv")
    short.write_bytes(short.read_bytes()[:-1])
    store = open_store(a, small_caches(seed=2), key=b"1" * 32)
    assert set(store.tier.files) == {b"a" * 32, b"b" * 32} and not short.exists()  # truncated: dropped at start
    assert "checksum" in read(store, {6: b"b" * 32})
    (a / ((b"a" * 32).hex() + ".kv")).write_bytes(b"short")  # truncated after it was indexed
    assert "expected" in read(store, {6: b"a" * 32})
    assert store.counters.take(0).failures == 3
    store.shutdown()


def test_the_size_bound_evicts_the_least_recently_used_files(tmp_path):
    caches = small_caches()
    store = open_store(tmp_path, caches, capacity_files=3)
    hashes = [bytes([i]) * 32 for i in range(5)]
    write(store, {0: hashes[0], 1: hashes[1], 2: hashes[2]})
    store.tier.lookup("r", [hashes[0]])  # a hit: hashes[0] is now the most recently used
    store.tier.admitted("r")
    write(store, {3: hashes[3], 4: hashes[4]})
    store.shutdown()
    assert {p.stem for p in tmp_path.glob("*.kv")} == {h.hex() for h in (hashes[0], hashes[3], hashes[4])}
    smaller = open_store(tmp_path, caches, capacity_files=2)
    assert smaller.tier.usage_bytes == 2 * store.file_bytes and len(list(tmp_path.glob("*.kv"))) == 2
    with pytest.raises(ValueError, match="in use by another engine"):
        open_store(tmp_path, caches)
    smaller.shutdown()


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="needs --kv-offload-size"):
        CacheConfig(kv_offload_path="somewhere")
    with pytest.raises(ValueError, match="positive"):
        CacheConfig(kv_offload_size=0)
    for kw, why in ((dict(enable_prefix_caching=False), "prefix-caching"), (dict(tensor_parallel_size=2), "rank"),
                    (dict(kv_role="consumer"), "disaggregation"),
                    (dict(speculative_method="draft", speculative_model="m"), "draft model")):
        with pytest.raises(ValueError, match=why):
            check_kv_offload(EngineConfig.from_kwargs(kv_offload_size=1, **kw), "cpu")
    with pytest.raises(ValueError, match="cuda"):
        check_kv_offload(EngineConfig.from_kwargs(kv_offload_size=1), "cuda")
    from tokenmill.cli import build_parser
    from tokenmill.engine.arg_utils import engine_kwargs

    a = build_parser().parse_args(["serve", "--kv-offload-size", "2.5", "--kv-offload-path", "tier"])
    cache = EngineConfig.from_kwargs(**engine_kwargs(a)).cache
    assert (cache.kv_offload_size, cache.kv_offload_path) == (2.5, "tier")


def test_the_key_follows_the_model_files_and_the_layout(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    layout = {"kv_cache_dtype": "auto", "block_size": 16}
    key = tier_key(model, layout)
    assert tier_key(model, dict(layout)) == key
    assert tier_key(model, {**layout, "kv_cache_dtype": "int8"}) != key
    model.write_bytes(b"other weights")
    assert tier_key(model, layout) != key
    os.utime(model, ns=(0, 0))
    assert tier_key(model, layout) != key


def test_the_tier_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.engine.messages import StepStats
    from tokenmill.server.metrics import ServerMetrics

    idle = SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_waiting_for_kv=0, num_kv_held=0)
    m = ServerMetrics("m", snapshot=lambda: idle)
    m.on_step(StepStats(0.0, 0.01, 0, 0, 0, 0, 0, 0, 0, kv_offload=KVOffloadStats(
        queries=10, hits=4, bytes_read=400, bytes_written=900, read_seconds=[0.002], write_seconds=[0.01, 0.02],
        failures=1, usage_bytes=5000)))
    samples = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
               if s.name.startswith("tokenmill:kv_offload")}
    assert samples["tokenmill:kv_offload_queries_total"] == 10 and samples["tokenmill:kv_offload_hits_total"] == 4
    assert samples["tokenmill:kv_offload_bytes_read_total"] == 400
    assert samples["tokenmill:kv_offload_bytes_written_total"] == 900
    assert samples["tokenmill:kv_offload_failures_total"] == 1
    assert samples["tokenmill:kv_offload_read_seconds_count"] == 1
    assert samples["tokenmill:kv_offload_write_seconds_count"] == 2
    assert samples["tokenmill:kv_offload_usage_bytes"] == 5000


def test_tokenmill_generate_leaves_its_pool_in_the_tier_at_exit(tmp_path):
    """The CLI shuts its engine down: a one-shot `tokenmill generate` with a tier writes the prompt's cached
    blocks there, so the next run finds them (nothing was evicted during the run)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tokenmill.cli", "generate", SYSTEM + "Which way is north?", "--raw",
           "--max-tokens", "2", "--kv-offload-size", "0.5", "--kv-offload-path", str(tmp_path), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(list(tmp_path.glob("*/*.kv"))) >= 4  # the system prompt's full blocks
