"""Production traces: request lengths and arrival times to replay.

The format is the Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA 2024): a CSV with
columns ``TIMESTAMP`` (``2023-11-16 18:15:46.6805900``), ``ContextTokens`` and ``GeneratedTokens``.
Arrival times are kept as offsets from the first replayed request; arrivals.py stretches or shrinks
the clock (``--time-scale``, or ``--request-rate`` to hit a mean rate) and scale_lengths() caps or
scales the lengths, because the trace came from GPUs far faster than a small CPU.
"""

from __future__ import annotations

import csv
import datetime
import math
from dataclasses import dataclass, replace
from pathlib import Path

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # seconds after the first replayed request
    input_len: int
    output_len: int


def parse_timestamp(text: str) -> float:
    """Seconds since 0001-01-01 for 'YYYY-MM-DD HH:MM:SS[.fraction]' (any number of fraction digits)."""
    day, _, clock = text.strip().partition(" ")
    try:
        ordinal = datetime.date.fromisoformat(day).toordinal()
        h, m, s = clock.split(":")
        return ordinal * 86400.0 + int(h) * 3600.0 + int(m) * 60.0 + float(s)
    except ValueError:
        raise ValueError(f"bad trace timestamp {text!r}; expected 'YYYY-MM-DD HH:MM:SS.ffffff'") from None


def load_trace(path: str | Path, start: int = 0, num: int | None = None) -> list[TraceRow]:
    """Rows ``start .. start+num`` of the trace, in arrival order, timed from the first of them."""
    if start < 0:
        raise ValueError(f"--trace-start must be >= 0, got {start}")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} lacks the column(s) {', '.join(missing)}; a trace CSV needs "
                             f"{', '.join(COLUMNS)} (the Azure LLM inference trace format)")
        raw = []
        for line, rec in enumerate(reader, start=2):
            try:
                raw.append((parse_timestamp(rec["TIMESTAMP"]), int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path} line {line}: {e}; fix or remove that row") from None
    raw.sort(key=lambda r: r[0])
    raw = raw[start:] if num is None else raw[start:start + num]
    if not raw:
        raise ValueError(f"{path} has no rows from --trace-start {start} on; lower --trace-start")
    t0 = raw[0][0]
    return [TraceRow(t - t0, max(1, i), max(1, o)) for t, i, o in raw]


def scale_lengths(rows: list[TraceRow], length_scale: float = 1.0, max_input_len: int | None = None,
                  max_output_len: int | None = None) -> list[TraceRow]:
    """Multiply every length by ``length_scale`` (rounded, at least 1), then cap at the maxima."""
    if length_scale <= 0:
        raise ValueError(f"--trace-length-scale must be positive, got {length_scale}")
    for flag, v in (("--trace-max-input-len", max_input_len), ("--trace-max-output-len", max_output_len)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be at least 1, got {v}")

    def one(n: int, cap: int | None) -> int:
        n = max(1, int(math.floor(n * length_scale + 0.5)))
        return n if cap is None else min(n, cap)

    return [replace(r, input_len=one(r.input_len, max_input_len), output_len=one(r.output_len, max_output_len))
            for r in rows]


def mean_rate(arrivals: list[float]) -> float:
    """Requests per second over the trace's span: (n - 1) / (last - first); inf if all arrive at once."""
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    return math.inf if span <= 0 else (len(arrivals) - 1) / span
