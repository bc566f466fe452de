"""The live dashboard: ``/dashboard`` (a page, its script and a pinned uPlot, all shipped in the package),
``/dashboard/data`` (the metrics history as columns: the same registry ``/metrics`` renders, read every
second) and ``/dashboard/requests`` (the in-flight requests, without their text). Same auth as the API;
with ``--api-key`` a browser may send the key as HTTP Basic auth's password (it asks for it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.monitor.history import KEEP_S, WINDOW_S, MetricsHistory
from tokenmill.server.protocol import OpenAIError
from tokenmill.server.responses import json_response

logger = logging.getLogger("tokenmill.server")

STATIC = Path(__file__).parent / "static"
FILES = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "uPlot.LICENSE": "text/plain",
         "dashboard.js": "text/javascript", "dashboard.css": "text/css"}
MAX_ROWS = 1000
REQUEST_TABLE_TIMEOUT_S = 10.0


def _params(request: Request, allowed: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The query's numbers, each within its [low, high]; a 400 naming what is wrong otherwise."""
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise OpenAIError(400, f"unknown query parameter(s) {', '.join(unknown)}; this endpoint takes "
                          f"{', '.join(allowed) or 'none'}", unknown[0], "invalid_parameter")
    out = {}
    for name, (low, high) in allowed.items():
        raw = request.query_params.get(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not low <= value <= high:  # nan fails too
            raise OpenAIError(400, f"{name} must be a number from {low:g} to {high:g}, got {raw!r}", name,
                              "invalid_parameter")
        out[name] = value
    return out


def _columns(frames: list[dict]) -> dict[str, list]:
    keys = frames[0].keys() if frames else ("time",)
    return {k: [f[k] for f in frames] for k in keys}


async def sample_forever(history: MetricsHistory) -> None:
    """One reading a second, for as long as the server runs."""
    while True:
        try:
            history.sample()
        except Exception:
            logger.exception("could not read the metrics for the dashboard")
        await asyncio.sleep(history.interval)


@contextlib.asynccontextmanager
async def sampling(history: MetricsHistory | None):
    task = asyncio.create_task(sample_forever(history)) if history is not None else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def add_dashboard(app: FastAPI, engine: AsyncEngine, history: MetricsHistory, model_name: str) -> None:
    roofline = getattr(engine.engine.info, "roofline", None)
    device = roofline.device if roofline is not None else engine.engine.info.device

    @app.get("/dashboard")
    async def dashboard(request: Request) -> Response:
        _params(request, {})
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/static/{name}")
    async def static(name: str) -> Response:
        if name not in FILES:
            raise OpenAIError(404, f"no dashboard file {name!r}", None, "not_found")
        return FileResponse(STATIC / name, media_type=FILES[name], headers={"Cache-Control": "max-age=3600"})

    @app.get("/dashboard/data")
    async def data(request: Request) -> Response:
        q = _params(request, {"since": (0.0, 1e12), "window": (1.0, KEEP_S)})
        frames = history.frames(since=q.get("since", 0.0), window=q.get("window", WINDOW_S))
        return json_response({"model": model_name, "device": device,
                              "roofline_source": roofline.source if roofline is not None else "",
                              "window": q.get("window", WINDOW_S), "interval": history.interval,
                              "now": time.time(), "frames": _columns(frames)})

    @app.get("/dashboard/requests")
    async def requests(request: Request) -> Response:
        q = _params(request, {"limit": (1, MAX_ROWS)})
        limit = int(q.get("limit", 100))
        try:
            rows = await asyncio.wait_for(asyncio.wrap_future(engine.call_soon(engine.engine.request_table)),
                                          REQUEST_TABLE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a dead or stuck engine: say so, as /health does
            raise OpenAIError(503, f"the engine did not answer: {e!r}", None, "engine_unavailable") from None
        now = time.perf_counter()
        rows.sort(key=lambda r: r["arrival_time"])
        for r in rows:
            r["age_s"] = max(0.0, now - r.pop("arrival_time"))
        return json_response({"total": len(rows), "requests": rows[:limit]})
