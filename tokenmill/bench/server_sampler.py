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
                if scrape.is_inference_server:
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
        (tokenmill), and the mean and peak of the server's running, waiting and KV-cache gauges."""
        if len(self.scrapes) < 2:
            return {}
        first, last = self.scrapes[0], self.scrapes[-1]
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
