"""Flags of ``tokenmill top`` (no heavy imports: the CLI builds its parser with this)."""

from __future__ import annotations

import argparse
import os

from tokenmill.monitor.history import WINDOW_S


def add_top_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", default="http://127.0.0.1:8000",
                   help="the server's base URL (default http://127.0.0.1:8000); its /metrics is read")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between readings (default 1)")
    p.add_argument("--window", type=float, default=WINDOW_S,
                   help=f"seconds of observations the percentiles cover (default {WINDOW_S:g}, or since top "
                        "started if that is shorter)")
    p.add_argument("--once", action="store_true",
                   help="print one snapshot (two readings --interval apart, so rates exist) and exit")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="the server's API key, sent as a bearer token (default: $TOKENMILL_API_KEY)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for /metrics (default 5)")
