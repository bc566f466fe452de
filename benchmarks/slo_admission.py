"""SLO-aware admission and step planning against today's fixed-budget scheduler, side by side.

Each scenario starts two `tokenmill serve` processes (benchmarks/serve_ab.py) and runs one
`tokenmill bench serve --compare` over them, alternating at every point, then summarizes the saved
results: goodput, the served requests' p99 TTFT / TPOT / ITL, how many were shed (503) and how fast
the slowest 503 came back. `--simulate PROFILE` also runs `tokenmill simulate` on each Poisson point
with the same flags and prints its goodput beside the real one.

    tokenmill profile --output profile.json --kv-cache-memory 2GiB
    python benchmarks/slo_admission.py --scenario poisson --rates 1,2,3,4,6,8 --simulate profile.json
    python benchmarks/slo_admission.py --scenario bursty --rates 4,8
    python benchmarks/slo_admission.py --scenario trace --trace ../shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv
    python benchmarks/slo_admission.py --scenario chunked          # and chunked-slo: with the SLO flags

Scenarios (the issue's): poisson / bursty (gamma, burstiness 0.3): random 128/128 against
`--max-num-seqs 64`, SLO p99 TTFT 1 s and TPOT 100 ms, `--slo-ttft-ms 1000 --slo-tpot-ms 100` against
`--itl-target-ms 0` (the fixed 256-token budget); trace: the Azure conversation trace's lengths and
arrivals, lengths halved; chunked: 64-token prompts with every fifth 1,500 tokens, 96 output tokens, 30 at 0.5 req/s,
the default server (100 ms ITL target), or with the SLO flags (chunked-slo), against `--itl-target-ms 0`.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
QUIET = "--disable-log-requests --disable-access-log"
SLO_FLAGS = "--slo-ttft-ms 1000 --slo-tpot-ms 100"
SLOS = ["ttft:1000", "tpot:100"]
RANDOM_128 = ["--dataset", "random", "--input-len", "128", "--output-len", "128"]


def scenario(a: argparse.Namespace) -> tuple[str, str, str, str, list[str]]:
    """(server A, label, server B, label, bench flags)."""
    base = f"tokenmill serve --port {{port}} {QUIET}"
    slo = (f"{base} --max-num-seqs 64 {SLO_FLAGS}", "slo-aware")
    fixed = (f"{base} --max-num-seqs 64 --itl-target-ms 0", "fixed-budget")
    sweep = ["--sweep", a.rates, "--sweep-keep-going", "--num-prompts", str(a.num_prompts), "--goodput", *SLOS]
    if a.scenario == "poisson":
        return (*slo, *fixed, RANDOM_128 + sweep)
    if a.scenario == "bursty":
        return (*slo, *fixed, RANDOM_128 + sweep + ["--burstiness", "0.3"])
    if a.scenario == "trace":
        if not a.trace:
            sys.exit("--scenario trace needs --trace FILE.csv")
        # lengths halved: the trace's median prompt (894 tokens) alone takes most of a second to prefill here
        return (*slo, *fixed, ["--dataset", "trace", "--dataset-path", a.trace, "--num-prompts", str(a.num_prompts),
                               "--time-scale", str(a.time_scale), "--trace-length-scale", "0.5",
                               "--goodput", *SLOS])
    if a.scenario in ("chunked", "chunked-slo"):
        new = (base, "default (100 ms ITL target)") if a.scenario == "chunked" else (f"{base} {SLO_FLAGS}",
                                                                                     "slo-aware")
        return (*new, f"{base} --itl-target-ms 0", "fixed budget 256",
                ["--dataset", "random", "--input-len", "64", "--output-len", "96", "--long-input-every", "5",
                 "--long-input-len", "1500", "--num-prompts", "30", "--request-rate", "0.5", "--goodput", *SLOS])
    sys.exit(f"unknown scenario {a.scenario}")


def summarize(run: dict) -> dict:
    reqs = run["requests"]
    served = [r for r in reqs if r["success"]]
    shed = [r for r in reqs if r.get("status") == 503]
    itls = [x for r in served for x in r["itl_s"]]
    return {
        "label": run["label"], "rate": run.get("request_rate"), "served": len(served), "shed": len(shed),
        "failed_other": len(reqs) - len(served) - len(shed), "goodput": run.get("request_goodput", 0.0),
        "throughput": run.get("request_throughput", 0.0),
        "p99_ttft_ms": run.get("p99_ttft_ms", float("nan")), "p99_tpot_ms": run.get("p99_tpot_ms", float("nan")),
        "p99_itl_ms": 1e3 * float(np.percentile(itls, 99)) if itls else float("nan"),
        "p50_ttft_ms": run.get("median_ttft_ms", float("nan")),
        "max_503_ms": 1e3 * max((r["end_s"] - r["start_s"] for r in shed), default=0.0),
    }


def step_time_scale(log: Path) -> float:
    """The median observed/predicted step-time ratio the SLO-aware server logged under load (1 if none)."""
    ratios = [float(x) for x in re.findall(r"steps take ([0-9.]+)x the cost model", log.read_text())]
    return float(np.median(ratios)) if ratios else 1.0


def simulate(profile: str, server_cmd: str, rate: float, num_prompts: int, seed: int, scale: float) -> float:
    """The simulator's goodput at one point, with the server's scheduling flags and its serving overhead."""
    flags = shlex.split(server_cmd)
    keep = []
    for name in ("--max-num-seqs", "--slo-ttft-ms", "--slo-tpot-ms", "--itl-target-ms"):
        if name in flags:
            keep += [name, flags[flags.index(name) + 1]]
    cmd = ["tokenmill", "simulate", "--profile", profile, *RANDOM_128, "--num-prompts", str(num_prompts),
           "--request-rate", str(rate), "--duration", str(num_prompts / rate), "--seed", str(seed),
           "--slo", *SLOS, "--step-time-scale", str(scale), *keep]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"Request goodput \(req/s\):\s+([0-9.]+)", out).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", required=True, choices=["poisson", "bursty", "trace", "chunked", "chunked-slo"])
    ap.add_argument("--rates", default="1,2,3,4,6,8")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--time-scale", type=float, default=1.0, help="trace: stretch its clock (below 1 compresses)")
    ap.add_argument("--simulate", default=None, metavar="PROFILE.json", help="also simulate each Poisson point")
    ap.add_argument("--out", default=None, help="where to keep the bench's JSON (default: a temporary file)")
    a = ap.parse_args()
    srv_a, label_a, srv_b, label_b, bench = scenario(a)
    out = Path(a.out or tempfile.mkstemp(suffix=".json")[1])
    logs = Path(tempfile.mkdtemp(prefix="slo_admission_"))
    cmd = [sys.executable, str(HERE / "serve_ab.py"), "--a", srv_a, "--a-label", label_a, "--b", srv_b,
           "--b-label", label_b, "--log-prefix", str(logs / "serve"), "--", "--model", "smollm2-135m-instruct", "--no-progress", *bench,
           "--save-result", str(out)]
    print("+", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    runs = doc.get("runs") or [doc]
    rows = [summarize(r) for r in runs]
    sim = {}
    if a.simulate and a.scenario == "poisson":
        scale = step_time_scale(logs / "serve_a.log")
        print(f"simulated with step times x {scale:.2f} (the SLO-aware server's median observed/predicted)")
        for k, rate in enumerate(float(x) for x in a.rates.split(",")):
            for cmd_, label in ((srv_a, label_a), (srv_b, label_b)):
                sim[(label, rate)] = simulate(a.simulate, cmd_, rate, a.num_prompts, k, scale)
    print("\n| rate | server | served | shed (503) | slowest 503 ms | goodput req/s | sim goodput | p50 TTFT ms | "
          "p99 TTFT ms | p99 TPOT ms | p99 ITL ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = sim.get((r["label"], r["rate"]))
        simcol = f"{s:.2f} ({100 * (s / r['goodput'] - 1):+.0f}%)" if s is not None and r["goodput"] else "-"
        print(f"| {r['rate']} | {r['label']} | {r['served']} | {r['shed']} | {r['max_503_ms']:.1f} | "
              f"{r['goodput']:.2f} | {simcol} | {r['p50_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
              f"{r['p99_tpot_ms']:.1f} | {r['p99_itl_ms']:.0f} |")
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
