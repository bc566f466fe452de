"""What was going on over a run's time: requests and tokens in flight, requests held by the client.

Only ``peak_per_second`` is a vLLM metric (its max_output_tokens_per_s and max_concurrent_requests,
counted in one-second buckets as vLLM does). The rest is tokenmill's own, measured exactly from the
client's event times; "in flight" means sent and not yet fully answered, seen from the client.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.bench.client import RequestResult


def step_counts(intervals: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """(times, counts): how many intervals [a, b) are open just after each event time."""
    if not intervals:
        return np.zeros(1), np.zeros(1)
    events = sorted([(b, -1) for a, b in intervals] + [(a, 1) for a, b in intervals])  # ends first on ties
    times = np.array([t for t, _ in events])
    counts = np.cumsum([d for _, d in events])
    return times, counts


def time_weighted_mean(times: np.ndarray, counts: np.ndarray, t_end: float) -> float:
    """Mean over [0, t_end] of the step function that is 0 before times[0] and counts[i] from times[i]."""
    if t_end <= 0 or len(times) == 0:
        return 0.0
    edges = np.append(np.clip(times, 0, t_end), t_end)
    return float(np.sum(counts * np.diff(edges)) / t_end)


def requests_in_flight(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    return step_counts([(r.start_s, r.end_s) for r in results])


def queued_in_client(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """Requests released by the arrival process but held back by --max-concurrency."""
    return step_counts([(r.scheduled_s, r.start_s) for r in results if r.start_s > r.scheduled_s])


def tokens_in_flight(results: Sequence[RequestResult], grid: np.ndarray) -> np.ndarray:
    """At each grid time, the sum over in-flight successful requests of prompt tokens plus output tokens
    received so far (usage tokens spread evenly over the chunks): roughly the KV cache the server holds."""
    total = np.zeros(len(grid))
    for r in results:
        chunks = np.asarray(r.chunk_times_s)
        if not r.success or len(chunks) == 0:
            continue
        prompt = r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
        per_chunk = (r.completion_tokens or len(chunks)) / len(chunks)
        live = (grid >= r.start_s) & (grid < r.end_s)
        got = np.searchsorted(chunks, grid[live], side="right") * per_chunk
        total[live] += prompt + got
    return total


def peak_per_second(results: Sequence[RequestResult]) -> tuple[float, int]:
    """vLLM's (max_output_tokens_per_s, max_concurrent_requests): output chunks and active requests in
    one-second buckets from the first successful request's start; the busiest bucket of each."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_s for r in ok)
    n = int(np.ceil(max(r.start_s + r.e2el_s for r in ok) - t0)) + 1
    tokens, active = np.zeros(n), np.zeros(n)
    for r in ok:
        for t in r.chunk_times_s:
            b = int(t - t0)
            if 0 <= b < n:
                tokens[b] += 1
        active[int(r.start_s - t0):int(r.start_s + r.e2el_s - t0) + 1] += 1
    return float(tokens.max()), int(active.max())
