"""Text reports: vLLM's result block for one run, and tables for sweeps and side-by-side comparisons."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenmill.bench.metrics import meets_slo_percentile, percentile_key
from tokenmill.bench.runner import RunResult

SERVER_ROWS = (("engine_idle_fraction", "Engine step-loop idle fraction:"),
               ("device_busy_ratio", "Device busy fraction:"),
               ("flops_utilization", "Peak FLOP/s used while busy:"),
               ("bandwidth_utilization", "Peak bandwidth used while busy:"),
               ("engine_cpu_utilization", "Engine CPU utilization:"),
               ("mean_server_kv_cache_usage", "Mean KV-cache usage:"),
               ("max_server_kv_cache_usage", "Peak KV-cache usage:"),
               ("mean_ttft_prefill_ms", "Mean TTFT: prefill leg (ms):"),
               ("mean_ttft_kv_transfer_ms", "Mean TTFT: KV transfer (ms):"),
               ("mean_ttft_first_decode_ms", "Mean TTFT: first decode (ms):"))


def _rate(r: RunResult) -> str:
    rate = r.load.request_rate
    return "inf" if rate is None or math.isinf(rate) else f"{rate:g}"


def run_block(r: RunResult, percentiles: Sequence[float], slos: dict[str, float]) -> str:
    """The result block vLLM's serving benchmark prints, for one run."""
    m = r.metrics
    lines = [f"{' Serving Benchmark Result: ' + r.label + ' ':=^60}"]

    def row(name: str, value: object, fmt: str = "") -> None:
        lines.append(f"{name:<44}{format(value, fmt) if value is not None else '-':>16}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Request rate configured (RPS):", _rate(r))
    if r.load.max_concurrency:
        row("Maximum request concurrency:", r.load.max_concurrency)
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row(f"Total generated tokens ({m['output_tokens_source']}):", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    if slos:
        row("Request goodput (req/s):", m["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for key, label in SERVER_ROWS:  # read from the server's /metrics during the run
        if key in m:
            row(label, m[key], ".2f")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        lines.append(f"{' ' + title + ' ':-^60}")
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"], ".2f")
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p:g} {name.upper()} (ms):", m[f"{percentile_key(p)}_{name}_ms"], ".2f")
    for err, n in m["errors"].items():
        lines.append(f"failed x{n}: {err}")
    lines.append("=" * 60)
    return "\n".join(lines)


def point_label(r: RunResult, over: str) -> str:
    return str(r.load.max_concurrency) if over == "concurrency" else _rate(r)


def sweep_table(runs: Sequence[RunResult], over: str, slos: dict[str, float], slo_percentile: float) -> str:
    """One row per (server, sweep point): achieved throughput, tail latencies, goodput, SLO verdict."""
    pk = percentile_key(slo_percentile)
    head = (f"{'server':<22}{over:>12}{'req/s':>8}{'out tok/s':>11}{'p50 TTFT':>10}{pk + ' TTFT':>10}"
            f"{pk + ' TPOT':>10}{pk + ' ITL':>10}{'goodput':>9}{'fail':>6}  SLO")
    lines = [head, "-" * len(head)]
    for r in runs:
        m = r.metrics
        ok = meets_slo_percentile(m, slos, slo_percentile) if slos else None
        good = "-" if m["request_goodput"] is None else f"{m['request_goodput']:.2f}"
        lines.append(f"{r.label[:21]:<22}{point_label(r, over):>12}{m['request_throughput']:>8.2f}"
                     f"{m['output_throughput']:>11.1f}{m['median_ttft_ms']:>10.0f}{m[f'{pk}_ttft_ms']:>10.0f}"
                     f"{m[f'{pk}_tpot_ms']:>10.1f}{m[f'{pk}_itl_ms']:>10.1f}{good:>9}{m['failed']:>6}  "
                     + ("-" if ok is None else "met" if ok else "missed"))
    lines.append("latencies in ms; goodput in req/s meeting every SLO; SLO = no failures and "
                 f"{pk} of each of {', '.join(f'{k} <= {v:g} ms' for k, v in slos.items()) or '(none given)'}")
    return "\n".join(lines)


def sustainable_point(runs: Sequence[RunResult], slos: dict[str, float], slo_percentile: float) -> RunResult | None:
    """The highest sweep point of one server that meets the SLOs with every lower point meeting them too."""
    best = None
    for r in runs:  # in sweep order, lowest load first
        if not meets_slo_percentile(r.metrics, slos, slo_percentile):
            break
        best = r
    return best


COMPARED = (("request_throughput", "req/s", ".2f"), ("output_throughput", "out tok/s", ".1f"),
            ("median_ttft_ms", "p50 TTFT ms", ".0f"), ("p99_ttft_ms", "p99 TTFT ms", ".0f"),
            ("median_tpot_ms", "p50 TPOT ms", ".1f"), ("p99_tpot_ms", "p99 TPOT ms", ".1f"),
            ("p99_itl_ms", "p99 ITL ms", ".1f"), ("median_e2el_ms", "p50 E2EL ms", ".0f"),
            ("request_goodput", "goodput req/s", ".2f"), ("engine_idle_fraction", "engine idle", ".2f"),
            ("device_busy_ratio", "device busy", ".2f"))


def compare_table(pairs: Sequence[tuple[RunResult, RunResult]], over: str) -> str:
    """Two servers side by side at each sweep point, with the ratio A / B of every figure."""
    a_label, b_label = pairs[0][0].label, pairs[0][1].label
    lines = [f"A = {a_label}    B = {b_label}    ratio = A / B"]
    head = f"{over:>8}  {'metric':<15}{'A':>12}{'B':>12}{'A/B':>9}"
    lines += [head, "-" * len(head)]
    for a, b in pairs:
        for key, name, fmt in COMPARED:
            va, vb = a.metrics.get(key), b.metrics.get(key)
            if va is None or vb is None:
                continue
            ratio = f"{va / vb:.2f}" if vb else "-"
            lines.append(f"{point_label(a, over):>8}  {name:<15}{format(va, fmt):>12}{format(vb, fmt):>12}{ratio:>9}")
        lines.append("")
    return "\n".join(lines)
