"""The server under failure: overload (503), engine death (500, /health 503), SIGTERM drain, disconnects.

These run the real LLMEngine code (scheduler, KV cache, output processor) with the model replaced
by a fake runner that emits a fixed cycle of tokens after a short sleep, and a tiny tokenizer,
so they start in a second and can make the engine slow, fill its queue or kill it on purpose.
Run as a script (``python tests/test_server_failures.py serve ARGS...``) it serves such an engine
through the real ``tokenmill serve`` flag parsing, for the SIGTERM test.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tokenmill.config import EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.assembly import make_scheduler
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.streams import EngineDrainingError, QueueFullError
from tokenmill.engine.core import CoreParts, EngineCore
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.messages import CoreInfo
from tokenmill.structured_output import GrammarCompiler
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.app import ServerConfig, build_app
from tokenmill.server.run import BackgroundServer
from tokenmill.tokenizer import Tokenizer

from helpers import free_port, wait_healthy

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["the cat sat on the mat and the dog sat on the log"] * 8, trainer)
    return Tokenizer(hf, bos_token_id=None, eos_token_id=hf.token_to_id("<|im_end|>"), chat_template=CHAT_TEMPLATE)


class FakeRunner:
    """Stands in for ModelRunner: one token per request that needs one, after `delay` seconds."""

    def __init__(self, tokens: list[int], delay: float) -> None:
        self.tokens, self.delay = tokens, delay
        self.fail: BaseException | None = None  # set to make the next step raise

    def execute(self, sched) -> ModelRunnerOutput:  # noqa: ANN001
        if self.fail is not None:
            raise self.fail
        self.forward_s = 0.0
        if sched.scheduled:
            t = time.perf_counter()
            time.sleep(self.delay)
            self.forward_s = time.perf_counter() - t  # the "forward pass"
        return ModelRunnerOutput({s.request_id: [self.tokens[(s.start_pos + len(s.token_ids)) % len(self.tokens)]]
                                  for s in sched.scheduled if s.needs_logits})


def fake_engine(*, num_blocks: int = 256, block_size: int = 16, max_model_len: int = 1024, max_num_seqs: int = 64,
                delay: float = 0.01, tokenizer: Tokenizer | None = None, scheduler: SchedulerConfig | None = None,
                cost=None) -> LLMEngine:  # noqa: ANN001
    """An LLMEngine whose model is a FakeRunner; everything else is the real engine code. With a
    ``scheduler`` config that sets latency targets, ``cost`` (StepShape -> seconds) is its planner's model."""
    tok = tokenizer or tiny_tokenizer()
    config = EngineConfig(scheduler=scheduler or SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096))
    model_config = ModelConfig("llama", tok.vocab_size, 64, 128, 2, 4, 2, 16, max_model_len)
    kv_cache = KVCacheManager(num_blocks, block_size)
    sched = make_scheduler(config.scheduler, kv_cache, max_model_len, cost)
    runner = FakeRunner(tok.encode(" the cat sat on the mat and the dog"), delay)
    info = CoreInfo("fake", "fake", model_config, max_model_len, "float32", "none", num_blocks, block_size, 0, False,
                    config)
    parts = CoreParts(model_config, tok, max_model_len, kv_cache, sched, runner, GrammarCompiler(tok, tok.vocab_size),
                      info)
    return LLMEngine.from_core(EngineCore(config, parts))


@contextlib.contextmanager
def running(engine: LLMEngine | None = None, *, max_waiting: int | None = None, **config):
    engine = engine or fake_engine()
    ae = AsyncEngine(engine, max_waiting_requests=max_waiting, log_interval=None, log_requests=False)
    srv = BackgroundServer(build_app(ae, ServerConfig(**config))).start()
    try:
        yield srv, ae, engine
    finally:
        srv.stop(30)
        ae.shutdown()


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_no_leak(ae: AsyncEngine, engine: LLMEngine) -> None:
    wait_for(lambda: ae.snapshot.num_open_streams == 0 and not engine.has_unfinished_requests(), 10, "idle engine")
    wait_for(lambda: engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, 10, "all KV blocks free")
    if ae.is_running:
        ae.call_soon(engine.kv_cache.check_invariants).result(10)
    else:
        engine.kv_cache.check_invariants()


def sse_events(lines) -> list:  # noqa: ANN001
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_body(**kw) -> dict:
    return {"prompt": "the cat", "max_tokens": 400, "stream": True, **kw}


# ---- AsyncEngine on its own -------------------------------------------------------------------


def test_async_engine_generate_and_early_exit_aborts():
    engine = fake_engine(delay=0.005)
    ae = AsyncEngine(engine, log_interval=None, log_requests=False).start()

    async def main():
        outs = [o async for o in ae.generate("the cat", SamplingParams(max_tokens=5), "a")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        with pytest.raises(ValueError, match="prompt is empty"):  # validation errors reach the caller
            await ae.add_request("", SamplingParams(), "b")
        with pytest.raises(ValueError, match="already in use"):
            s1 = await ae.add_request("the", SamplingParams(max_tokens=300), "c")
            await ae.add_request("the", SamplingParams(max_tokens=300), "c")
        s1.abort()
        agen = ae.generate("the dog", SamplingParams(max_tokens=300), "d")
        async for out in agen:  # leave after the first token: the finally aborts
            break
        await agen.aclose()

    asyncio.run(main())
    assert_no_leak(ae, engine)
    ae.shutdown()
    assert not ae.is_running


def test_async_engine_queue_bound_and_draining():
    engine = fake_engine(max_num_seqs=1, delay=0.02)
    ae = AsyncEngine(engine, max_waiting_requests=2, log_interval=None, log_requests=False).start()

    async def main():
        first = await ae.add_request("the", SamplingParams(max_tokens=300), "r0")
        await first.__anext__()  # running now
        waiting = [await ae.add_request("the", SamplingParams(max_tokens=300), f"r{i}") for i in (1, 2)]
        with pytest.raises(QueueFullError, match="max-waiting-requests"):
            await ae.add_request("the", SamplingParams(max_tokens=3), "r3")
        ae.stop_accepting()
        with pytest.raises(EngineDrainingError):
            await ae.add_request("the", SamplingParams(max_tokens=3), "r4")
        for s in [first, *waiting]:
            s.abort()

    asyncio.run(main())
    assert_no_leak(ae, engine)
    ae.shutdown()


def test_request_and_periodic_stats_log_lines(caplog):
    caplog.set_level(logging.INFO, logger="tokenmill")
    engine = fake_engine(delay=0.02)
    ae = AsyncEngine(engine, log_interval=0.05).start()

    async def main():
        return [o async for o in ae.generate("the cat", SamplingParams(max_tokens=6), "req-1")][-1]

    out = asyncio.run(main())
    ae.shutdown()
    lines = [r.getMessage() for r in caplog.records]
    done = [ln for ln in lines if ln.startswith("request req-1 finished")]
    assert len(done) == 1
    n_prompt = len(out.prompt_token_ids)
    assert f"finished (length): prompt {n_prompt} tokens, output 6 tokens" in done[0]
    assert "TTFT 0." in done[0] and "TPOT 0." in done[0] and "e2e" in done[0]
    stats = [ln for ln in lines if ln.startswith("engine: ")]
    assert stats and "generation tokens/s" in stats[0] and "running" in stats[0] and "KV cache" in stats[0]
    assert "device busy" in stats[0] and "engine CPU" in stats[0]  # the fake's sleep counts as its forward pass


# ---- overload ------------------------------------------------------------------------------------


def test_overload_gets_503_and_recovers():
    with running(fake_engine(max_num_seqs=1, delay=0.02), max_waiting=2) as (srv, ae, engine):
        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(httpx.Client(base_url=srv.url, timeout=30)) for _ in range(3)]
            first = stack.enter_context(clients[0].stream("POST", "/v1/completions", json=stream_body()))
            first_lines = first.iter_lines()  # keep a reference: dropping the iterator closes the stream
            next(first_lines)  # it runs
            for c in clients[1:]:
                r = stack.enter_context(c.stream("POST", "/v1/completions", json=stream_body()))
                assert r.status_code == 200
            wait_for(lambda: ae.snapshot.num_waiting == 2, what="2 waiting")
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "the", "max_tokens": 2})
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["code"] == "overloaded" and "max-waiting-requests" in err["message"]
            assert r.headers["retry-after"] == "1"
            r = httpx.post(srv.url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert r.status_code == 503
        assert_no_leak(ae, engine)  # the streams were dropped: all aborted
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "the", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- disconnects -------------------------------------------------------------------------------


def test_disconnect_frees_blocks_within_one_step():
    with running(fake_engine(delay=0.1)) as (srv, ae, engine):
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=stream_body(prompt="the cat " * 40)) as r:
                lines = r.iter_lines()
                next(lines)
                assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks
                steps_at_close = ae.snapshot.num_steps
        wait_for(lambda: engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, 5, "blocks freed")
        # the step running at the disconnect may finish; the abort is applied before the next one
        assert ae.snapshot.num_steps - steps_at_close <= 2
        assert_no_leak(ae, engine)


def test_many_disconnects_under_load_free_every_block():
    with running(fake_engine(delay=0.01)) as (srv, ae, engine):
        def stream_then_leave(i: int) -> None:
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                with c.stream("POST", "/v1/completions", json=stream_body(prompt="the cat " * (i % 7 + 1))) as r:
                    for k, _ in enumerate(r.iter_lines()):
                        if k >= i % 3:
                            break

        def post_then_leave(i: int) -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", json={"prompt": "the dog", "max_tokens": 400}, timeout=0.3)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(stream_then_leave, range(48)))
            list(pool.map(post_then_leave, range(8)))
        assert_no_leak(ae, engine)
        snap = httpx.get(srv.url + "/metrics").text
        aborted = [ln for ln in snap.splitlines() if ln.startswith('vllm:request_success_total{finished_reason="abort"')]
        assert float(aborted[0].split()[-1]) == 56


def test_a_thousand_abandoned_streams_leave_nothing_behind():
    """1,000 streaming clients leaving at random points -- a quarter before the first token -- then no
    KV block is referenced, the KV cache's invariants hold, and the next request succeeds."""
    import random

    with running(fake_engine(delay=0.002, max_num_seqs=64), max_waiting=2000) as (srv, ae, engine):
        rng = random.Random(0)
        plan = [(rng.random() < 0.25, rng.randint(1, 6), rng.choice(["/v1/completions", "/v1/chat/completions"]))
                for _ in range(1000)]

        def leave(step: tuple[bool, int, str]) -> None:
            early, n, path = step
            body = stream_body() if path == "/v1/completions" else {
                "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 400, "stream": True}
            with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                if early:
                    return  # gone before the first token
                for k, _ in enumerate(r.iter_lines()):
                    if k >= n:
                        break

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(leave, plan))
        assert_no_leak(ae, engine)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "the", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_slow_body_gets_408_and_the_server_keeps_serving():
    """Slowloris: headers, then a body that trickles in slower than --request-body-timeout allows."""
    import socket

    with running(request_body_timeout=0.5) as (srv, ae, engine):
        body = json.dumps({"prompt": "the cat", "max_tokens": 2}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
            t0 = time.monotonic()
            # meanwhile the server answers others
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "the", "max_tokens": 2})
            assert r.status_code == 200
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
            assert time.monotonic() - t0 < 5
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        err = json.loads(payload)["error"]
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "the", "max_tokens": 2})
        assert r.status_code == 200
        assert_no_leak(ae, engine)


def test_one_requests_template_or_tokenizer_failure_fails_it_alone():
    """A chat template that raises on one conversation, and a tokenizer that raises on one prompt: that
    request gets a 400 naming messages/prompt, the streams running beside it finish, the next succeeds."""
    tiny = tiny_tokenizer()

    class Fragile(Tokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            if "BOOM" in text:
                raise RuntimeError("the tokenizer broke")
            return super().encode(text, add_special_tokens)

    template = ("{% for m in messages %}{% if m['content'] == 'explode' %}{{ raise_exception('no such thing') }}"
                "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    tok = Fragile(tiny.hf, bos_token_id=None, eos_token_id=tiny.eos_token_id, chat_template=template)
    with running(fake_engine(tokenizer=tok)) as (srv, ae, engine), httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=stream_body(max_tokens=20)) as beside:
            lines = beside.iter_lines()
            next(lines)
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "explode"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "no such thing" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"prompt": "BOOM", "max_tokens": 2})
            assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == "prompt", r.text
            events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "the cat"}],
                                                 "max_tokens": 2})
        assert r.status_code == 200
        assert_no_leak(ae, engine)


# ---- engine death ------------------------------------------------------------------------------


def test_engine_death_fails_in_flight_requests_and_health():
    with running(fake_engine(delay=0.02)) as (srv, ae, engine):
        with httpx.Client(base_url=srv.url, timeout=30) as c, ThreadPoolExecutor(1) as pool:
            with c.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                pending = pool.submit(httpx.post, srv.url + "/v1/completions",
                                      json={"prompt": "the", "max_tokens": 400}, timeout=30)
                wait_for(lambda: ae.snapshot.num_running == 2, what="both running")
                engine.runner.fail = RuntimeError("simulated GPU fault")
                events = sse_events(lines)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "engine_dead" and "simulated GPU fault" in events[-2]["error"]["message"]
            r = pending.result(10)
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
            r = c.post("/v1/completions", json={"prompt": "the", "max_tokens": 2})
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
            assert c.get("/metrics").status_code == 200  # still scrapeable
        assert not ae.healthy and isinstance(ae.error, RuntimeError)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # freed on the way down


# ---- draining ------------------------------------------------------------------------------


def test_drain_finishes_in_flight_and_refuses_new():
    with running(fake_engine(delay=0.02), drain_timeout=20) as (srv, ae, engine):
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=stream_body(max_tokens=40)) as r:
                lines = r.iter_lines()
                next(lines)
                srv.signal_exit()  # what SIGTERM does
                with httpx.Client(base_url=srv.url, timeout=5) as other:
                    h = other.get("/health")
                    assert h.status_code == 503 and h.json()["error"]["code"] == "draining"
                    n = other.post("/v1/completions", json={"prompt": "the", "max_tokens": 2})
                    assert n.status_code == 503 and n.json()["error"]["code"] == "draining"
                events = sse_events(lines)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        srv.thread.join(20)
        assert not srv.thread.is_alive() and not ae.is_running
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_drain_timeout_aborts_what_is_left():
    with running(fake_engine(delay=0.02), drain_timeout=0.5) as (srv, ae, engine):
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=stream_body(max_tokens=1000)) as r:
                lines = r.iter_lines()
                next(lines)
                t0 = time.monotonic()
                srv.signal_exit()
                events = sse_events(lines)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
        srv.thread.join(20)
        assert not srv.thread.is_alive() and time.monotonic() - t0 < 10
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_sigterm_drains_and_exits_cleanly(tmp_path):
    """A real process: `tokenmill serve` flags, TOKENMILL_API_KEY, SIGTERM mid-stream, exit code 0."""
    port = free_port()
    env = {**os.environ, "TOKENMILL_API_KEY": "sekrit"}
    proc = subprocess.Popen([sys.executable, __file__, "serve", "--port", str(port), "--drain-timeout", "20",
                             "--uvicorn-log-level", "warning"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 90)
        assert httpx.post(url + "/v1/completions", json={"prompt": "the"}).status_code == 401
        headers = {"Authorization": "Bearer sekrit"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=stream_body(max_tokens=30)) as r:
                lines = r.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    from tokenmill.cli import build_parser
    from tokenmill.server.run import serve_args

    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(sys.argv[1:])
    sys.exit(serve_args(fake_engine(delay=0.02), args))
