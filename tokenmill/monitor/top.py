"""``tokenmill top``: a terminal live view of any server that exports vLLM's metric names (tokenmill's, or
vLLM's own): requests running and waiting, KV-cache use, throughput, TTFT and ITL percentiles from the
histograms' deltas, and, from tokenmill, the device's busy share and roofline use. ``--once`` prints one
snapshot (two readings ``--interval`` apart) for scripts."""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tokenmill.monitor.history import RATE_WINDOW_S
from tokenmill.monitor.scrape import Scrape, frame


class TopError(Exception):
    """The server cannot be read: what is wrong and what to do."""


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/metrics"):
        return url
    return url.removesuffix("/v1") + "/metrics"


def read(client: httpx.Client, url: str) -> Scrape:
    """One reading of ``url`` (a /metrics page)."""
    try:
        r = client.get(url)
    except httpx.HTTPError as e:
        raise TopError(f"cannot reach {url}: {e}; is the server running there?") from None
    if r.status_code == 401:
        raise TopError(f"{url} needs an API key: pass --api-key or set TOKENMILL_API_KEY")
    if r.status_code != 200:
        raise TopError(f"{url} answered HTTP {r.status_code}; top reads a Prometheus /metrics page")
    try:
        scrape = Scrape.from_text(r.text, time.time())
    except ValueError as e:
        raise TopError(f"{url} is not in Prometheus' text format ({e})") from None
    if not scrape.is_inference_server:
        raise TopError(f"{url} has no vllm:num_requests_running: not a server that exports vLLM's metrics")
    return scrape


def _fmt(v: float | None, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}{unit}"


def render(url: str, f: dict, scrape: Scrape, window: float) -> Group:
    """One screen: the figures of frame ``f``, in rows a person reads left to right."""
    span = f"over {window:g} s"
    table = Table(show_header=False, box=None, padding=(0, 2))
    for _ in range(4):
        table.add_column()
    rows = [
        ("running", _fmt(f["running"], digits=0), "waiting", _fmt(f["waiting"], digits=0)),
        ("KV cache used", _fmt(f["kv_usage"], 100, 1, "%"), "prefix-cache hits", _fmt(f["prefix_hit_rate"], 100, 1, "%")),
        ("prompt tokens/s", _fmt(f["prompt_tps"]), "generation tokens/s", _fmt(f["generation_tps"])),
        ("requests finished/s", _fmt(f["finished_per_s"], digits=2), "preemptions/s", _fmt(f["preemptions_per_s"], digits=2)),
        (f"TTFT p50 / p99 {span}", f"{_fmt(f['ttft_p50'], 1e3, 0)} / {_fmt(f['ttft_p99'], 1e3, 0)} ms",
         f"ITL p50 / p99 {span}", f"{_fmt(f['itl_p50'], 1e3, 0)} / {_fmt(f['itl_p99'], 1e3, 0)} ms"),
    ]
    if f["device_busy"] is not None:  # tokenmill's own
        rows.append(("device busy", _fmt(f["device_busy"], 100, 0, "%"), "engine CPU",
                     _fmt(f["engine_cpu_utilization"], 100, 0, "%")))
        rows.append(("of peak FLOP/s (busy)", _fmt(f["flops_utilization"], 100, 1, "%"), "of peak bandwidth (busy)",
                     _fmt(f["bandwidth_utilization"], 100, 1, "%")))
    if f["gpu_utilization"] is not None:
        rows.append(("GPU utilization (NVML)", _fmt(f["gpu_utilization"], 100, 0, "%"), "", ""))
    if f["spec_acceptance"] is not None:
        rows.append(("speculative acceptance", _fmt(f["spec_acceptance"], 100, 1, "%"), "", ""))
    rows.append(("generation tokens", _fmt(f["generation_tokens_total"], digits=0), "requests finished",
                 _fmt(f["finished_total"], digits=0)))
    for a, b, c, d in rows:
        table.add_row(Text(a, style="dim"), Text(b, style="bold"), Text(c, style="dim"), Text(d, style="bold"))
    title = Text(f"{scrape.model or 'model ?'} at {url}   {time.strftime('%H:%M:%S', time.localtime(f['time']))}",
                 style="bold")
    return Group(title, table)


class Top:
    """Readings of one server, and the frame of the newest against those before it."""

    def __init__(self, url: str, window: float, api_key: str | None, timeout: float) -> None:
        self.url, self.window = metrics_url(url), window
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout)
        self.scrapes: deque[Scrape] = deque()

    def step(self) -> tuple[dict, Scrape]:
        cur = read(self.client, self.url)
        if self.scrapes and self.scrapes[-1].values.get("vllm:generation_tokens_total", 0) > cur.values.get(
                "vllm:generation_tokens_total", 0):
            self.scrapes.clear()  # the server restarted: its counters began again
        self.scrapes.append(cur)
        while len(self.scrapes) > 2 and self.scrapes[1].time <= cur.time - self.window:
            self.scrapes.popleft()

        def before(span: float) -> Scrape | None:
            older = [s for s in self.scrapes if s.time <= cur.time - span] or list(self.scrapes)[:1]
            return older[-1] if older[-1] is not cur else None

        return frame(cur, before(min(RATE_WINDOW_S, self.window)), before(self.window)), cur


def cmd_top(a: argparse.Namespace) -> int:
    if not a.interval > 0 or not a.window > 0:
        raise ValueError("--interval and --window must be positive")
    top = Top(a.url, a.window, a.api_key, a.timeout)
    console = Console()
    try:
        if a.once:
            top.step()
            time.sleep(a.interval)
            f, scrape = top.step()
            console.print(render(top.url, f, scrape, a.window))
            return 0
        f, scrape = top.step()  # a server that cannot be read at all: say so and exit
        with Live(render(top.url, f, scrape, a.window), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(a.interval)
                try:
                    f, scrape = top.step()
                    live.update(render(top.url, f, scrape, a.window), refresh=True)
                except TopError as e:  # it went away: keep the last screen, say why, keep trying
                    live.update(Group(render(top.url, f, scrape, a.window), Text(str(e), style="bold red")),
                                refresh=True)
    except TopError as e:
        print(f"tokenmill top: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        top.client.close()
