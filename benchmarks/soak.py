"""Soak test: a `tokenmill serve` process held at saturation for a long time by this (separate) client
process, with some clients leaving mid-stream. Reports failed requests (target 0), the server's resident
memory over time, API process and engine core together (target: flat within 5% after warm-up), and
whether the scheduler is empty and every KV block free at the end.

    python benchmarks/soak.py --duration 1800                       # the 30-minute run
    python benchmarks/soak.py --duration 60 --json soak.json        # what CI runs (tests/test_soak.py)
    python benchmarks/soak.py --duration 600 -- --no-engine-core-process --max-num-seqs 32

Arguments after ``--`` go to `tokenmill serve`. Exit status 1 when a target is missed. The KV pool is
512 MiB unless `--kv-cache-memory` is given there: its pages become resident as blocks are first written
(the pool is not zeroed), and a small pool is all written during warm-up, so growth after it is a leak,
not the pool filling in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

import httpx
import psutil
from serve_ab import free_port, wait_up  # (this folder: the script's own)

PROMPTS = ["Tell me about the sea.", "Write a poem about autumn leaves.", "Explain how a bicycle works.",
           "List five fruits and say one thing about each.", "What is the capital of France, and why?"]


def resident_bytes(pid: int) -> int:
    """The server's resident memory: its process and its children (the engine core)."""
    p = psutil.Process(pid)
    total = p.memory_info().rss
    for c in p.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def gauge(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    return None


async def worker(client: httpx.AsyncClient, url: str, stop: float, rng: random.Random, counts: dict) -> None:
    while time.monotonic() < stop:
        body = {"prompt": rng.choice(PROMPTS) * rng.randint(1, 8), "max_tokens": rng.randint(8, 96),
                "stream": True, "ignore_eos": True}
        leave_after = rng.randint(0, 4) if rng.random() < 0.1 else None  # a client that goes away
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    counts["failed"] += 1
                    counts.setdefault("statuses", {}).setdefault(str(r.status_code), 0)
                    counts["statuses"][str(r.status_code)] += 1
                    await r.aread()
                    continue
                n, ok, last = 0, False, ""
                async for line in r.aiter_lines():
                    if leave_after is not None and n >= leave_after:
                        break
                    if line.startswith("data: "):
                        n += 1
                        last = line
                        if line == "data: [DONE]":
                            ok = True
                        elif line.startswith('data: {"error"'):
                            break
                if leave_after is not None and not ok:
                    counts["abandoned"] += 1
                elif ok:
                    counts["ok"] += 1
                else:  # an error event, or a stream that ended without [DONE]: keep what it said last
                    counts["failed"] += 1
                    counts.setdefault("failures", []).append({"events": n, "last": last[:500]})
        except httpx.HTTPError as e:
            counts["failed"] += 1
            counts.setdefault("errors", []).append(repr(e)[:200])


async def soak(url: str, pid: int, duration: float, concurrency: int, sample_s: float, seed: int) -> dict:
    counts = {"ok": 0, "failed": 0, "abandoned": 0}
    memory: list[tuple[float, int]] = []
    t0 = time.monotonic()
    stop = t0 + duration
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def sampler() -> None:
            while time.monotonic() < stop:
                memory.append((round(time.monotonic() - t0, 1), resident_bytes(pid)))
                await asyncio.sleep(sample_s)

        rngs = [random.Random(seed * 1000 + i) for i in range(concurrency)]
        await asyncio.gather(sampler(), *(worker(client, url, stop, rng, counts) for rng in rngs))
    # the engine gets a moment to apply the last aborts
    end_state: dict = {}
    for _ in range(50):
        m = httpx.get(url + "/metrics", timeout=10).text
        end_state = {"running": gauge(m, "vllm:num_requests_running"), "waiting": gauge(m, "vllm:num_requests_waiting"),
                     "kv_cache_usage": gauge(m, "vllm:kv_cache_usage_perc")}
        if not any(end_state.values()):
            break
        await asyncio.sleep(0.1)
    after = [b for t, b in memory if t >= 0.2 * duration] or [b for _, b in memory]
    growth = (after[-1] - min(after)) / min(after)
    return {"duration_s": duration, "concurrency": concurrency, **counts, "end_state": end_state,
            "memory_mib": [(t, round(b / 2**20, 1)) for t, b in memory],
            "memory_growth_after_warmup": growth, "next_request_ok": httpx.post(
                url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60).status_code == 200}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds at saturation (default 1800)")
    ap.add_argument("--concurrency", type=int, default=32, help="clients at once (default 32)")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between memory samples (default 5)")
    ap.add_argument("--max-growth", type=float, default=0.05,
                    help="largest allowed memory growth after the first 20%% of the run (default 0.05)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("serve_args", nargs="*", help="after --: flags for tokenmill serve")
    a = ap.parse_args()
    serve_args = list(a.serve_args)
    if not any(x.startswith("--kv-cache-memory") for x in serve_args):
        serve_args += ["--kv-cache-memory", "512MiB"]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
                               "--disable-log-requests", "--uvicorn-log-level", "warning",
                               "--disable-access-log", *serve_args])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(port, server, "its output above", 300)
        report = asyncio.run(soak(url, server.pid, a.duration, a.concurrency, a.sample, a.seed))
        report["server_alive"] = server.poll() is None
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    passed = (report["failed"] == 0 and report["server_alive"] and report["next_request_ok"]
              and not any(report["end_state"].values()) and report["memory_growth_after_warmup"] <= a.max_growth)
    report["passed"] = passed
    mem = report["memory_mib"]
    print(f"{report['ok']} requests ok, {report['abandoned']} abandoned by their clients, {report['failed']} failed; "
          f"resident memory {mem[0][1]} -> {mem[-1][1]} MiB ({100 * report['memory_growth_after_warmup']:.1f}% growth "
          f"after warm-up); at the end {report['end_state']}; {'PASS' if passed else 'FAIL'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
