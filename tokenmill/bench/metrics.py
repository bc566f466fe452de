"""Serving metrics with vLLM's definitions and key names (vllm bench serve's result JSON).

- TTFT: request sent to its first output chunk. ITL: every gap between consecutive output chunks,
  pooled over all requests. E2EL: request sent to the complete response.
- TPOT, per request with more than one output token: ``(e2el - ttft) / (output_tokens - 1)``.
- Throughputs divide by ``duration``, the run's start to its last completion. Output token counts are
  the server's usage (``completion_tokens``); a server that sends no usage is counted by chunks and
  ``output_tokens_source`` says so.
- Goodput (``--goodput ttft:MS tpot:MS e2el:MS``): requests per second meeting every given SLO, each
  judged on its own TTFT / TPOT / E2EL, as vLLM defines it.
All latency keys are in milliseconds: ``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``,
``p99_ttft_ms`` and the same for tpot, itl, e2el.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from tokenmill.bench.client import RequestResult
from tokenmill.bench.timeline import peak_per_second

LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:1000", "tpot:100"]`` -> {"ttft": 1000.0, "tpot": 100.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}, "
                             f"e.g. ttft:1000 tpot:100; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the bound must be a positive number of milliseconds")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> [50.0, 90.0, 99.0]."""
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--percentiles takes comma-separated numbers, e.g. 50,90,99; got {text!r}") from None
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise ValueError(f"--percentiles must be numbers in [0, 100], e.g. 50,90,99; got {text!r}")
    return ps


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def output_tokens(r: RequestResult) -> int:
    """The server's completion_tokens, or the number of output chunks when it sent no usage."""
    return r.completion_tokens if r.completion_tokens is not None else len(r.chunk_times_s)


def tpot_s(r: RequestResult) -> float | None:
    """Mean time per output token after the first; None for a request with fewer than two tokens."""
    n = output_tokens(r)
    return (r.e2el_s - r.ttft_s) / (n - 1) if n > 1 else None


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """vLLM's rule: a one-token request has TPOT 0."""
    values = {"ttft": r.ttft_s, "tpot": tpot_s(r) or 0.0, "e2el": r.e2el_s}
    return all(values[m] * 1000.0 <= bound for m, bound in slos.items())


def _summary(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def calculate_metrics(results: Sequence[RequestResult], duration_s: float, slos: dict[str, float] | None = None,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """The metrics of one run, keyed as vLLM's result JSON."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    dur = max(duration_s, 1e-9)
    out_tokens = [output_tokens(r) for r in ok]
    in_tokens = [r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok]
    values = {"ttft": [r.ttft_s for r in ok], "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
              "itl": [g for r in ok for g in r.itl_s], "e2el": [r.e2el_s for r in ok]}
    max_tok_s, max_conc = peak_per_second(results)
    m: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": int(sum(in_tokens)),
        "total_output_tokens": int(sum(out_tokens)),
        "output_tokens_source": "usage" if all(r.completion_tokens is not None for r in ok) else "chunks",
        "request_throughput": len(ok) / dur,
        "request_goodput": (sum(meets_slos(r, slos) for r in ok) / dur) if slos else None,
        "output_throughput": sum(out_tokens) / dur,
        "total_token_throughput": (sum(in_tokens) + sum(out_tokens)) / dur,
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": max_conc,
        "errors": dict(Counter(r.error for r in failed)),
    }
    for name in LATENCIES:
        m.update(_summary(name, values[name], percentiles))
    return m


def meets_slo_percentile(m: dict, slos: dict[str, float], percentile: float) -> bool:
    """The sweep's test of a rate: no failures, and each SLO metric's ``percentile`` within its bound."""
    if m["failed"] or not m["completed"]:
        return False
    return all(m[f"{percentile_key(percentile)}_{name}_ms"] <= bound for name, bound in slos.items())
