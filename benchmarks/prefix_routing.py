"""Prefix-aware routing across two replicas against round robin, least loaded, and one replica holding
everything, on a shared-prefix chat workload.

The workload: --prefixes long system prompts, each request one of them (drawn at random) and a short
question of its own, --concurrency clients at a time, streaming, a few output tokens. Each configuration
gets system prompts of its own, so nothing cached by an earlier run helps a later one.

- single: one `tokenmill serve` with every core and twice a replica's KV cache (it can hold every prefix).
- round-robin, least-loaded, prefix: two `tokenmill serve` replicas on loopback (half the cores and
  --kv-cache-memory each, so one alone cannot hold every prefix), `tokenmill router --policy P` in front.

Reported per configuration: the replicas' own prefix-cache hit rate over the run (the deltas of
vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, in tokens), the router's own estimate
(tokenmill:router_prefix_match_chars_total / tokenmill:router_prompt_chars_total), and TTFT p50/p99 as the
client saw it (to the first streamed content).

    python benchmarks/prefix_routing.py --requests 96 --concurrency 4

Server logs go to --log-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_ab import free_port, start, wait_up  # noqa: E402

WORDS = ("harbour tide berth fuel ledger anchor vessel permit crane cargo pilot buoy channel dredge quay mooring "
         "invoice schedule weather warning fee captain crew license inspection manifest container dock ferry "
         "signal lantern rope hull keel rudder mast sail engine pump valve gauge chart compass beacon storm gale "
         "fog swell current depth draught tonnage customs report record office clerk window counter stamp "
         "deadline season winter summer morning evening night shift rota rule notice board contract clause").split()


def text(rng: random.Random, chars: int) -> str:
    out = []
    while sum(map(len, out)) + len(out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def workload(seed: int, n: int, prefixes: int, prefix_chars: int, question_chars: int) -> list[list[dict]]:
    rng = random.Random(seed)
    systems = [f"Office rules, book {seed}-{k}: " + text(rng, prefix_chars) for k in range(prefixes)]
    return [[{"role": "system", "content": rng.choice(systems)},
             {"role": "user", "content": text(rng, question_chars) + "?"}] for _ in range(n)]


def scrape(url: str, name: str) -> dict[str, float]:
    """A /metrics counter's samples, by their instance label (or '' when it has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                key = s.labels.get("instance", "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def hit_counts(replicas: list[str]) -> tuple[float, float]:
    hits = sum(sum(scrape(u, "vllm:prefix_cache_hits_total").values()) for u in replicas)
    queries = sum(sum(scrape(u, "vllm:prefix_cache_queries_total").values()) for u in replicas)
    return hits, queries


async def drive(url: str, convs: list[list[dict]], concurrency: int, max_tokens: int) -> list[float]:
    """Send every conversation, ``concurrency`` at a time; each one's time to first streamed content."""
    todo = list(convs)
    ttfts: list[float] = []

    async def client(http: httpx.AsyncClient, model: str) -> None:
        while todo:
            messages = todo.pop(0)
            t0 = time.perf_counter()
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True}
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()}")
                first = None
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0].get("delta", {})
                        if delta.get("content"):
                            first = time.perf_counter() - t0
                ttfts.append(first if first is not None else time.perf_counter() - t0)

    async with httpx.AsyncClient(timeout=600) as http:
        model = (await http.get(url + "/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(client(http, model) for _ in range(concurrency)))
    return ttfts


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96, help="requests per configuration (default 96)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8, help="distinct system prompts (default 8)")
    ap.add_argument("--prefix-chars", type=int, default=1200, help="characters per system prompt (default 1200)")
    ap.add_argument("--question-chars", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=4, help="output tokens per request (default 4)")
    ap.add_argument("--kv-cache-memory", default="48MiB",
                    help="each replica's KV cache (default 48MiB: about 1000 tokens of the default model, 4 of "
                         "the 8 default prefixes); the single replica gets twice this")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="the single replica's threads; the two replicas get half each (default: cores)")
    ap.add_argument("--single-threads", type=int, default=None,
                    help="the single replica's threads (default: --threads; on a machine others share, 2 threads "
                         "on 2 busy cores wait on each other, and 1 is the fairer figure)")
    ap.add_argument("--policies", default="round-robin,least-loaded,prefix")
    ap.add_argument("--serve-args", default="", help="more flags for every `tokenmill serve`")
    ap.add_argument("--log-dir", default=".", help="where the servers' logs go (default: here)")
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    a = ap.parse_args()
    logs = Path(a.log_dir)
    tm = f"{shlex.quote(sys.executable)} -m tokenmill.cli"
    mem = a.kv_cache_memory
    double = f"{2 * int(mem.removesuffix('MiB'))}MiB" if mem.endswith("MiB") else mem
    serve = (f"{tm} serve --port {{port}} --uvicorn-log-level warning --disable-log-requests --no-dashboard "
             f"--itl-target-ms 0 {a.serve_args}")
    procs: list[subprocess.Popen] = []

    def launch(cmd: str, name: str, threads: int) -> str:
        port = free_port()
        os.environ["OMP_NUM_THREADS"] = str(threads)
        log = str(logs / f"prefix-routing-{name}.log")
        procs.append(start(cmd, port, log))
        wait_up(port, procs[-1], log)
        return f"http://127.0.0.1:{port}"

    def stop(n: int = 0) -> None:
        while len(procs) > n:
            p = procs.pop()
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def run(name: str, url: str, replicas: list[str], seed: int) -> dict:
        convs = workload(seed, a.requests, a.prefixes, a.prefix_chars, a.question_chars)
        h0, q0 = hit_counts(replicas)
        t0 = time.perf_counter()
        ttfts = asyncio.run(drive(url, convs, a.concurrency, a.max_tokens))
        wall = time.perf_counter() - t0
        h1, q1 = hit_counts(replicas)
        row = {"config": name, "requests": len(ttfts), "hit_rate": (h1 - h0) / max(q1 - q0, 1),
               "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99), "wall_s": wall}
        if url not in replicas:  # behind the router: its own estimate and where the requests went
            matched, total = scrape(url, "tokenmill:router_prefix_match_chars_total"), \
                scrape(url, "tokenmill:router_prompt_chars_total")
            row["router_match_rate"] = sum(matched.values()) / max(sum(total.values()), 1)
            row["per_replica"] = scrape(url, "tokenmill:router_requests_total")
        print(json.dumps(row), flush=True)
        return row

    rows = []
    try:
        single = launch(f"{serve} --kv-cache-memory {double}", "single", a.single_threads or a.threads)
        rows.append(run("single (2x KV)", single, [single], seed=0))
        stop()
        half = max(1, a.threads // 2)
        replicas = [launch(f"{serve} --kv-cache-memory {mem}", f"replica{i}", half) for i in range(2)]
        for k, policy in enumerate(a.policies.split(","), start=1):
            router = launch(f"{tm} router --replica {' '.join(replicas)} --policy {policy} --port {{port}}",
                            f"router-{policy}", 1)
            rows.append(run(policy, router, replicas, seed=k))
            stop(2)
    finally:
        stop()
    print(f"\n{'config':<16} {'hit rate':>9} {'router est.':>11} {'TTFT p50':>9} {'TTFT p99':>9} {'wall':>7}")
    for r in rows:
        est = f"{r['router_match_rate']:.1%}" if "router_match_rate" in r else "-"
        print(f"{r['config']:<16} {r['hit_rate']:>9.1%} {est:>11} {r['ttft_p50_s'] * 1e3:>7.0f}ms "
              f"{r['ttft_p99_s'] * 1e3:>7.0f}ms {r['wall_s']:>6.1f}s")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
