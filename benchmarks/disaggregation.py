"""Colocated vs prefill/decode-disaggregated serving on this machine, side by side in one run.

Colocated: one `tokenmill serve` with every core. Disaggregated: a producer (`--kv-role producer`) and a
consumer (`--kv-role consumer`) with an equal share of the cores each (OMP_NUM_THREADS), and `tokenmill
router` in front. `tokenmill bench serve --compare` runs the same workload against both, alternating at
every sweep point (only one side computes at a time), and reports TTFT/ITL percentiles, goodput at the
SLOs and, behind the router, TTFT split into prefill leg, KV transfer and first decode.

    python benchmarks/disaggregation.py -- --model smollm2-135m-instruct --dataset random --input-len 128 \\
        --output-len 64 --long-input-every 4 --long-input-len 1536 --num-prompts 40 --sweep 1,2,3 \\
        --sweep-keep-going --goodput ttft:2000 tpot:50

Everything after ``--`` goes to `tokenmill bench serve`. Server logs are written to --log-dir.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_ab import free_port, start, wait_up  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="the colocated server's threads; the producer and consumer get half each (default: cores)")
    ap.add_argument("--serve-args", default="", help="more flags for every `tokenmill serve`")
    ap.add_argument("--kv-transport", default="tcp", choices=["tcp", "torch"])
    ap.add_argument("--log-dir", default=".", help="where the servers' logs go (default: here)")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `tokenmill bench serve` flags")
    a = ap.parse_args()
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    logs = Path(a.log_dir)
    half = max(1, a.threads // 2)
    tm = f"{shlex.quote(sys.executable)} -m tokenmill.cli"
    serve = f"{tm} serve --port {{port}} --uvicorn-log-level warning --disable-log-requests {a.serve_args}"
    procs = []

    def launch(cmd: str, name: str, threads: int) -> int:
        port = free_port()
        os.environ["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op threads in the new process
        log = str(logs / f"disagg-{name}.log")
        procs.append((start(cmd, port, log), port, log))
        wait_up(port, procs[-1][0], log)  # one at a time: each times its steps at startup on idle cores
        return port

    try:
        colocated = launch(serve, "colocated", a.threads)
        producer = launch(serve + f" --kv-role producer --kv-transport {a.kv_transport}", "producer", half)
        consumer = launch(serve + f" --kv-role consumer --kv-transport {a.kv_transport}", "consumer", half)
        router = launch(f"{tm} router --prefill http://127.0.0.1:{producer} --decode http://127.0.0.1:{consumer} "
                        "--port {port}", "router", 1)
        cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{colocated}",
               "--label", f"colocated {a.threads}t", "--compare", f"http://127.0.0.1:{router}",
               "--compare-label", f"disagg {half}t+{half}t", *bench]
        print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
        sys.exit(subprocess.call(cmd))
    finally:
        for proc, _, _ in procs:
            proc.terminate()
        for proc, _, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
