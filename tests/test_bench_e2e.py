"""`tokenmill bench serve` against the real tokenmill server on the default model, and `bench offline`
on a tiny random model folder."""

from __future__ import annotations

import json

import httpx
import pytest

import tiny_models as tm
from tokenmill.cli import main
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.app import ServerConfig, build_app
from tokenmill.server.run import BackgroundServer


@pytest.mark.slow
def test_bench_serve_against_tokenmill(llm_fp32, tmp_path, capsys):
    from tokenmill.engine.step_log import StepLog, read_step_log, step_cycles

    engine = llm_fp32.engine
    ae = AsyncEngine(engine, max_waiting_requests=64, log_interval=None)
    log = StepLog(tmp_path / "steps.jsonl", engine.info)  # what `tokenmill serve --step-log` attaches
    ae.observers.append(log)
    srv = BackgroundServer(build_app(ae, ServerConfig())).start()
    out = tmp_path / "result.json"
    try:
        # vLLM's spelling of the flags (`vllm bench serve ...` works with the command name changed)
        rc = main(["bench", "serve", "--base-url", srv.url, "--model", "smollm2-135m-instruct", "--num-prompts", "6",
                   "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "8",
                   "--max-concurrency", "3", "--goodput", "ttft:60000", "--endpoint", "/v1/completions",
                   "--ignore-eos", "--save-result", "--result-dir", str(tmp_path), "--result-filename", out.name,
                   "--metric-percentiles", "50,99", "--disable-tqdm"])
        assert rc == 0
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop(60)
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text
    run = json.loads(out.read_text())  # one run: vLLM's flat layout
    assert (run["completed"], run["failed"]) == (6, 0)
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms",
                "mean_e2el_ms", "total_input_tokens", "duration", "model_id", "num_prompts", "max_concurrency"):
        assert key in run, key
    assert len(run["ttfts"]) == len(run["itls"]) == len(run["input_lens"]) == 6 and run["output_lens"] == [8] * 6
    assert run["errors"] == [""] * 6
    assert run["total_output_tokens"] == 6 * 8 and run["output_tokens_source"] == "usage"
    for r in run["requests"]:
        assert r["completion_tokens"] == 8 and r["finish_reason"] == "length"
        assert r["prompt_tokens"] in (r["prompt_len"], r["prompt_len"] + 1)  # the server may add a BOS token
        assert 0 < r["ttft_s"] < r["e2el_s"] and len(r["chunk_times_s"]) >= 2
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])
    # read from the server's /metrics during the run
    assert 0 < run["device_busy_ratio"] <= 1 and 0 <= run["engine_idle_fraction"] < 1
    assert 0 < run["flops_utilization"] < 1 and run["max_server_running"] >= 0  # sampled once a second
    assert "Device busy fraction:" in text
    # The server saw the benchmark: 6 requests plus the readiness probe, 8 tokens each (probe: 8 too).
    ok = [line for line in metrics.splitlines()
          if line.startswith("vllm:request_success_total") and 'finished_reason="length"' in line]
    assert ok and float(ok[0].split()[-1]) >= 7
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    # the step log: every step the engine ran, in order, with its shape; the decodes sum to the tokens
    # sampled after the first ones (6 requests of 8 tokens and the probe's 8), and each step's cycle is
    # at least its own duration
    log.close()
    head, records = read_step_log(tmp_path / "steps.jsonl")
    assert head["kv_bytes_per_token"] == engine.kv_bytes_per_token and head["model"] == engine.info.model_name
    stats = list(engine.step_stats)[-len(records):]  # (a bounded deque: counting from its end)
    assert [r["start"] for r in records] == [s.start_time for s in stats]
    assert [r["decode_tokens"] for r in records] == [s.num_decode_tokens for s in stats]
    assert sum(r["decode_tokens"] for r in records) == 7 * 7
    assert sum(r["prefill_tokens"] for r in records) == sum(s.num_prefill_tokens for s in stats) > 0
    shapes, cycles = step_cycles(records)
    assert all(c >= r["duration"] for c, r in zip(cycles, records)) and len(shapes) == len(records)


def test_bench_offline_on_a_tiny_model(tmp_path, capsys):
    folder = tm.save_hf_folder(tm.random_hf_model("llama"), tmp_path / "tiny")
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "64MiB",
               "--workload", "dataset", "--num-prompts", "5", "--input-len", "20", "--output-len", "6",
               "--range-ratio", "0.5", "--output-json", str(out), "--no-progress"])
    assert rc == 0
    row = json.loads(out.read_text())
    assert row["requests"] == 5 and row["output_tokens"] >= 5 * 3
    assert row["output_throughput"] == pytest.approx(row["output_tokens"] / row["elapsed_s"])
    assert "output tok/s" in capsys.readouterr().out
