"""A `tokenmill serve` of the default model on loopback for the benchmarks that drive one (explain_whatif.py,
live_check.py): started in its own process, ready once /health answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, flags: list[str], timeout_s: float = 300) -> subprocess.Popen:
    """``tokenmill serve --port PORT FLAGS...`` quietly (no request log, no stats lines); raises with its
    stderr if it exits before it is ready."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--disable-log-requests",
           "--log-stats-interval", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start in {timeout_s:g} s")
