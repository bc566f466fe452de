"""One benchmark run: release the requests on their schedule, send them, collect the timings."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from tokenmill.bench.arrivals import schedule
from tokenmill.bench.client import ApiConfig, RequestResult, make_client, send_request
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import calculate_metrics
from tokenmill.bench.server_sampler import ServerSampler


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
        sampler = ServerSampler(api)
        await sampler.start()
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
        server = await sampler.stop()
    bar.close()
    metrics = calculate_metrics(results, duration, slos, percentiles)
    metrics.update(server)
    return RunResult(api.label, load, list(results), duration, metrics)


def run(api: ApiConfig, requests: Sequence[SampleRequest], load: LoadSpec, **kw) -> RunResult:
    return asyncio.run(run_async(api, requests, load, **kw))

