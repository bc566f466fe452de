"""The simulator checking itself on live traffic: the live step-cost model's prediction error and the live
replay's TTFT/TPOT against what the server measured, on the simulator validation's steady workloads.

    python benchmarks/live_check.py [--workloads random-0.5,random-1,random-2,prefix-1] [--requests 120]

Each workload runs on a fresh `tokenmill serve` (the default model and flags, `--live-replay-interval 30`)
under `tokenmill bench serve` on the same machine. While the load runs the script reads /metrics every 2 s:
`tokenmill:step_time_prediction_error` (the share of the last 200 steps' time the live model mispredicted, out
of sample) and its bias, reported as the median of the readings past the first quarter; when the load ends it
waits for one more replay of the last 200 finished requests and reads the replay's predicted and observed
mean TTFT and TPOT (and the step error then, after the drain).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from local_server import free_port, start_server

WORKLOADS = {
    "random-0.5": ["--dataset", "random", "--input-len", "128", "--output-len", "128", "--request-rate", "0.5"],
    "random-1": ["--dataset", "random", "--input-len", "128", "--output-len", "128", "--request-rate", "1"],
    "random-2": ["--dataset", "random", "--input-len", "128", "--output-len", "128", "--request-rate", "2"],
    "prefix-1": ["--dataset", "shared-prefix", "--prefix-len", "512", "--question-len", "32", "--output-len", "64",
                 "--request-rate", "1"],
}
GAUGES = ["tokenmill:step_time_prediction_error", "tokenmill:step_time_prediction_bias",
          "tokenmill:replay_predicted_ttft_seconds", "tokenmill:replay_observed_ttft_seconds",
          "tokenmill:replay_predicted_tpot_seconds", "tokenmill:replay_observed_tpot_seconds"]
REPLAY_S = 30  # (a replay takes CPU from the engine on a small machine: not too often)


def gauges(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in GAUGES:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def run(name: str, requests: int, extra: list[str]) -> dict:
    port = free_port()
    server = start_server(port, ["--live-replay-interval", str(REPLAY_S), "--no-dashboard", *extra])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "r.json")
            cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                   "--model", "smollm2-135m-instruct", "--num-prompts", str(requests), "--no-progress",
                   "--save-result", result, *WORKLOADS[name]]
            readings: list[dict] = []
            done = threading.Event()

            def sample() -> None:  # the step error while the load runs (the drain at the end is not steady)
                while not done.wait(2.0):
                    g = gauges(port)
                    if not math.isnan(g.get("tokenmill:step_time_prediction_error", math.nan)):
                        readings.append(g)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            done.set()
            sampler.join()
            bench = json.load(open(result))
        before = gauges(port)
        deadline = time.time() + 3 * REPLAY_S
        got = before
        while time.time() < deadline:  # one more replay, now that every request has finished
            time.sleep(1)
            got = gauges(port)
            if got.get("tokenmill:replay_observed_ttft_seconds") != before.get("tokenmill:replay_observed_ttft_seconds"):
                break
        steady = readings[len(readings) // 4:]  # past the first fits
        return {"workload": name, "requests": requests, "client_mean_ttft_ms": bench["mean_ttft_ms"],
                "client_mean_tpot_ms": bench["mean_tpot_ms"], **got,
                "steady_step_error": statistics.median(r["tokenmill:step_time_prediction_error"] for r in steady),
                "steady_step_bias": statistics.median(r["tokenmill:step_time_prediction_bias"] for r in steady)}
    finally:
        server.terminate()
        server.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--server-args", default="", help="extra `tokenmill serve` flags")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [run(w, a.requests, a.server_args.split()) for w in a.workloads.split(",")]
    print("| workload | step error under load (median) / at the end | step bias under load / at the end | "
          "TTFT replayed / served (ms) | error | TPOT replayed / served (ms) | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        pt, ot = r["tokenmill:replay_predicted_ttft_seconds"], r["tokenmill:replay_observed_ttft_seconds"]
        pp, op = r["tokenmill:replay_predicted_tpot_seconds"], r["tokenmill:replay_observed_tpot_seconds"]
        print(f"| {r['workload']} | {100 * r['steady_step_error']:.1f}% / "
              f"{100 * r['tokenmill:step_time_prediction_error']:.1f}% | {100 * r['steady_step_bias']:+.1f}% / "
              f"{100 * r['tokenmill:step_time_prediction_bias']:+.1f}% | {1e3 * pt:.1f} / {1e3 * ot:.1f} | "
              f"{100 * (pt / ot - 1):+.1f}% | {1e3 * pp:.2f} / {1e3 * op:.2f} | {100 * (pp / op - 1):+.1f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
