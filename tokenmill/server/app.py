"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize (server/tokenization.py),
GET /v1/models, GET /health, GET /metrics, GET /version, GET /dashboard (server/dashboard.py). Every error is an OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad input, 401 without
the API key, 503 when overloaded or draining, 500 when the engine loop died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.live_cost import LiveCostModel
from tokenmill.engine.timelines import TimelineRecorder
from tokenmill.engine.tracing import RequestTracer
from tokenmill.engine.utilization import Nvml, ProcessCpu, UtilizationMeter
from tokenmill.monitor.history import MetricsHistory
from tokenmill.server.chat import ChatMixin
from tokenmill.server.completions import CompletionsMixin
from tokenmill.server.dashboard import add_dashboard, sampling
from tokenmill.server.live_replay import LiveReplay
from tokenmill.server.logprobs import LogprobsMixin
from tokenmill.server.lora import LoRAMetrics, add_lora_routes
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.middleware import AuthMiddleware, BodyLimitMiddleware
from tokenmill.server.pooling import EmbeddingRequest, PoolingMixin, RerankRequest, ScoreRequest
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError,
                                      TokenizeRequest, error_body)
from tokenmill.server.responses import _error_response, json_response
from tokenmill.server.responses_api import ResponsesMixin
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.serving import ServerConfig, ServingBase, _validation_error
from tokenmill.server.streaming import _ClientGone
from tokenmill.server.tokenization import TokenizeMixin
from tokenmill.version import __version__

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

logger = logging.getLogger("tokenmill.server")


class OpenAIServing(CompletionsMixin, ChatMixin, ResponsesMixin, PoolingMixin, TokenizeMixin, LogprobsMixin,
                    ServingBase):
    """The OpenAI endpoints over one AsyncEngine (each concern in its own module)."""


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app. Its lifespan starts ``engine`` (if needed) and shuts it down at exit."""
    config = config or ServerConfig()
    serving = OpenAIServing(engine, config)
    info = engine.engine.info
    meter = UtilizationMeter(info.roofline, ProcessCpu(lambda: engine.engine.core_pid))
    metrics = ServerMetrics(serving.model_name, lambda: engine.snapshot, serving.max_model_len, utilization=meter,
                            nvml=Nvml(info.device, info.device_uuid))
    engine.observers.append(metrics)
    if serving.loras.enabled:
        engine.observers.append(LoRAMetrics(metrics.registry, serving.model_name))
    serving.on_refused = metrics.on_refused
    live_cost = LiveCostModel()  # the simulator's cost model fitted on the served steps, and its error
    engine.observers.append(live_cost)
    metrics.add_gauge("tokenmill:step_time_prediction_error",
                      "The live-fitted step-cost model's out-of-sample prediction error over the last 200 steps: "
                      "sum |predicted - observed| / sum observed cycle time (NaN until it has fitted 50 steps).",
                      lambda: live_cost.error)
    metrics.add_gauge("tokenmill:step_time_prediction_bias",
                      "The same, signed: sum (predicted - observed) / sum observed (above 0: it predicts slower).",
                      lambda: live_cost.bias)
    timelines = None
    if config.request_timelines:
        sched = engine.engine.config.scheduler
        target_ms = sched.itl_target_ms or sched.slo_tpot_ms
        timelines = TimelineRecorder(config.request_timelines, itl_target_s=target_ms / 1e3 if target_ms else None)
        engine.observers.append(timelines)
    replayer = None
    if timelines is not None and config.live_replay_interval:
        replayer = LiveReplay(timelines, live_cost, lambda: engine_settings(engine), config.live_replay_interval)
        for which in ("predicted", "observed"):
            for what, means in (("ttft", "time to first token"), ("tpot", "time per output token after the first")):
                metrics.add_gauge(f"tokenmill:replay_{which}_{what}_seconds",
                                  f"Mean {means} of the last 200 finished requests, {which}"
                                  + (" by replaying their arrivals through the simulator with the live-fitted "
                                     "step-cost model" if which == "predicted" else " as served")
                                  + " (--live-replay-interval; NaN until the first replay).",
                                  lambda k=f"{which}_{what}_s": replayer.value(k))
    tracer = None
    if config.otlp_traces_endpoint:  # the config checked that timelines are on
        tracer = RequestTracer(config.otlp_traces_endpoint, timelines, serving.model_name)
        engine.observers.append(tracer)  # after the timelines: a request's end is recorded before it is traced
        serving.tracer = tracer

    history = MetricsHistory(metrics.registry.collect) if config.dashboard else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if replayer is not None:
            replayer.start()
        logger.info("serving %s (context %d tokens)", serving.model_name, serving.max_model_len)
        try:
            async with sampling(history):
                yield
        finally:
            if replayer is not None:
                await asyncio.to_thread(replayer.stop)
            await asyncio.to_thread(engine.shutdown, 30.0)
            for obs in (metrics, timelines, live_cost, tracer):
                if obs is not None and obs in engine.observers:
                    engine.observers.remove(obs)
            if tracer is not None:
                await asyncio.to_thread(tracer.shutdown)  # exports what finished

    app = FastAPI(title="tokenmill", version=_version(), lifespan=lifespan)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.history = history
    app.state.timelines = timelines
    app.state.live_cost = live_cost
    app.state.tracer = tracer
    app.state.live_replay = replayer

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "request_too_large"}.get(exc.status_code)
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and msg == "There was an error parsing the body":
            msg = "the request body could not be parsed as JSON"
        return _error_response(OpenAIError(exc.status_code, msg, None, code, headers=exc.headers))

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.error("internal error on %s: %r", request.url.path, exc, exc_info=exc)
        return _error_response(OpenAIError(500, f"internal server error: {type(exc).__name__}", None,
                                           "internal_error"))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat_completions(body, raw)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await serving.create_response(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return json_response(serving.stored_response(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return json_response(serving.delete_response(response_id))

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await serving.embeddings(body, raw)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(body: ScoreRequest, raw: Request) -> Response:
        return await serving.score(body, raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(body: RerankRequest, raw: Request) -> Response:
        return await serving.rerank(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await serving.detokenize(body)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": serving.created, "owned_by": "tokenmill",
             "root": engine.engine.model_name, "max_model_len": serving.max_model_len}
            for name in serving.model_names] + serving.loras.cards(serving.max_model_len)})

    @app.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(request_id: str) -> Response:
        if timelines is None:
            raise OpenAIError(404, "request timelines are off (--request-timelines 0)", code="timelines_off")
        found = timelines.timeline(request_id)
        if found is None:
            raise OpenAIError(404, f"no timeline for request {request_id!r}: it is not among the in-flight requests "
                                   f"and the last {config.request_timelines} finished ones (the response's \"id\")",
                              param="request_id", code="request_not_found")
        return json_response(found)

    @app.get("/v1/requests/{request_id}/window")
    async def request_window(request_id: str) -> Response:
        """The traffic around a request, the engine's scheduling settings and the live cost model: what
        `tokenmill explain` replays through the simulator."""
        if timelines is None:
            raise OpenAIError(404, "request timelines are off (--request-timelines 0)", code="timelines_off")
        found = timelines.window(request_id)
        if found is None:
            raise OpenAIError(404, f"no timeline for request {request_id!r}", param="request_id",
                              code="request_not_found")
        found["engine"] = engine_settings(engine)
        found["cost_model"] = live_cost.describe()
        return json_response(found)

    @app.get("/v1/cost_model")
    async def cost_model() -> Response:
        """The step-cost model fitted on the served steps (what `tokenmill explain` replays with)."""
        return json_response(live_cost.describe())

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None or not engine.is_running:
            why = f"the engine loop died: {engine.error!r}" if engine.error is not None else "the engine is not running"
            return json_response(error_body(why, "server_error", None, "engine_dead"), 503)
        if serving.draining or not engine.accepting:
            return json_response(error_body("the server is shutting down", "server_error", None, "draining"), 503)
        return json_response({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": _version()})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if history is not None:
        add_dashboard(app, engine, history, serving.model_name)
    add_lora_routes(app, serving.loras)

    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_bytes, timeout=config.request_body_timeout)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key)  # outermost: auth before anything else
    return app


def engine_settings(engine: AsyncEngine) -> dict:
    """What a replay of the served traffic schedules with: the scheduler's settings and the KV pool."""
    info = engine.engine.info
    return {"scheduler": dataclasses.asdict(info.config.scheduler), "num_blocks": info.num_blocks,
            "block_size": info.block_size, "max_model_len": info.max_model_len,
            "enable_prefix_caching": info.config.cache.enable_prefix_caching,
            "speculative": {"method": info.config.speculative.speculative_method,
                            "k": info.config.speculative.num_speculative_tokens}}


def _version() -> str:
    return __version__
