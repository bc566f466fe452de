"""Prefill/decode disaggregation: the scheduler's two waiting states, the KV connector's transports and
failures, the real model's outputs against colocated serving, and real servers behind the router."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from tokenmill.config import EngineConfig, KVTransferConfig, SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.sched_output import KVRecv, KVSend, ModelRunnerOutput
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kv_transfer.connector import KVConnector
from tokenmill.kv_transfer.frames import recv_header, send_header
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import InvalidParameter, SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12)


# ---- the scheduler's states (no tensors) -----------------------------------------------


def _scheduler(num_blocks: int = 32, prefix: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, 256)


def _remote(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens=max_tokens,
                   kv_transfer={"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
                                "remote_request_id": "p"})


def test_consumer_waits_for_kv_then_computes_the_last_prompt_token():
    s = _scheduler()
    prompt = list(range(10, 21))  # 11 tokens: 10 arrive, 1 is computed here
    s.add_request(_remote("a", prompt))
    out = s.schedule()
    assert out.scheduled == [] and out.num_batched_tokens == 0  # the transfer costs no compute
    (recv,) = out.kv_recv
    assert (recv.first_block, recv.num_tokens) == (0, 10)
    assert len(recv.block_ids) == 3 and recv.block_ids == s.kv_cache.block_tables["a"][:3]
    assert len(s.kv_cache.block_tables["a"]) == 3  # the whole prompt's blocks are reserved
    assert s.requests["a"].status is RequestStatus.WAITING_FOR_KV and s.has_unfinished()
    assert s.schedule().scheduled == []  # still waiting
    s.kv_cache.check_invariants()

    assert s.kv_recv_done("a") is None
    out = s.schedule()
    (sr,) = out.scheduled
    assert (sr.token_ids, sr.start_pos, sr.needs_logits) == ([20], 10, True)
    assert [n.request_id for n in out.new_requests] == ["a"]  # the runner learns of it now
    s.update_from_output(out, ModelRunnerOutput({"a": [7]}))
    assert s.requests["a"].output_token_ids == [7]
    s.kv_cache.check_invariants()


def test_consumer_receives_only_what_its_prefix_cache_lacks():
    s = _scheduler(prefix=True)
    prompt = list(range(100, 113))  # 13 tokens
    s.add_request(Request("warm", prompt[:9], SamplingParams(temperature=0, max_tokens=1), max_tokens=1))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"warm": [1]}))  # 2 full blocks of the prefix are cached now
    s.add_request(_remote("a", prompt))
    (recv,) = s.schedule().kv_recv
    assert (recv.first_block, recv.num_tokens) == (2, 12)
    assert recv.block_ids == s.kv_cache.block_tables["a"][2:3]
    assert s.kv_recv_done("a") is None
    (sr,) = s.schedule().scheduled
    assert sr.start_pos == 12
    s.kv_cache.check_invariants()


@pytest.mark.parametrize("recompute", [True, False])
def test_a_failed_pull_recomputes_or_fails_and_frees_the_blocks(recompute):
    s = _scheduler()
    s.remote_kv.recompute_failed = recompute
    s.add_request(_remote("a", list(range(9))))
    s.schedule()
    failed = s.kv_recv_done("a", "producer gone")
    s.kv_cache.check_invariants()
    if recompute:
        assert failed is None
        (sr,) = s.schedule().scheduled
        assert (sr.start_pos, len(sr.token_ids)) == (0, 9)  # the whole prompt, here
    else:
        assert failed.status is RequestStatus.FINISHED_ABORTED and failed.error == "producer gone"
        assert not s.has_unfinished() and s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


def test_abort_while_receiving_keeps_the_blocks_until_the_pull_ends():
    s = _scheduler()
    s.add_request(_remote("a", list(range(9))))
    s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished()
    assert s.kv_cache.block_tables["a"]  # the connector may still be writing them
    s.kv_recv_done("a")
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    s.kv_cache.check_invariants()


def test_producer_holds_blocks_until_sent():
    s = _scheduler()
    s.add_request(Request("p", list(range(9)), SamplingParams(temperature=0, max_tokens=1), max_tokens=1,
                          kv_transfer={"do_remote_decode": True}))
    out = s.schedule()
    (done,) = s.update_from_output(out, ModelRunnerOutput({"p": [5]}))
    assert done.status is RequestStatus.FINISHED_LENGTH and not s.has_unfinished()
    (send,) = s.take_kv_sends()
    assert send.block_ids == s.kv_cache.block_tables["p"] and send.prompt_token_ids == list(range(9))
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks - 3
    s.kv_cache.check_invariants()
    s.kv_send_done("p")
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    # an aborted prefill is not held
    s.add_request(Request("q", list(range(9)), SamplingParams(temperature=0, max_tokens=1), max_tokens=1,
                          kv_transfer={"do_remote_decode": True}))
    s.schedule()
    s.finish_request("q", RequestStatus.FINISHED_ABORTED)
    assert s.take_kv_sends() == [] and s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


# ---- the connector on toy caches ---------------------------------------------------------


def _caches(num_blocks: int, quantized: str | None = None, fill: bool = False):
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, BS, 2, 8)

    def t(dtype, shp=shape):
        if not fill:
            return torch.zeros(shp, dtype=dtype)
        return (torch.randn(shp, generator=g) * 50).to(dtype)

    if quantized:
        from tokenmill.worker.model_runner import KV_STORAGE

        store = KV_STORAGE[quantized]  # as the engine keeps them (fp8: its e4m3 bits in uint8)
        return [(t(store), t(store), t(torch.float32, shape[:3]), t(torch.float32, shape[:3])) for _ in range(3)]
    return [(t(torch.float32), t(torch.float32)) for _ in range(3)]


def _pair(transport: str, quantized: str | None = None, timeout: float = 10.0):
    prod = KVConnector(KVTransferConfig("producer", transport, kv_transfer_timeout=timeout),
                       _caches(8, quantized, fill=True), BS, "L")
    cons = KVConnector(KVTransferConfig("consumer", transport, kv_transfer_timeout=timeout), _caches(8, quantized),
                       BS, "L")
    return prod, cons


def _events(conn: KVConnector, n: int = 1, timeout: float = 20.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += conn.poll()
        conn.wait(0.02)
    assert len(got) >= n, f"{len(got)} of {n} transfer events"
    return got


@pytest.mark.parametrize("transport,quantized", [("tcp", None), ("torch", None), ("tcp", "int8"), ("torch", "fp8")])
def test_connector_moves_the_blocks_bit_for_bit(transport, quantized):
    prod, cons = _pair(transport, quantized)
    try:
        prompt = list(range(11))
        prod.offer(KVSend("p", [5, 2, 7], prompt))
        host, port = prod.address
        remote = {"remote_host": host, "remote_port": port, "remote_request_id": "p"}
        cons.start_receive(KVRecv("c", [1, 6], 1, 10, prompt, remote))  # blocks 1..2 of the producer's 3
        ((kind, rid, error, rec),) = _events(cons)
        assert (kind, rid, error) == ("received", "c", None)
        for pl, cl in zip(prod.kv_caches, cons.kv_caches):
            for pt, ct in zip(pl, cl):
                assert torch.equal(ct[1], pt[2]) and torch.equal(ct[6], pt[7])
                assert not ct[0].any()  # block 0 was not asked for
        # bytes = blocks x block size x (layers x 2 x KV heads x head dim x element bytes, plus the scales)
        per_token = 3 * 2 * 2 * 8 * (1 if quantized else 4) + (3 * 2 * 2 * 4 if quantized else 0)
        assert sum(t[0].numel() * t.element_size() for layer in prod.kv_caches for t in layer) // BS == per_token
        assert rec.num_bytes == 2 * BS * per_token and rec.num_blocks == 2
        ((kind, rid, error, sent),) = _events(prod)
        assert (kind, rid, error, sent.num_bytes) == ("sent", "p", None, rec.num_bytes)
        assert not prod.pending() and not cons.pending()
    finally:
        prod.shutdown()
        cons.shutdown()


def test_refused_pulls_say_why_and_release_nothing():
    prod, cons = _pair("tcp")
    try:
        prompt = list(range(11))
        prod.offer(KVSend("p", [5, 2, 7], prompt))
        host, port = prod.address
        remote = {"remote_host": host, "remote_port": port, "remote_request_id": "p"}
        cons.start_receive(KVRecv("c1", [1], 0, 10, [9] * 11, remote))  # another prompt
        cons.start_receive(KVRecv("c2", [1], 0, 10, prompt, {**remote, "remote_request_id": "nope"}))
        errors = {rid: err for _, rid, err, _ in _events(cons, 2)}
        assert "different prompt" in errors["c1"] and "holds no KV for request 'nope'" in errors["c2"]
        assert prod.num_held() == 1  # still there for the right consumer
        cons.layout = "other"
        cons.start_receive(KVRecv("c3", [1], 0, 10, prompt, remote))
        ((_, _, err, _),) = _events(cons)
        assert "KV layout" in err and "--kv-cache-dtype" in err
        cons.start_receive(KVRecv("c4", [1], 0, 10, prompt, {"remote_host": host}))
        ((_, _, err, _),) = _events(cons)
        assert "remote_port" in err
    finally:
        prod.shutdown()
        cons.shutdown()


def test_a_consumer_dying_mid_transfer_releases_the_producers_blocks():
    prod, cons = _pair("tcp")
    try:
        prod.offer(KVSend("p", [5, 2, 7], list(range(11))))
        with socket.create_connection(prod.address, timeout=10) as sock:
            send_header(sock, {"op": "hello", "transport": "tcp"})
            assert recv_header(sock)["ok"]
            send_header(sock, {"op": "pull", "request_id": "p", "first_block": 0, "num_tokens": 10,
                               "prompt_hash": __import__("tokenmill.kv_transfer.connector", fromlist=["x"])
                               .prompt_hash(list(range(11))), "layout": "L"})
            head = recv_header(sock)
            assert head["ok"] and head["nbytes"] > 0
            sock.recv(100)  # a little of the payload, then the consumer dies
        ((kind, rid, error, _),) = _events(prod)
        assert (kind, rid) == ("sent", "p") and "went away" in error
        assert prod.num_held() == 0
    finally:
        prod.shutdown()
        cons.shutdown()


def test_unpulled_blocks_expire_and_a_dead_producer_fails_the_pull():
    prod, cons = _pair("tcp", timeout=0.3)
    try:
        prod.offer(KVSend("p", [1], list(range(3))))
        ((kind, rid, error, _),) = _events(prod)
        assert (kind, rid) == ("sent", "p") and "--kv-transfer-timeout" in error
        host, port = prod.address
        prod.shutdown()
        cons.start_receive(KVRecv("c", [1], 0, 2, list(range(3)),
                                  {"remote_host": host, "remote_port": port, "remote_request_id": "p"}))
        ((_, _, error, _),) = _events(cons)
        assert error and f"{host}:{port}" in error
    finally:
        cons.shutdown()


# ---- the real model: disaggregated outputs are colocated outputs ----------------------------

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a dragon who",
           "Question: what is 12 times 12? Answer:"]


def _run(engine: LLMEngine, rid: str, prompt, params=GREEDY, **kw):
    engine.add_request(prompt, params, rid, **kw)
    while True:
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out


def _settle(*engines: LLMEngine, timeout: float = 20.0) -> None:
    """Step each engine until its transfers are seen through; then nothing is held and nothing leaked."""
    deadline = time.monotonic() + timeout
    for e in engines:
        while e.has_unfinished_requests() and time.monotonic() < deadline:
            e.step()
        assert not e.has_unfinished_requests()
        e.kv_cache.check_invariants()
        assert not e.kv_cache.block_tables, f"blocks still held: {list(e.kv_cache.block_tables)}"


def _disaggregated(prod: LLMEngine, cons: LLMEngine, rid: str, prompt, params=GREEDY):
    first = _run(prod, f"p-{rid}", prompt, SamplingParams(temperature=0, max_tokens=1),
                 kv_transfer_params={"do_remote_decode": True})
    host, port = prod.info.kv_address
    out = _run(cons, rid, prompt, params, kv_transfer_params={
        "do_remote_prefill": True, "remote_host": host, "remote_port": port, "remote_request_id": f"p-{rid}"})
    assert out.outputs[0].token_ids[0] == first.outputs[0].token_ids[0]
    return out


def _transfers(engine: LLMEngine, direction: str) -> list:
    return [t for s in engine.step_stats for t in (s.kv_transfers or ()) if t.direction == direction]


PAIRS = {  # name: (engine flags of both sides, transport)
    "default-tcp": (dict(), "tcp"),
    "float-torch-noprefix": (dict(quantization="none", dtype="float32", enable_prefix_caching=False), "torch"),
    "int8kv-tcp": (dict(kv_cache_dtype="int8"), "tcp"),
}


@pytest.fixture(scope="module")
def pairs():
    made: dict = {}

    def get(name: str):
        if name not in made:
            flags, transport = PAIRS[name]
            kw = dict(kv_cache_memory="64MiB", max_model_len=2048, **flags)
            made[name] = tuple(LLMEngine(EngineConfig.from_kwargs(kv_role=role, kv_transport=transport, **kw))
                               for role in ("producer", "consumer"))
        return made[name]

    yield get
    for engines in made.values():
        for e in engines:
            e.shutdown()


@pytest.fixture(scope="module")
def int8_colocated():
    from tokenmill import LLM

    llm = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB", max_model_len=2048, kv_cache_dtype="int8")
    yield llm
    llm.engine.shutdown()


@pytest.mark.parametrize("name", list(PAIRS))
def test_disaggregated_greedy_equals_colocated(name, pairs, llm_default, llm_fp32, int8_colocated):
    prod, cons = pairs(name)
    flags = PAIRS[name][0]
    colocated = (llm_fp32 if flags.get("quantization") == "none" else
                 int8_colocated if "kv_cache_dtype" in flags else llm_default)
    refs = colocated.generate(PROMPTS, GREEDY, use_tqdm=False)
    for i, (prompt, ref) in enumerate(zip(PROMPTS, refs)):
        out = _disaggregated(prod, cons, f"{name}-{i}", prompt)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, (name, prompt)
    got = _transfers(cons, "recv")
    assert len(got) == len(PROMPTS) and all(t.error is None for t in got)
    # bytes per token = layers x 2 x KV heads x head dim x bytes per element, + int8's float32 scales
    cfg = cons.model_config
    elem = 1 if "kv_cache_dtype" in flags else 4
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    per_token += cfg.num_layers * 2 * cfg.num_kv_heads * 4 if elem == 1 else 0
    bs = cons.info.block_size
    for t, prompt in zip(got, PROMPTS):
        n = len(cons.tokenizer.encode(prompt)) - 1  # the last prompt token is computed on the consumer
        assert t.num_blocks == -(-n // bs) and t.num_bytes == t.num_blocks * bs * per_token
    _settle(prod, cons)


def test_a_cached_prefix_on_the_consumer_is_not_sent_again(pairs, llm_default):
    prod, cons = pairs("default-tcp")
    system = "You are a helpful assistant who answers in one short sentence. " * 3
    a, b = system + "What is the sun?", system + "What is the moon?"
    _disaggregated(prod, cons, "pc-a", a)
    before = len(_transfers(cons, "recv"))
    out = _disaggregated(prod, cons, "pc-b", b)
    t = _transfers(cons, "recv")[before]
    n = len(cons.tokenizer.encode(b)) - 1
    bs = cons.info.block_size
    assert 0 < t.num_blocks < -(-n // bs)  # the shared system prompt's blocks were cached here
    ref = llm_default.generate([b], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    _settle(prod, cons)


def test_a_dead_producer_is_recomputed_on_the_consumer(pairs, llm_default):
    _, cons = pairs("default-tcp")
    prod = LLMEngine(EngineConfig.from_kwargs(kv_role="producer", kv_cache_memory="64MiB", max_model_len=2048))
    prompt = PROMPTS[1]
    _run(prod, "dead-p", prompt, SamplingParams(temperature=0, max_tokens=1),
         kv_transfer_params={"do_remote_decode": True})
    host, port = prod.info.kv_address
    prod.shutdown()  # gone after the prefill, with the blocks it held
    out = _run(cons, "dead", prompt, GREEDY, kv_transfer_params={
        "do_remote_prefill": True, "remote_host": host, "remote_port": port, "remote_request_id": "dead-p"})
    ref = llm_default.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert _transfers(cons, "recv")[-1].error is not None
    # the next request, through a live producer, is pulled as usual
    live, _ = pairs("default-tcp")
    again = _disaggregated(live, cons, "after-dead", prompt)
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids
    assert _transfers(cons, "recv")[-1].error is None
    _settle(live, cons)


def test_a_producer_core_in_its_own_process(pairs, llm_default):
    """The server's default layout: the producer's engine core in a process of its own, whose state tells
    the front end when the held blocks are gone."""
    _, cons = pairs("default-tcp")
    prod = LLMEngine(EngineConfig.from_kwargs(kv_role="producer", kv_cache_memory="64MiB", max_model_len=2048),
                     core_process=True)
    try:
        out = _disaggregated(prod, cons, "own-process", PROMPTS[2])
        ref = llm_default.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        deadline = time.monotonic() + 20
        while prod.has_unfinished_requests():  # until the core reports the sent blocks freed
            prod.step()
            assert time.monotonic() < deadline
        assert prod.state.num_kv_held == 0 and prod.state.num_free_blocks == prod.info.num_blocks
        prod.check_invariants()
    finally:
        prod.shutdown()
    _settle(cons)


def test_bad_kv_transfer_params_are_refused(pairs):
    prod, cons = pairs("default-tcp")
    with pytest.raises(InvalidParameter, match="--kv-role producer"):
        cons.add_request("hi", SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(InvalidParameter, match="--kv-role consumer"):
        prod.add_request("hi", SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(InvalidParameter, match="max_tokens 1"):
        prod.add_request("hi", SamplingParams(max_tokens=5), kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(InvalidParameter, match="remote_request_id"):
        cons.add_request("hi", SamplingParams(max_tokens=5),
                         kv_transfer_params={"do_remote_prefill": True, "remote_host": "h", "remote_port": 1})
    with pytest.raises(ValueError, match="--kv-role must be one of"):
        KVTransferConfig("prefill")
    with pytest.raises(ValueError, match="--kv-transport"):
        KVTransferConfig("producer", "rdma")
    _settle(prod, cons)


# ---- real HTTP servers behind the router ---------------------------------------------------


def _prom(url: str, name: str, **labels) -> float:
    """The sum of a metric's samples on ``url``/metrics whose labels include ``labels``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _wait_for(fn, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster():
    """A producer and a consumer, each a real OpenAI server on loopback, and a router in front."""
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.router import Router, build_router_app
    from tokenmill.server.app import build_app
    from tokenmill.server.run import BackgroundServer
    from tokenmill.server.serving import ServerConfig
    from tests.helpers import free_port

    servers = {}
    for role in ("producer", "consumer"):
        engine = LLMEngine(EngineConfig.from_kwargs(kv_role=role, kv_cache_memory="64MiB", max_model_len=2048,
                                                    kv_transfer_timeout=3.0))
        ae = AsyncEngine(engine, log_interval=None)
        servers[role] = BackgroundServer(build_app(ae, ServerConfig())).start()
        servers[role].engine = engine
    dead = f"http://127.0.0.1:{free_port()}"
    router = Router([dead, servers["producer"].url], [dead, servers["consumer"].url], poll_interval=3600)
    front = BackgroundServer(build_router_app(router)).start()
    front.router, front.dead = router, dead
    yield servers, front
    front.stop(30)
    for srv in servers.values():
        srv.stop(30)
        srv.engine.kv_cache.check_invariants()
        assert not srv.engine.kv_cache.block_tables, "KV blocks leaked"


def test_router_serves_colocated_outputs_and_retries_dead_instances(cluster, llm_default):
    import openai

    servers, front = cluster
    router = front.router
    # the first poll found the dead instances down; say they are up, so the first leg of each tries one
    _wait_for(lambda: _prom(front.url, "tokenmill:router_instance_up", instance=front.dead) == 0)
    for inst in router.prefill + router.decode:
        inst.up = True
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=120)
    prompt = PROMPTS[1]
    out = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=12, temperature=0)
    ref = llm_default.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.choices[0].text == ref.outputs[0].text
    assert _prom(front.url, "tokenmill:router_retries_total") == 2  # one per leg: each tried the dead one first
    assert _prom(front.url, "tokenmill:router_instance_up", instance=front.dead) == 0
    # a streamed chat: one ordinary stream, the colocated text
    chat = [{"role": "user", "content": "Name three colors."}]
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=chat, max_tokens=16,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == llm_default.chat(chat, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    assert _prom(front.url, "tokenmill:router_time_to_first_token_seconds_count") == 1
    assert _prom(front.url, "tokenmill:router_prefill_seconds_count") == 2
    # every byte the producer sent, the consumer received; nothing stays held or reserved
    prod, cons = servers["producer"].url, servers["consumer"].url
    _wait_for(lambda: _prom(prod, "tokenmill:num_requests_kv_held") == 0
              and _prom(prod, "vllm:kv_cache_usage_perc") == 0 and _prom(cons, "vllm:kv_cache_usage_perc") == 0)
    sent = _prom(prod, "tokenmill:kv_transfer_bytes_total", direction="send")
    assert sent > 0 and sent == _prom(cons, "tokenmill:kv_transfer_bytes_total", direction="recv")
    assert _prom(cons, "tokenmill:kv_transfer_seconds_count", direction="recv") == 2
    assert _prom(cons, "tokenmill:num_requests_waiting_for_kv") == 0


def test_router_passes_client_errors_through_and_says_when_no_instance_answers(cluster):
    import httpx

    from tokenmill.server.router import Router, build_router_app
    from tokenmill.server.run import BackgroundServer

    servers, front = cluster
    prod = servers["producer"].url
    failed = _prom(prod, "tokenmill:kv_transfer_failures_total", direction="send")
    r = httpx.post(front.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.text  # the consumer's refusal, as it is
    # the prefill leg went through and its blocks wait for a pull that never comes, until the timeout
    _wait_for(lambda: _prom(prod, "tokenmill:kv_transfer_failures_total", direction="send") == failed + 1)
    _wait_for(lambda: _prom(prod, "tokenmill:num_requests_kv_held") == 0 and _prom(prod, "vllm:kv_cache_usage_perc") == 0)
    # a colocated server is not a producer: its refusal says what to start it with
    r = httpx.post(servers["consumer"].url + "/v1/completions",
                   json={"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--kv-role producer" in r.text
    lonely = BackgroundServer(build_router_app(Router([front.dead], [servers["consumer"].url]))).start()
    try:
        r = httpx.post(lonely.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 503 and "no prefill instance answered" in r.text
        assert httpx.get(lonely.url + "/health").status_code == 503
    finally:
        lonely.stop(30)


def test_a_client_leaving_mid_stream_frees_the_consumers_blocks(cluster):
    import httpx

    servers, front = cluster
    cons, prod = servers["consumer"].url, servers["producer"].url
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", front.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = r.iter_lines()
        got = [next(chunks) for _ in range(6)]  # a few tokens streamed, then the client goes
        assert any(line.startswith("data: {") for line in got)
    _wait_for(lambda: _prom(cons, "vllm:num_requests_running") == 0 and _prom(cons, "vllm:kv_cache_usage_perc") == 0
              and _prom(prod, "tokenmill:num_requests_kv_held") == 0)
    assert _prom(cons, "vllm:request_success_total", finished_reason="abort") >= 1
    servers["consumer"].engine.check_invariants()


def test_the_router_picks_the_least_loaded_instance_and_round_robins_ties():
    from tokenmill.server.router import Router

    r = Router(["http://a", "http://b", "http://c"], ["http://d"])
    a, b, c = r.prefill
    a.load, b.load, c.load = 3, 1, 1
    b.inflight = 1  # the router's own requests count too: c is now the least loaded
    assert r.pick(r.prefill, set()) is c
    b.inflight = 0
    picks = {r.pick(r.prefill, set()).url for _ in range(4)}
    assert picks == {"http://b", "http://c"}  # equal load: taken in turn, never the busier a
    c.up = False  # a down instance only when nothing else is left
    assert r.pick(r.prefill, set()) is b and r.pick(r.prefill, {b}) is a and r.pick(r.prefill, {a, b}) is c
    assert r.pick(r.prefill, {a, b, c}) is None
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        Router([], ["http://d"])
