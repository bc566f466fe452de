"""The simulator against the real server, side by side: each workload through `tokenmill serve` with
`tokenmill bench serve`, then through `tokenmill simulate --profile` with the same requests and arrivals.

    tokenmill profile --output profile.json --kv-cache-memory 2GiB
    python benchmarks/simulator_validation.py --profile profile.json \\
        --trace ../shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv

The profile's grid is synthetic (decode batches, prefill chunks, mixed steps), so none of these workloads
is in the fitting data. The server runs with the profile's KV pool (--kv-cache-memory 2GiB).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill.cli import build_parser, main as tokenmill

KEYS = [("output_throughput", "out tok/s"), ("median_ttft_ms", "p50 TTFT"), ("p99_ttft_ms", "p99 TTFT"),
        ("median_tpot_ms", "p50 TPOT"), ("p99_tpot_ms", "p99 TPOT")]


def workloads(trace: str | None) -> list[tuple[str, list[str]]]:
    rand = ["--dataset", "random", "--input-len", "128", "--output-len", "128", "--num-prompts", "60"]
    out = [("random 128/128 at 1 req/s", rand + ["--request-rate", "1"]),
           ("random 128/128 at 2 req/s", rand + ["--request-rate", "2"]),
           ("shared prefix 512 + 32, 64 out, 1 req/s (prefix caching)",
            ["--dataset", "shared-prefix", "--prefix-len", "512", "--question-len", "32", "--output-len", "64",
             "--num-prompts", "40", "--request-rate", "1"])]
    if trace:
        out.append(("Azure conversation trace, 60 rows at 1 req/s",
                    ["--dataset", "trace", "--dataset-path", trace, "--num-prompts", "60", "--trace-max-input-len",
                     "1024", "--trace-max-output-len", "128", "--request-rate", "1"]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--trace", default=None, help="an Azure LLM trace CSV (the conversation one)")
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
                               "--kv-cache-memory", "2GiB", "--disable-log-requests", "--disable-log-stats"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        rows = []
        for name, flags in workloads(args.trace):
            with tempfile.TemporaryDirectory() as d:
                out = Path(d) / "r.json"
                tokenmill(["bench", "serve", "--base-url", url, "--model", "smollm2-135m-instruct", "--save-result",
                           str(out), "--no-progress", *flags])
                real = json.loads(out.read_text())
            from tokenmill.sim.cli import build, run_at, workload

            ns = build_parser().parse_args(["simulate", "--profile", args.profile, "--duration", "0", *flags])
            _, sim, _, _ = build(ns)
            run, _ = run_at(sim, workload(ns), ns.request_rate, ns, {})
            rows.append((name, real, run.metrics))
            print(f"done: {name}", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(60)
    print("| workload | | " + " | ".join(label for _, label in KEYS) + " |")
    print("|---|---|" + "---|" * len(KEYS))
    for name, real, sim in rows:
        print(f"| {name} | real | " + " | ".join(f"{real[k]:.1f}" for k, _ in KEYS) + " |")
        print("| | simulated | " + " | ".join(f"{sim[k]:.1f} ({100 * (sim[k] / real[k] - 1):+.0f}%)" for k, _ in KEYS)
              + " |")


if __name__ == "__main__":
    main()
