"""What-if against reality: serve a workload with one chunk budget, ask ``tokenmill explain`` what another budget
would have given, then serve the same workload with that budget and compare.

    python benchmarks/explain_whatif.py --budget 256 --what-if-budget 64

Each run starts ``tokenmill serve`` (the default model, --itl-target-ms 0 so the budget is fixed), sends the
same requests at the same times (seeded: a mix of short prompts and long ones, every request streamed,
``ignore_eos``), and records each request's TTFT and gaps between chunks as the client sees them. For a few
target requests of the first run, the server's window around the target is replayed by the simulator with the
server's live-fitted cost model, as served and with the other budget; the prediction is compared with the
same requests measured in the second run: the target's TTFT, and the window's TTFT p50 and ITL p99.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import httpx
import numpy as np
from local_server import start_server

KEY = "whatif"
MEASURE = "server"  # whose TTFT and gaps are compared: the server's timelines, or this client's


def workload(n: int, rate: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.exponential(1 / rate)
        long = rng.random() < 0.25
        length = int(rng.integers(900, 1400)) if long else int(rng.integers(40, 200))
        out.append({"i": i, "at": t, "prompt": rng.integers(1000, 40000, length).tolist(), "max_tokens": 48})
    return out


def start(port: int, budget: int):
    return start_server(port, ["--api-key", KEY, "--itl-target-ms", "0", "--max-num-batched-tokens", str(budget),
                               "--kv-cache-memory", "1GiB", "--no-dashboard"])


def run(port: int, reqs: list[dict]) -> dict[int, dict]:
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    results: dict[int, dict] = {}

    def one(r: dict, t0: float) -> None:
        time.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
        sent = time.perf_counter()
        times, rid = [], None
        body = {"model": model, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=600) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    rid = rid or json.loads(line[6:])["id"]
        results[r["i"]] = {"id": rid, "ttft_s": times[0] - sent, "itl_s": [b - a for a, b in zip(times, times[1:])]}

    t0 = time.perf_counter() + 0.5
    threads = [threading.Thread(target=one, args=(r, t0)) for r in reqs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for res in results.values():  # the server's own measurement: arrival to each output going out
        t = httpx.get(f"{url}/v1/requests/{res['id']}/timeline", headers=headers).json()
        res["client"] = {"ttft_s": res["ttft_s"], "itl_s": res["itl_s"]}
        if MEASURE == "server":
            res["ttft_s"], res["itl_s"] = t["ttft_s"], t["output_gaps_s"]
    return results


def window_stats(rows: list[dict]) -> dict:
    ttfts = [r["ttft_s"] for r in rows]
    itls = [g for r in rows for g in r["itl_s"]]
    return {"window_ttft_p50_s": float(np.percentile(ttfts, 50)), "window_itl_p99_s": float(np.percentile(itls, 99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--what-if-budget", type=int, default=64)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", type=int, default=5, help="requests of the first run to explain")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--measure", choices=["server", "client"], default="server",
                    help="compare with the server's measurement of the rerun (its request timelines: arrival to "
                         "each output going out; default) or this client's (which adds its own send and receive)")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    global MEASURE
    MEASURE = a.measure
    sys.path.insert(0, os.getcwd())
    from tokenmill.sim.explain import explain

    reqs = workload(a.requests, a.rate, a.seed)
    measured, windows = {}, {}
    for budget in (a.budget, a.what_if_budget):
        proc = start(a.port, budget)
        try:
            measured[budget] = run(a.port, reqs)
            if budget == a.budget:  # the targets: spread over the run's middle
                picks = np.linspace(a.requests // 5, a.requests - a.requests // 5, a.targets).astype(int)
                for i in picks:
                    rid = measured[budget][int(i)]["id"]
                    windows[int(i)] = httpx.get(f"http://127.0.0.1:{a.port}/v1/requests/{rid}/window",
                                                headers={"Authorization": f"Bearer {KEY}"}).json()
        finally:
            proc.terminate()
            proc.wait(30)
    rows = []
    for i, win in windows.items():
        got = explain(win, f"--max-num-batched-tokens {a.what_if_budget}")
        cols = list(got["columns"].values())
        replay, predicted = cols[1], cols[2]
        index_of = {measured[a.budget][k]["id"]: k for k in measured[a.budget]}
        members = [index_of[r["request_id"]] for r in win["requests"] if r["request_id"] in index_of]
        served = {"ttft_s": measured[a.budget][i]["ttft_s"], **window_stats([measured[a.budget][k] for k in members])}
        rerun = {"ttft_s": measured[a.what_if_budget][i]["ttft_s"],
                 **window_stats([measured[a.what_if_budget][k] for k in members])}
        rows.append({"target": i, "window_requests": len(members), "served": served, "replayed": replay,
                     "predicted": predicted, "rerun": rerun, "cost_model_error": got["cost_model_error"]})
    keys = ("ttft_s", "window_ttft_p50_s", "window_itl_p99_s")
    print(f"budget {a.budget} served, what-if {a.what_if_budget} predicted by `tokenmill explain`, then rerun "
          f"({a.requests} requests at {a.rate:g}/s, seed {a.seed}; measured by the {a.measure})")
    print(f"{'target':>6} {'reqs':>4}  " + "  ".join(f"{k:>34}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            s, p, m = r["served"][k], r["predicted"][k], r["rerun"][k]
            cells.append(f"{1e3 * s:7.0f} -> {1e3 * p:7.0f} / {1e3 * m:7.0f} ms ({100 * (p / m - 1):+4.0f}%)")
        print(f"{r['target']:>6} {r['window_requests']:>4}  " + "  ".join(f"{c:>34}" for c in cells))
    errs = {k: float(np.median([abs(r["predicted"][k] / r["rerun"][k] - 1) for r in rows])) for k in keys}
    print("median |predicted / rerun - 1|: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in errs.items()))
    print("cost model's live step error (served run): "
          + ", ".join(f"{100 * r['cost_model_error']:.1f}%" for r in rows if r["cost_model_error"] is not None))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows, "median_abs_error": errs}, f, indent=1)


if __name__ == "__main__":
    main()
