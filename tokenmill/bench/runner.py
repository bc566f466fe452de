"""One benchmark run: release the requests on their schedule, send them, collect the timings."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import httpx

from tqdm.auto import tqdm

from tokenmill.bench.arrivals import schedule
from tokenmill.bench.client import ApiConfig, RequestResult, make_client, send_request
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import calculate_metrics


@dataclass
class LoadSpec:
    """How the load is offered: arrival rate (None = all at once, or a trace's own clock), the gamma
    shape of the gaps, a client-side cap on requests in flight, and the trace clock's stretch."""

    request_rate: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    time_scale: float = 1.0
    seed: int = 0

    def describe(self) -> str:
        rate = "inf" if self.request_rate is None or math.isinf(self.request_rate) else f"{self.request_rate:g}"
        conc = f", concurrency {self.max_concurrency}" if self.max_concurrency else ""
        return f"rate {rate}/s{conc}"


@dataclass
class RunResult:
    label: str
    load: LoadSpec
    results: list[RequestResult]
    duration_s: float
    metrics: dict

    def to_json(self) -> dict:
        """The metrics (vLLM keys) plus the load and every request's raw timings."""
        return {"label": self.label, **asdict(self.load), **self.metrics,
                "requests": [asdict(r) | {"chunk_times_s": r.chunk_times_s} for r in self.results]}


async def run_async(api: ApiConfig, requests: Sequence[SampleRequest], load: LoadSpec, timeout: float = 600.0,
                    progress: bool = True, slos: dict[str, float] | None = None,
                    percentiles: Sequence[float] = (50, 90, 99)) -> RunResult:
    times = schedule(requests, load.request_rate, load.burstiness, load.seed, load.time_scale)
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=len(requests), desc=api.label, unit="req", disable=not progress, leave=False)
    async with make_client(load.max_concurrency, timeout) as client:
        busy0 = await engine_busy_seconds(api)
        t0 = time.perf_counter()

        async def one(i: int, req: SampleRequest, at: float) -> RequestResult:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                res = await send_request(client, api, req, i, t0, scheduled_s=at)
            else:
                async with gate:
                    res = await send_request(client, api, req, i, t0, scheduled_s=at)
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(i, r, float(t)) for i, (r, t) in enumerate(zip(requests, times))))
        duration = time.perf_counter() - t0
        busy1 = await engine_busy_seconds(api)
    bar.close()
    metrics = calculate_metrics(results, duration, slos, percentiles)
    if busy0 is not None and busy1 is not None:
        metrics["engine_idle_fraction"] = max(0.0, 1.0 - (busy1 - busy0) / duration)
    return RunResult(api.label, load, list(results), duration, metrics)


async def engine_busy_seconds(api: ApiConfig) -> float | None:
    """A tokenmill server's tokenmill:engine_busy_seconds_total from its /metrics (None from other servers):
    over a run, 1 - its increase / the run's duration is the engine step loop's idle fraction."""
    from prometheus_client.parser import text_string_to_metric_families

    url = api.base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        async with httpx.AsyncClient(timeout=10) as client:  # its own: the run's pool may be all in use
            r = await client.get(url)
        if r.status_code != 200:
            return None
        for family in text_string_to_metric_families(r.text):
            if family.name == "tokenmill:engine_busy_seconds":
                return sum(s.value for s in family.samples if s.name.endswith("_total"))
    except Exception:  # noqa: BLE001 - not a tokenmill server, or no /metrics: the figure is left out
        return None
    return None


def run(api: ApiConfig, requests: Sequence[SampleRequest], load: LoadSpec, **kw) -> RunResult:
    return asyncio.run(run_async(api, requests, load, **kw))

