"""What the live dashboard costs the engine at saturation.

Two `tokenmill serve` processes on the default model: A with --no-dashboard (no metrics history, no
page), B with the dashboard on and a client polling it exactly as an open page does (/dashboard/data
every second, /dashboard/requests every two). `tokenmill bench serve` saturates them in turn (all requests
at once, --max-concurrency bounding them), alternating A and B for --rounds rounds so drift in the
machine's speed falls on both; reported: each round's output tokens/s, the median B/A ratio, and the
dashboard polls' latency under load.

    python benchmarks/dashboard_overhead.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_ab import free_port, start, wait_up  # noqa: E402


class PagePoller(threading.Thread):
    """Polls the dashboard's endpoints as dashboard.js does; records each poll's latency."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.latencies, self.errors = url, threading.Event(), [], 0

    def run(self) -> None:
        since, tick = 0.0, 0
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    r = c.get(f"{self.url}/dashboard/data", params={"since": since})
                    frames = r.json()["frames"]["time"]
                    since = frames[-1] if frames else since
                    if tick % 2 == 0:
                        c.get(f"{self.url}/dashboard/requests").raise_for_status()
                    self.latencies.append(time.perf_counter() - t)
                except Exception:  # noqa: BLE001 - counted, the run goes on
                    self.errors += 1
                tick += 1
                self.stop.wait(max(0.0, 1.0 - (time.perf_counter() - t)))


def bench(url: str, out: Path, a: argparse.Namespace) -> float:
    cmd = ["tokenmill", "bench", "serve", "--base-url", url, "--model", "smollm2-135m-instruct",
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency),
           "--ignore-eos", "--disable-tqdm", "--save-result", "--result-filename", str(out), "--seed", "0"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["output_throughput"]


def micro(steps_per_s: float) -> None:
    """The dashboard's own work, timed alone (noise-free, unlike throughput): a reading of a registry holding
    a loaded server's histograms, a poll's frames, a page's first load of ten minutes; and the per-step
    instrumentation every step pays (the step's shape, FLOPs and bytes) for a batch of 32 decodes."""
    import random
    from types import SimpleNamespace

    from tokenmill.config import ModelConfig
    from tokenmill.perf.step_cost import StepShape
    from tokenmill.engine.streams import EngineSnapshot
    from tokenmill.engine.utilization import ProcessCpu, UtilizationMeter
    from tokenmill.models.registry import DEFAULT_MODEL
    from tokenmill.monitor.history import MetricsHistory
    from tokenmill.server.metrics import ServerMetrics
    from tokenmill.perf.cost import step_bytes, step_flops

    metrics = ServerMetrics("m", EngineSnapshot, 8192, utilization=UtilizationMeter(None, ProcessCpu()), nvml=None)
    rng = random.Random(0)
    for _ in range(20000):
        metrics.ttft.observe(rng.expovariate(5))
        metrics.itl.observe(rng.expovariate(20))
    history = MetricsHistory(metrics.registry.collect)

    def per_call(fn, n: int) -> float:  # noqa: ANN001
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    clock = iter(range(10**9))
    sample = per_call(lambda: history.sample(now=float(next(clock))), 600)  # fills ten minutes
    last = history.latest.time
    poll = per_call(lambda: history.frames(since=last - 1), 200)
    first = per_call(lambda: history.frames(since=0), 5)
    sched = SimpleNamespace(scheduled=[SimpleNamespace(token_ids=[1], start_pos=300 + i, needs_logits=True,
                                                       num_draft_tokens=0) for i in range(32)],
                            num_prefill_tokens=0, num_decode_tokens=32)
    cfg = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192)  # SmolLM2-135M's shape
    instr = per_call(lambda: (s := StepShape.of(sched), step_flops(cfg, s), step_bytes(1e8, 1e4, s)), 2000)
    per_s = sample + poll + 0.5 * 1e-3  # a reading and a poll a second, a table every two (~1 ms at most)
    print(f"dashboard work: a reading {1e6 * sample:.0f} us, a poll's frames {1e6 * poll:.0f} us, a first load of "
          f"600 readings {1e3 * first:.1f} ms; about {1e3 * per_s:.2f} ms of CPU a second = "
          f"{100 * per_s / 2:.3f}% of 2 CPUs")
    print(f"per-step instrumentation (shape, FLOPs, bytes of a 32-decode step): {1e6 * instr:.1f} us = "
          f"{100 * instr * steps_per_s:.3f}% of the engine's time at {steps_per_s:.0f} steps/s ({DEFAULT_MODEL})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--serve-args", default="", help="extra flags for both servers")
    ap.add_argument("--micro-only", action="store_true", help="only time the dashboard's own work")
    a = ap.parse_args()
    if a.micro_only:
        micro(steps_per_s=20)
        return
    tmp = Path(tempfile.mkdtemp(prefix="dash-overhead-"))
    pa, pb = free_port(), free_port()
    # one after the other: each measures the machine's roofline at startup, which a neighbour would halve
    sa = start(f"tokenmill serve --port {{port}} --no-dashboard {a.serve_args}", pa, str(tmp / "a.log"))
    sb = None
    try:
        wait_up(pa, sa, str(tmp / "a.log"))
        sb = start(f"tokenmill serve --port {{port}} {a.serve_args}", pb, str(tmp / "b.log"))
        wait_up(pb, sb, str(tmp / "b.log"))
        poller = PagePoller(f"http://127.0.0.1:{pb}")
        poller.start()
        rows = []
        for r in range(a.rounds):
            off = bench(f"http://127.0.0.1:{pa}", tmp / f"a{r}.json", a)
            on = bench(f"http://127.0.0.1:{pb}", tmp / f"b{r}.json", a)
            rows.append((off, on))
            print(f"round {r + 1}: no dashboard {off:.1f} tok/s, dashboard open {on:.1f} tok/s, ratio {on / off:.3f}",
                  flush=True)
        poller.stop.set()
        poller.join()
    finally:
        for p in (sa, sb):
            if p is not None:
                p.terminate()
                p.wait(60)
    ratios = [on / off for off, on in rows]
    lat = sorted(poller.latencies)
    print(f"median output tokens/s: no dashboard {statistics.median(r[0] for r in rows):.1f}, dashboard open "
          f"{statistics.median(r[1] for r in rows):.1f}; median ratio {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(rows)} rounds")
    print(f"dashboard polls: {len(lat)}, {poller.errors} errors, latency p50 {1e3 * lat[len(lat) // 2]:.1f} ms, "
          f"p99 {1e3 * lat[int(0.99 * (len(lat) - 1))]:.1f} ms")
    micro(steps_per_s=20)


if __name__ == "__main__":
    main()
