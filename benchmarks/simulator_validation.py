"""The simulator against the real server, side by side: each workload through `tokenmill serve` with
`tokenmill bench serve`, then through `tokenmill simulate --profile` with the same requests and arrivals.

    tokenmill profile --output profile.json --kv-cache-memory 2GiB
    python benchmarks/simulator_validation.py --profile profile.json \\
        --trace ../shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv

Both sides schedule alike: the server plans its steps to the same 100 ms ITL target on the same step-cost
model (`--step-cost-profile`), the simulation runs that planner on the profile. The profile's grid is
synthetic (decode batches, prefill chunks, mixed steps) and timed on an idle engine; serving, the steps run
slower (the HTTP front end, detokenization, streaming and the benchmark client share the cores). That
factor is fitted on one workload (``--calibrate-on``, default the first: its simulated median TPOT made
equal to the real one, as `--step-time-scale`) and every other workload is predicted with it: held out.
The server runs with the profile's KV pool (--kv-cache-memory 2GiB). ``--results-dir`` keeps each real
run's result and reuses it.
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


def workloads(trace: str | None, rates: list[str]) -> list[tuple[str, list[str]]]:
    rand = ["--dataset", "random", "--input-len", "128", "--output-len", "128", "--num-prompts", "60"]
    out = [(f"random 128/128 at {r} req/s", rand + ["--request-rate", r]) for r in rates]
    out += [("shared prefix 512 + 32, 64 out, 1 req/s (prefix caching)",
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
    ap.add_argument("--calibrate-on", type=int, default=0,
                    help="the workload (index) the serving step-time scale is fitted on; -1: none (scale 1)")
    ap.add_argument("--results-dir", default=None, help="keep the real runs' results here, and reuse them")
    ap.add_argument("--warmup", type=int, default=40, help="requests run first, not recorded (default 40)")
    ap.add_argument("--random-rates", default="1,2", help="the random workload's request rates (default 1,2)")
    ap.add_argument("--itl-target-ms", type=float, default=100.0,
                    help="the ITL target both sides plan to (0: the fixed token budget)")
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
                               "--kv-cache-memory", "2GiB", "--disable-log-requests", "--disable-log-stats",
                               "--step-cost-profile", args.profile, "--itl-target-ms", str(args.itl_target_ms)],
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
        from tokenmill.sim.cli import build, run_at, workload

        def simulate(flags: list[str], scale: float) -> dict:
            ns = build_parser().parse_args(["simulate", "--profile", args.profile, "--duration", "0",
                                            "--itl-target-ms", str(args.itl_target_ms), "--step-time-scale",
                                            str(scale), *flags])
            _, sim, _, _ = build(ns)
            run, _ = run_at(sim, workload(ns), ns.request_rate, ns, {})
            return run.metrics

        # each workload its own prompts (a seed each): the same prompts again would hit the server's prefix
        # cache from the workload before, which the simulation (a fresh cache each run) does not have
        loads = [(name, [*flags, "--seed", str(i)]) for i, (name, flags) in enumerate(workloads(args.trace, args.random_rates.split(",")))]
        # a warm server (its first requests pay for first-touched KV pages and cold caches), not recorded
        tokenmill(["bench", "serve", "--base-url", url, "--model", "smollm2-135m-instruct", "--no-progress",
                   "--dataset", "random", "--input-len", "128", "--output-len", "64", "--num-prompts",
                   str(args.warmup), "--request-rate", "4", "--seed", "99"])
        reals = []
        for i, (name, flags) in enumerate(loads):
            with tempfile.TemporaryDirectory() as d:
                out = Path(args.results_dir or d) / f"real-{i}.json"
                if not out.exists():
                    tokenmill(["bench", "serve", "--base-url", url, "--model", "smollm2-135m-instruct",
                               "--save-result", str(out), "--no-progress", *flags])
                reals.append(json.loads(out.read_text()))
            print(f"done: {name}", file=sys.stderr, flush=True)
        scale, fit = 1.0, args.calibrate_on
        if fit >= 0:  # one scalar, fitted where the median TPOT is step time and little else
            for _ in range(3):  # a few fixed-point rounds: a slower step also changes the batches a little
                scale *= reals[fit]["median_tpot_ms"] / simulate(loads[fit][1], scale)["median_tpot_ms"]
            print(f"serving step-time scale fitted on {loads[fit][0]!r}: {scale:.3f}", flush=True)
        rows = [(name + (" (fitted)" if i == fit else ""), real, simulate(flags, scale))
                for i, ((name, flags), real) in enumerate(zip(loads, reals))]
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
