"""The server's side of a benchmark run: its /metrics read once a second while the run lasts (any server
exporting vLLM's names; tokenmill's adds the device). What comes back goes into the run's results."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

import httpx

from tokenmill.bench.client import ApiConfig
from tokenmill.monitor.scrape import Scrape, frame

INTERVAL_S = 1.0


class ServerSampler:
    def __init__(self, api: ApiConfig, interval: float = INTERVAL_S) -> None:
        self.url = api.base_url.rstrip("/").removesuffix("/v1") + "/metrics"
        self.headers = {"Authorization": f"Bearer {api.api_key}"} if api.api_key else {}
        self.interval = interval
        self.scrapes: list[Scrape] = []
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None

    async def _read(self) -> None:
        try:
            r = await self._client.get(self.url)
            if r.status_code == 200:
                scrape = Scrape.from_text(r.text, time.time())
                if scrape.is_inference_server or scrape.is_router:
                    self.scrapes.append(scrape)
        except Exception:  # noqa: BLE001 - no /metrics, or not Prometheus text: the figures are left out
            pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._read()

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=10, headers=self.headers)  # its own: the run's may be full
        await self._read()  # the reading the run's deltas start from
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, float]:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._read()  # the closing reading
        await self._client.aclose()
        return self.summary()

    def summary(self) -> dict[str, float]:
        """Over the run: the device's busy share and roofline use, the engine's idle share and CPU use
        (tokenmill), and the mean and peak of the server's running, waiting and KV-cache gauges. Behind
        tokenmill's router: the mean TTFT split into the prefill leg, the KV transfer and the first decode."""
        if len(self.scrapes) < 2:
            return {}
        first, last = self.scrapes[0], self.scrapes[-1]
        if last.is_router:
            return router_split(first, last)
        f = frame(last, first, first)
        out = {}
        for key, name in (("device_busy", "device_busy_ratio"), ("engine_idle", "engine_idle_fraction"),
                          ("engine_cpu_utilization", "engine_cpu_utilization"),
                          ("flops_utilization", "flops_utilization"),
                          ("bandwidth_utilization", "bandwidth_utilization")):
            if f[key] is not None:
                out[name] = f[key]
        for key, name in (("running", "server_running"), ("waiting", "server_waiting"),
                          ("kv_usage", "server_kv_cache_usage")):
            values = [v for s in self.scrapes if (v := s.get(key)) is not None]
            if values:
                out[f"mean_{name}"] = statistics.fmean(values)
                out[f"max_{name}"] = max(values)
        return out


def router_split(first: Scrape, last: Scrape) -> dict[str, float]:
    """Over a run through tokenmill's router, the mean time to first token's parts: the prefill leg (queueing
    and prefill on a producer), the KV transfer (the consumer's pull) and the first decode (the rest of the
    decode leg until its first bytes: the prompt's last token and queueing)."""
    def mean(total: str, count: str) -> float | None:
        n = (last.get(count) or 0.0) - (first.get(count) or 0.0)
        return ((last.get(total) or 0.0) - (first.get(total) or 0.0)) / n if n > 0 else None

    prefill = mean("router_prefill_s", "router_prefills")
    transfer = mean("router_kv_transfer_s", "router_kv_transfers")
    decode = mean("router_decode_first_s", "router_decodes")
    out = {}
    if prefill is not None:
        out["mean_ttft_prefill_ms"] = 1e3 * prefill
    if transfer is not None:
        out["mean_ttft_kv_transfer_ms"] = 1e3 * transfer
    if decode is not None:
        out["mean_ttft_first_decode_ms"] = 1e3 * (decode - (transfer or 0.0))
    return out
