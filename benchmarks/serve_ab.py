"""Start two servers, benchmark them side by side with `tokenmill bench serve --compare`, stop them.

Each server is a shell command with ``{port}`` where its port goes; everything after ``--`` is
passed to ``tokenmill bench serve`` (which alternates between the two servers at every point).

    # tokenmill against llama.cpp's llama-server on the same GGUF
    python benchmarks/serve_ab.py \\
        --a "tokenmill serve --port {port} --max-num-seqs 64" --a-label tokenmill \\
        --b "llama-server -m MODEL.gguf -t 2 -np 16 -c 8192 --port {port}" --b-label llama-server \\
        -- --model smollm2-135m-instruct --num-prompts 40 --sweep 0.5,1,2 --goodput ttft:1000 tpot:100

    # one lever on and off
    python benchmarks/serve_ab.py --a "tokenmill serve --port {port} --enable-prefix-caching" --a-label cache-on \\
        --b "tokenmill serve --port {port}" --b-label cache-off -- --model smollm2-135m-instruct --dataset shared-prefix

Only one server computes at a time (the runs alternate), so the two do not share the CPU.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: str, port: int, log: str) -> subprocess.Popen:
    f = open(log, "w")  # noqa: SIM115 -- the server's lifetime
    return subprocess.Popen(shlex.split(cmd.format(port=port)), stdout=f, stderr=subprocess.STDOUT)


def wait_up(port: int, proc: subprocess.Popen, log: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server on port {port} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"the server on port {port} did not come up in {timeout:.0f} s; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="command of server A, with {port}")
    ap.add_argument("--b", required=True, help="command of server B, with {port}")
    ap.add_argument("--a-label", default="A")
    ap.add_argument("--b-label", default="B")
    ap.add_argument("--log-prefix", default="serve_ab", help="server logs go to PREFIX_a.log, PREFIX_b.log")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the arguments of tokenmill bench serve")
    a = ap.parse_args()
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    pa, pb = free_port(), free_port()
    la, lb = f"{a.log_prefix}_a.log", f"{a.log_prefix}_b.log"
    procs = [start(a.a, pa, la), start(a.b, pb, lb)]
    try:
        wait_up(pa, procs[0], la)
        wait_up(pb, procs[1], lb)
        cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{pa}",
               "--label", a.a_label, "--compare", f"http://127.0.0.1:{pb}", "--compare-label", a.b_label, *bench]
        print("+", shlex.join(cmd), flush=True)
        rc = subprocess.call(cmd)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    sys.exit(rc)


if __name__ == "__main__":
    main()
