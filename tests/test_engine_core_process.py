"""The engine core in its own process (--engine-core-process, the server's default): the same outputs
as in one process, and the failure behaviour -- a step that raises, the core SIGKILLed, the server
SIGKILLed -- on real `tokenmill serve` processes with the real default model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.models.registry import DEFAULT_MODEL
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

from helpers import free_port, step_until_done, wait_healthy

pytestmark = pytest.mark.slow

ENGINE = dict(kv_cache_memory="256MiB", max_model_len=2048)


def _requests() -> list[tuple[str, SamplingParams]]:
    return [
        ("The capital of France is", SamplingParams(max_tokens=24, temperature=0, logprobs=2, prompt_logprobs=1)),
        ("Count: one, two,", SamplingParams(max_tokens=40, temperature=0, stop=["six"])),
        ("Write a haiku about tea.", SamplingParams(max_tokens=20, temperature=0.8, seed=7, n=2)),
        ("Is the sky blue? Answer:", SamplingParams(max_tokens=8, temperature=0, logit_bias={13: -5.0},
                                                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))),
    ]


def _run(engine: LLMEngine) -> dict:
    for i, (prompt, params) in enumerate(_requests()):
        engine.add_request(prompt, params, request_id=str(i))
    return step_until_done(engine)


def test_core_process_gives_the_in_process_outputs(llm_default):
    remote = LLMEngine(EngineConfig.from_kwargs(model=DEFAULT_MODEL, measure_roofline=True, **ENGINE), core_process=True)
    try:
        assert remote.core.process.is_alive() and remote.core.process.pid != os.getpid()
        got, want = _run(remote), _run(llm_default.engine)
        assert sorted(got) == sorted(want) == ["0", "1", "2", "3"]
        for rid in want:
            for g, w in zip(got[rid].outputs, want[rid].outputs, strict=True):
                assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
                       (w.token_ids, w.text, w.finish_reason, w.stop_reason)
                assert g.logprobs == w.logprobs
            assert got[rid].prompt_logprobs == want[rid].prompt_logprobs
            m = got[rid].metrics[0]
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert got["1"].outputs[0].finish_reason == "stop" and got["1"].outputs[0].stop_reason == "six"
        assert got["3"].outputs[0].text in ("yes", "no")
        # an abort mid-run frees everything in the other process too
        remote.add_request("Tell me a long story.", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), "long")
        while not remote.step():
            pass
        # the dashboard's table from the other process: asked for, answered with the next message
        assert remote.request_table()[0]["id"] == "long"  # before the answer: what this side knows
        deadline = time.monotonic() + 10
        while not remote._progress and time.monotonic() < deadline:
            remote.step()
        row = remote.request_table()[0]
        assert row["state"] == "decode" and row["computed_tokens"] >= row["prompt_tokens"] > 0
        # the step's phases, FLOPs and bytes and the device's roofline cross the wire too
        stats = remote.step_stats[-1]
        assert stats.forward_s > 0 and stats.flops > 0 and stats.bytes > 0
        assert remote.info.roofline.peak_flops > 0 and remote.core_pid == remote.core.process.pid
        out = remote.abort_request("long")
        assert out.finished and out.outputs[0].finish_reason == "abort"
        remote.check_invariants()
        assert remote.state.num_free_blocks == remote.info.num_blocks and not remote.has_unfinished_requests()
        with pytest.raises(RuntimeError, match="--engine-core-process"):
            remote.score([1, 2, 3])
    finally:
        remote.shutdown()
    assert not remote.core.process.is_alive()


def test_the_api_process_loads_no_torch():
    """With the core in its own process the server's process holds the tokenizer, not the model or torch."""
    code = ("import sys\n"
            "from tokenmill.config import EngineConfig\n"
            "from tokenmill.engine.llm_engine import LLMEngine\n"
            "import tokenmill.server.run\n"
            "if __name__ == '__main__':\n"
            "    e = LLMEngine(EngineConfig.from_kwargs(kv_cache_memory='64MiB'), core_process=True)\n"
            "    e.add_request('Hi', None, 'a')\n"
            "    while e.has_unfinished_requests():\n"
            "        e.step()\n"
            "    e.shutdown()\n"
            "    assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_core_info_crosses_the_wire_with_rope_factors():
    """Llama 3 GGUFs carry RoPE frequency factors as a tensor in the model config; CoreReady must still
    encode (as lists) and decode to the same config."""
    import torch

    from tokenmill.config import ModelConfig
    from tokenmill.engine.messages import CoreInfo, CoreReady, from_core_decoder, from_core_encoder, plain_info

    cfg = ModelConfig("llama", 100, 64, 128, 2, 4, 2, 16, 256,
                      rope_scaling={"rope_type": "freq_factors", "factors": torch.tensor([1.0, 2.0, 4.0])})
    info = CoreInfo("m", "m.gguf", cfg, 256, "float32", "gguf", 10, 16, 1024)
    got = from_core_decoder.decode(from_core_encoder.encode(CoreReady(plain_info(info), 1))).info
    assert got.model_config.rope_scaling == {"rope_type": "freq_factors", "factors": [1.0, 2.0, 4.0]}
    assert dataclasses.replace(got.model_config, rope_scaling=None) == dataclasses.replace(cfg, rope_scaling=None)


def test_a_bad_model_fails_startup_with_its_own_message(tmp_path):
    bad = tmp_path / "missing.gguf"
    with pytest.raises(ValueError, match="missing.gguf"):
        LLMEngine(EngineConfig.from_kwargs(model=str(bad)), core_process=True)


# ---- real servers ---------------------------------------------------------------------------


@contextlib.contextmanager
def serve(*flags: str, env: dict | None = None):
    port = free_port()
    # its own session: a signal to the group reaches the server and its core as a terminal's would
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
                             "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--uvicorn-log-level",
                             "warning", "--disable-log-requests", *flags],
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _core_pid(proc: subprocess.Popen) -> int:
    # (multiprocessing's resource tracker is the other child; it exits when its pipe closes)
    kids = [k for k in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(k.cmdline())]
    assert len(kids) == 1, kids  # the engine core
    return kids[0].pid


def _gone(pid: int, timeout: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def _stream(url: str, results: list, started: threading.Event | None = None) -> None:
    """One streaming completion; appends its SSE events (or the HTTP error) to results."""
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": "Tell me a long story about a lighthouse.", "max_tokens": 300, "stream": True,
                "ignore_eos": True}) as r:
            if r.status_code != 200:
                results.append(("status", r.status_code))
                return
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                    if started is not None and len(events) == 2:
                        started.set()
            results.append(("events", events))
    except httpx.HTTPError as e:
        results.append(("transport", repr(e)))


def _health_503_within(url: str, seconds: float, proc: subprocess.Popen) -> float:
    """Seconds until /health stops answering 200 (503, or the server gone)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            code = httpx.get(url + "/health", timeout=1).status_code
        except httpx.TransportError:
            code = None
        if code != 200:
            assert code in (503, None)
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"/health still 200 after {seconds} s")


def _assert_failed_cleanly(results: list) -> None:
    """Every stream ended with an OpenAI-shaped error event and then [DONE]."""
    assert results
    for kind, events in results:
        assert kind == "events", (kind, events)
        assert events[-1] == "[DONE]", events[-3:]
        err = events[-2]["error"]
        assert err["code"] == "engine_dead" and err["type"] and err["message"], err


def test_fault_in_a_step_fails_every_request_and_the_server_exits():
    with serve(env={"TOKENMILL_FAULT_AT_STEP": "12"}) as (proc, url):
        core = _core_pid(proc)
        results: list = []
        threads = [threading.Thread(target=_stream, args=(url, results)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        _assert_failed_cleanly(results)
        assert any("fault injected at engine step 12" in e[-2]["error"]["message"] for _, e in results)
        _health_503_within(url, 1.0, proc)
        assert proc.wait(15) == 1  # --exit-on-engine-death (default): a supervisor restarts it
        assert _gone(core, 5), "the engine core outlived its server"


def _kill_core_mid_stream(url: str, core: int) -> tuple[list, float]:
    """SIGKILL the core while a stream runs; the stream must end cleanly with an error. Returns the
    stream's results and when the core was killed."""
    results: list = []
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(url, results, started))
    t.start()
    assert started.wait(60)
    os.kill(core, signal.SIGKILL)
    t0 = time.monotonic()
    t.join(30)
    _assert_failed_cleanly(results)
    return results, t0


def test_sigkill_of_the_core_fails_in_flight_requests_and_the_server_exits():
    with serve() as (proc, url):
        core = _core_pid(proc)
        results, t0 = _kill_core_mid_stream(url, core)
        assert "exited" in results[0][1][-2]["error"]["message"]
        assert time.monotonic() - t0 + _health_503_within(url, 1.0, proc) < 2.0
        assert proc.wait(15) == 1


def test_restart_flag_brings_a_fresh_core_and_keeps_serving():
    with serve("--restart-engine-core") as (proc, url):
        core = _core_pid(proc)
        _kill_core_mid_stream(url, core)
        _health_503_within(url, 1.0, proc)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "no fresh core"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert _core_pid(proc) != core and _gone(core, 1)


def test_sigterm_to_the_process_group_drains_then_stops_the_core(tmp_path):
    """Ctrl-C or SIGTERM from a terminal or supervisor reach the whole group: the core must outlive it while
    the server drains, finish the stream in flight, then go. (With --step-log: the steps' shapes cross from
    the core process and are written.)"""
    from tokenmill.engine.step_log import read_step_log

    # a drain long enough for any machine: this holds what a drain does, not how fast the stream runs
    with serve("--step-log", str(tmp_path / "steps.jsonl"), "--drain-timeout", "600") as (proc, url):
        core = _core_pid(proc)
        results: list = []
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(url, results, started))
        t.start()
        assert started.wait(60)
        os.killpg(proc.pid, signal.SIGTERM)
        t.join(600)
        kind, events = results[0]
        assert kind == "events" and events[-1] == "[DONE]", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
        assert _gone(core, 10)
    head, steps = read_step_log(tmp_path / "steps.jsonl")
    assert head["model"] == "smollm2-135m-instruct" and head["kv_bytes_per_token"] > 0
    # the readiness probe's steps (if any) and the stream's: its 299 tokens after the first, one a step
    assert sum(r["decode_tokens"] for r in steps) >= 299 and all(r["duration"] > 0 for r in steps)
    assert sum(r["prefill_tokens"] for r in steps) >= 5 and steps[-1]["decode_context"] >= 300


def test_sigkill_of_the_server_leaves_no_orphan_core():
    with serve() as (proc, url):
        core = _core_pid(proc)
        sockets = [c.laddr for c in psutil.Process(proc.pid).net_connections(kind="unix")
                   if "tokenmill-core" in c.laddr]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _gone(core, 3), "the engine core outlived a SIGKILLed server"
        assert sockets and not any(os.path.exists(s) for s in sockets), "its sockets were left behind"


def test_no_exit_flag_keeps_answering_503():
    with serve("--no-exit-on-engine-death", env={"TOKENMILL_FAULT_AT_STEP": "3"}) as (proc, url):
        results: list = []
        _stream(url, results)
        _assert_failed_cleanly(results)
        time.sleep(1.5)
        assert proc.poll() is None
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code >= 500 and r.json()["error"]["code"] == "engine_dead"
