"""Startup time and peak resident memory, against the bare torch import and llama.cpp, in one run.

Each measurement is a fresh process, repeated --repeats times (the median is reported; files warm):
- floor: ``python -c "import torch"``;
- ``tokenmill generate "Hi" --max-tokens 1`` (default flags): wall time and peak RSS;
- ``tokenmill serve``: wall time until ``GET /health`` answers 200, and its peak RSS then;
- ``import tokenmill`` alone (no torch);
- peer: llama.cpp's ``llama-completion -m FILE -p Hi -n 1`` on the same GGUF (--llama-bin DIR).

    python benchmarks/startup.py --llama-bin DIR

Peak RSS comes from the kernel's accounting of each child (wait4's ru_maxrss).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def run(cmd: list[str], stop_when=None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one fresh process; stop_when() -> True ends it early (a server)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = None
    if stop_when is not None:
        while wall is None:
            if p.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {p.returncode} before it was ready")
            if stop_when():
                wall = time.perf_counter() - t
            else:
                time.sleep(0.02)
        p.terminate()
    _, status, usage = os.wait4(p.pid, 0)
    if wall is None:
        wall = time.perf_counter() - t
        if status != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with status {status}")
    return wall, usage.ru_maxrss / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int):
    def check() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False
    return check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, help="folder with llama.cpp's llama-completion")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    py = sys.executable
    tokenmill = shutil.which("tokenmill") or "tokenmill"
    from tokenmill.models.registry import DEFAULT_MODEL, resolve_model

    gguf = str(resolve_model(DEFAULT_MODEL).path)
    cases = {
        "python -c 'import torch' (floor)": lambda: run([py, "-c", "import torch"]),
        "python -c 'import tokenmill'": lambda: run([py, "-c", "import tokenmill"]),
        "tokenmill generate Hi --max-tokens 1": lambda: run([tokenmill, "generate", "Hi", "--max-tokens", "1",
                                                             "--no-progress"]),
    }

    def serve():
        port = free_port()
        return run([tokenmill, "serve", "--port", str(port)], stop_when=healthy(port))
    cases["tokenmill serve: /health answers"] = serve
    if args.llama_bin:
        cases["llama.cpp llama-completion -p Hi -n 1"] = lambda: run(
            [str(args.llama_bin / "llama-completion"), "-m", gguf, "-p", "Hi", "-n", "1", "-t", "2", "-no-cnv"])
    results = {name: [] for name in cases}
    for _ in range(args.repeats):  # rounds: each case once per round, so drift hits all alike
        for name, fn in cases.items():
            results[name].append(fn())
    floor = statistics.median(w for w, _ in results["python -c 'import torch' (floor)"])
    print("| process | wall s (median) | minus the torch import | peak RSS MiB (median) |\n|---|---|---|---|")
    for name, rows in results.items():
        wall = statistics.median(w for w, _ in rows)
        rss = statistics.median(r for _, r in rows)
        print(f"| {name} | {wall:.2f} | {wall - floor:+.2f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
