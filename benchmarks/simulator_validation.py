"""The simulator against the real server, side by side: each workload through `tokenmill serve` with
`tokenmill bench serve`, then through `tokenmill simulate --profile` with the same requests and arrivals.

    python benchmarks/simulator_validation.py --trace ../shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv

Calibration (``--calibrate served``, the default): a server with `--step-log` runs a calibration workload
that is none of the validated ones (random prompts of 26-486 tokens, 10-182 out, at three rates, and of 538-998 tokens), and
`tokenmill profile --from-step-log` fits the cost model to the steps it served, each charged its cycle
(start to the next step's start). A served step carries what an idle engine's grid does not: the core's
loop between steps, and on a machine whose cores the front end and the benchmark client share, their
work for every streamed token. The validated workloads then run on a fresh server planning with that
model (`--step-cost-profile`), and are simulated with it: all of them held out. The front end's time a
request is measured on the idle server too (`--request-overhead-ms`), and on these shared cores it also
slows the step it arrives during (`--front-end-shares-cpu`).

``--calibrate grid --profile FILE`` is the older way: `tokenmill profile`'s synthetic grid timed on an idle
engine, one step-time scale fitted on one workload (``--calibrate-on``) and the others predicted with it.
Both sides plan to the same 100 ms ITL target on the same model. The server runs with the profile's KV
pool (--kv-cache-memory 2GiB). ``--results-dir`` keeps each real run's result (and the step logs) and
reuses them. ``--repeats N`` runs the real side N times on fresh servers with the same requests and
reports their spread beside the simulation (compared with their mean).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill.cli import build_parser, main as tokenmill
from tokenmill.perf.step_cost import CalibratedCost
from tokenmill.engine.step_log import read_step_log, step_cycles

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


# short and long prompts (26-486 and 538-998 tokens) at light to heavy loads; seeds none of the workloads use
CALIBRATION = [["--dataset", "random", "--input-len", "256", "--output-len", "96", "--range-ratio", "0.9",
                "--num-prompts", "40", "--request-rate", r, "--seed", str(100 + i)] for i, r in enumerate(("0.75", "1.5", "2.5"))]
CALIBRATION += [["--dataset", "random", "--input-len", "768", "--output-len", "64", "--range-ratio", "0.3",
                 "--num-prompts", "24", "--request-rate", "0.5", "--seed", "110"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tokenmill serve` on a free loopback port, planning to the ITL target on ``profile``, warmed up."""

    def __init__(self, profile: str, itl_target_ms: float, warmup: int, step_log: str | None = None) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--kv-cache-memory", "2GiB",
               "--disable-log-requests", "--disable-log-stats", "--itl-target-ms", str(itl_target_ms)]
        cmd += ["--step-cost-profile", profile] if profile else []
        cmd += ["--step-log", step_log] if step_log else []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        # a warm server (its first requests pay for first-touched KV pages and cold caches), not recorded
        self.bench(["--dataset", "random", "--input-len", "128", "--output-len", "64", "--num-prompts", str(warmup),
                    "--request-rate", "4", "--seed", "99"])

    def bench(self, flags: list[str]) -> None:
        tokenmill(["bench", "serve", "--base-url", self.url, "--model", "smollm2-135m-instruct", "--no-progress", *flags])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def calibrate_served(workdir: Path, itl_target_ms: float, warmup: int) -> tuple[str, list[float]]:
    """(the served-steps profile, the front end's [fixed ms, ms per 1k prompt tokens] a request), measured
    once and kept in ``workdir``. The request overhead: 20 one-token requests of 16-token prompts one at a
    time on the idle server, the client's median TTFT less the median cycle of the one step each took (its
    duration plus the calibration's median gap between steps, as the profile charges it).
    (Its growth with the prompt, from prompts of 26-998 tokens, came out within this machine's noise:
    -6 to +11 ms a request; left at 0.)"""
    from tokenmill.sim.profile import profile_from_step_logs

    out, overhead = workdir / "served-profile.json", workdir / "request-overhead-ms.json"
    if out.exists() and overhead.exists():
        return str(out), json.loads(overhead.read_text())
    log, probe = workdir / "calibration-steps.jsonl", workdir / "overhead-probe.json"
    server = Server("", itl_target_ms, warmup, str(log))  # planning on its own startup-timed model
    try:
        for flags in CALIBRATION:
            server.bench(flags)
        time.sleep(1)
        start = len(read_step_log(log)[1])
        server.bench(["--dataset", "random", "--input-len", "16", "--output-len", "1", "--num-prompts", "20",
                      "--max-concurrency", "1", "--seed", "120", "--save-result", str(probe)])
        time.sleep(1)
    finally:
        server.stop()
    # the probe's steps each leave the engine idle: charged their duration plus the calibration's median gap
    cycles = step_cycles(read_step_log(log)[1])[1][start:]
    ttft = statistics.median(json.loads(probe.read_text())["ttfts"])
    overhead.write_text(json.dumps([1000 * (ttft - statistics.median(cycles)), 0.0]))
    profile_from_step_logs([str(log)], str(out))
    return str(out), json.loads(overhead.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", choices=["served", "grid"], default="served",
                    help="served: fit to the steps a server ran on a calibration workload (default); grid: "
                         "--profile from `tokenmill profile` with one step-time scale fitted on --calibrate-on")
    ap.add_argument("--profile", default=None, help="with --calibrate grid: the `tokenmill profile` file")
    ap.add_argument("--trace", default=None, help="an Azure LLM trace CSV (the conversation one)")
    ap.add_argument("--calibrate-on", type=int, default=0,
                    help="with --calibrate grid: the workload (index) the step-time scale is fitted on; -1: none")
    ap.add_argument("--results-dir", default=None, help="keep the real runs' results here, and reuse them")
    ap.add_argument("--warmup", type=int, default=40, help="requests run first, not recorded (default 40)")
    ap.add_argument("--random-rates", default="1,2", help="the random workload's request rates (default 1,2)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the real side this many times, each on a fresh server with the same requests: the "
                         "spread between runs is how closely this machine repeats itself (default 1)")
    ap.add_argument("--itl-target-ms", type=float, default=100.0,
                    help="the ITL target both sides plan to (0: the fixed token budget)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if (args.calibrate == "grid") != (args.profile is not None):
        ap.error("--profile goes with --calibrate grid (and only with it)")
    from tokenmill.sim.cli import build, run_at, workload

    def simulate(profile: str, flags: list[str], scale: float):  # noqa: ANN202 -- (metrics, SimOutput)
        ns = build_parser().parse_args(["simulate", "--profile", profile, "--duration", "0",
                                        "--itl-target-ms", str(args.itl_target_ms), "--step-time-scale",
                                        str(scale), "--request-overhead-ms", *map(str, overhead_ms),
                                        *(["--front-end-shares-cpu"] if args.calibrate == "served" else []), *flags])
        _, sim, _, _ = build(ns)
        run, out = run_at(sim, workload(ns), ns.request_rate, ns, {})
        return run.metrics, out

    # each workload its own prompts (a seed each): the same prompts again would hit the server's prefix
    # cache from the workload before, which the simulation (a fresh cache each run) does not have
    loads = [(name, [*flags, "--seed", str(i)]) for i, (name, flags) in enumerate(workloads(args.trace, args.random_rates.split(",")))]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.results_dir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        profile, overhead_ms = ((args.profile, [0.0, 0.0]) if args.profile else
                                calibrate_served(workdir, args.itl_target_ms, args.warmup))
        print(f"the front end's time a request: {overhead_ms[0]:.1f} ms + {overhead_ms[1]:.1f} ms per 1,000 prompt "
              "tokens", flush=True)
        reals, served = [[] for _ in loads], [[] for _ in loads]  # per workload, per repeat
        for rep in range(args.repeats):  # each repeat on a fresh server, the same requests
            server, log = None, workdir / f"steps-{rep}.jsonl"
            try:
                for i, (name, flags) in enumerate(loads):
                    tag = f"{i}" if rep == 0 else f"{i}-r{rep}"
                    out, steps = workdir / f"real-{tag}.json", workdir / f"real-{tag}-steps.jsonl"
                    if not out.exists():
                        server = server or Server(profile, args.itl_target_ms, args.warmup, str(log))
                        start = len(read_step_log(log)[1])
                        server.bench(["--save-result", str(out), *flags])
                        time.sleep(1)  # the front end writes the last steps
                        lines = log.read_text().splitlines()
                        steps.write_text("\n".join([lines[0], *lines[1 + start:]]) + "\n")
                    reals[i].append(json.loads(out.read_text()))
                    served[i].append(read_step_log(steps)[1] if steps.exists() else [])
                    print(f"done: {name} (run {rep + 1})", file=sys.stderr, flush=True)
            finally:
                if server is not None:
                    server.stop()
    scale, fit = 1.0, args.calibrate_on if args.calibrate == "grid" else -1
    if fit >= 0:  # one scalar, fitted where the median TPOT is step time and little else
        real_tpot = statistics.mean(r["median_tpot_ms"] for r in reals[fit])
        for _ in range(3):  # a few fixed-point rounds: a slower step also changes the batches a little
            scale *= real_tpot / simulate(profile, loads[fit][1], scale)[0]["median_tpot_ms"]
        print(f"serving step-time scale fitted on {loads[fit][0]!r}: {scale:.3f}", flush=True)
    cost = CalibratedCost.load(profile)
    print("| workload | | " + " | ".join(label for _, label in KEYS) + " |")
    print("|---|---|" + "---|" * len(KEYS))
    for i, (name, flags) in enumerate(loads):
        sim, sim_out = simulate(profile, flags, scale)
        for rep, (real, steps) in enumerate(zip(reals[i], served[i])):
            if steps:  # where a gap comes from: the steps' cost, or the schedule
                shapes, cycles = step_cycles(steps)
                model = sum(cost(x) for x in shapes) * scale / sum(cycles)
                print(f"{name}, run {rep + 1}: {len(steps)} steps served, {len(sim_out.steps)} simulated; decodes a "
                      f"step {statistics.mean(x.decode_tokens for x in shapes):.1f} served, "
                      f"{statistics.mean(x.decode_tokens for x in sim_out.steps):.1f} simulated; the cost model on "
                      f"the served steps: {100 * (model - 1):+.1f}% of their time", file=sys.stderr)
            label = name + (" (fitted)" if i == fit else "") if rep == 0 else ""
            run = f"real, run {rep + 1}" if len(reals[i]) > 1 else "real"
            print(f"| {label} | {run} | ".replace("|  |", "| |") + " | ".join(f"{real[k]:.1f}" for k, _ in KEYS) + " |")
        mean = {k: statistics.mean(r[k] for r in reals[i]) for k, _ in KEYS}
        if len(reals[i]) > 1:  # how far apart the same requests land on two fresh servers
            print("| | real spread | " + " | ".join(
                f"{100 * (max(r[k] for r in reals[i]) / min(r[k] for r in reals[i]) - 1):.0f}%" for k, _ in KEYS) + " |")
        vs = " vs the runs' mean" if len(reals[i]) > 1 else ""
        print(f"| | simulated{vs} | " + " | ".join(f"{sim[k]:.1f} ({100 * (sim[k] / mean[k] - 1):+.0f}%)"
                                                   for k, _ in KEYS) + " |", flush=True)

if __name__ == "__main__":
    main()
