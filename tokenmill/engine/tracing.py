"""OpenTelemetry traces: one span per request, exported over OTLP/HTTP (``--otlp-traces-endpoint``).

Each finished request's timeline (engine/timelines.py) becomes a span tree: a root ``llm_request`` span
(SERVER kind, a child of the caller's trace when its HTTP request carried ``traceparent``), with the
attributes vLLM's tracing sets (``gen_ai.*``: tokens, sampling, queue/TTFT/e2e/prefill/decode latencies), and
child spans for the queue, each prefill chunk, the decode phase, each preemption and each KV transfer.
Spans are built from the recorded times on a thread of their own, after the request finished, so the engine
thread only hands over an id; the SDK's batch processor exports them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from collections.abc import Mapping

    from tokenmill.engine.messages import StepStats
    from tokenmill.engine.timelines import TimelineRecorder
    from tokenmill.outputs import RequestOutput
    from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

MAX_PENDING = 10_000  # requests announced and not finished yet (a request the engine never took drops out)


def traces_endpoint(url: str) -> str:
    """The OTLP/HTTP traces URL for ``url``: as given if it names a path, else with ``/v1/traces`` added (the
    OTLP convention for a collector's base address)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint {url!r}: tokenmill exports OTLP over HTTP/protobuf; give the "
                         "collector's HTTP address, e.g. http://localhost:4318/v1/traces")
    return url if parts.path not in ("", "/") else url.rstrip("/") + "/v1/traces"


def _sdk() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK ({e.name} is missing): pip install "
                           "'tokenmill[tracing]'") from None
    return OTLPSpanExporter, Resource, TracerProvider, BatchSpanProcessor


class RequestTracer:
    """An engine observer that turns finished requests' timelines into spans. ``announce`` (the server, before
    it queues a request) keeps the caller's trace context and the sampling settings for the root span."""

    def __init__(self, endpoint: str, timelines: TimelineRecorder, model: str, *, service_name: str = "tokenmill",
                 export_delay_ms: int = 1000) -> None:
        exporter_cls, resource_cls, provider_cls, processor_cls = _sdk()
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = traces_endpoint(endpoint)
        self.provider = provider_cls(resource=resource_cls.create({"service.name": service_name}))
        self.provider.add_span_processor(processor_cls(exporter_cls(endpoint=self.endpoint),
                                                       schedule_delay_millis=export_delay_ms))
        self.tracer = self.provider.get_tracer("tokenmill")
        self.propagator = TraceContextTextMapPropagator()
        self.timelines, self.model = timelines, model
        # perf_counter (the timelines' clock) to the epoch nanoseconds spans carry
        self.epoch_offset = time.time() - time.perf_counter()
        self._pending: OrderedDict[str, tuple[float, Any, dict]] = OrderedDict()
        self._lock = threading.Lock()
        self._ending: list[str] = []  # finished, waiting for their step's stats (the engine thread's)
        self._finished: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tokenmill-tracing", daemon=True)
        self._thread.start()

    # ---- the server (event loop) ----------------------------------------------------

    def announce(self, request_id: str, arrival: float, headers: Mapping[str, str], params: SamplingParams) -> None:
        """``arrival``: the request's arrival on the engine's clock (time.perf_counter)."""
        context = self.propagator.extract(carrier=dict(headers)) if "traceparent" in headers else None
        attrs = {"gen_ai.request.id": request_id, "gen_ai.response.model": self.model,
                 "gen_ai.request.max_tokens": params.max_tokens or 0, "gen_ai.request.temperature": params.temperature,
                 "gen_ai.request.top_p": params.top_p, "gen_ai.request.n": params.n}
        with self._lock:
            self._pending[request_id] = (arrival, context, attrs)
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)

    def withdraw(self, request_id: str) -> None:
        """The request was refused before the engine took it: nothing to trace."""
        with self._lock:
            self._pending.pop(request_id, None)

    # ---- the engine thread ----------------------------------------------------------

    def on_request_finished(self, output: RequestOutput, now: float) -> None:
        self._ending.append(output.request_id)  # traced once its last step's stats are in (they come after)

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        pass

    def on_step(self, stats: StepStats) -> None:
        if self._ending:
            self._release()

    def _release(self) -> None:
        for rid in self._ending:
            self._finished.put(rid)
        self._ending.clear()

    # ---- the tracing thread ---------------------------------------------------------

    def _run(self) -> None:
        while (rid := self._finished.get()) is not None:
            try:
                self._export(rid)
            except Exception:  # noqa: BLE001 - a tracing bug must not stop tracing the next requests
                logger.exception("tracing request %s failed", rid)
            finally:
                self._finished.task_done()

    def _export(self, request_id: str) -> None:
        with self._lock:
            announced = self._pending.pop(request_id, None)
        tl = self.timelines.timeline(request_id)
        if announced is None or tl is None:  # not from the server, or its timeline is no longer kept
            return
        arrival, context, attrs = announced
        build_spans(self.tracer, tl, int((arrival + self.epoch_offset) * 1e9), context, attrs)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Export what finished so far (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._finished.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what finished (the engine has stopped: no step comes after the last finishes)."""
        self._release()
        self._finished.put(None)
        self._thread.join(timeout=10)
        self.provider.shutdown()


def build_spans(tracer: Any, tl: dict, arrival_ns: int, context: Any, attrs: dict) -> None:
    """The span tree of one timeline (``TimelineRecorder.timeline``'s data: seconds since arrival)."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    def at(t: float) -> int:
        return arrival_ns + int(t * 1e9)

    events = tl["events"]
    steps = [e for e in events if e["event"] == "step"]
    prefill = [e for e in steps if e["kind"] == "prefill"]
    decode = [e for e in steps if e["kind"] == "decode"]
    end = tl["e2e_s"] if tl["e2e_s"] is not None else max((e["t"] + e.get("duration", 0.0) for e in events),
                                                          default=0.0)
    queue_s = steps[0]["t"] if steps else end
    root_attrs = {**attrs, "gen_ai.usage.prompt_tokens": tl["prompt_tokens"],
                  "gen_ai.usage.completion_tokens": tl["output_tokens"],
                  "gen_ai.latency.time_in_queue": queue_s, "gen_ai.latency.e2e": end,
                  "gen_ai.latency.time_in_model_prefill": sum(e["duration"] for e in prefill),
                  "gen_ai.latency.time_in_model_decode": sum(e["duration"] for e in decode),
                  "gen_ai.latency.time_in_model_inference": sum(e["duration"] for e in steps),
                  "tokenmill.cached_tokens": tl["cached_tokens"], "tokenmill.num_preemptions": tl["num_preemptions"],
                  "tokenmill.status": tl["status"]}
    if tl["ttft_s"] is not None:
        root_attrs["gen_ai.latency.time_to_first_token"] = tl["ttft_s"]
    blame = tl.get("ttft_blame")
    if blame is not None:
        root_attrs["tokenmill.ttft_blame"] = blame["summary"]
    reason = next((e.get("reason") for e in events if e["event"] == "finished"), None)
    if reason:
        root_attrs["tokenmill.finish_reason"] = reason
    root = tracer.start_span("llm_request", context=context, kind=SpanKind.SERVER, start_time=at(0.0),
                             attributes=root_attrs)
    inside = trace.set_span_in_context(root)

    def child(name: str, t0: float, t1: float, **attributes: Any) -> None:
        span = tracer.start_span(name, context=inside, start_time=at(t0),
                                 attributes={k: v for k, v in attributes.items() if v is not None})
        span.end(end_time=at(max(t1, t0)))

    child("queue", 0.0, queue_s)
    for e in prefill:
        child("prefill", e["t"], e["t"] + e["duration"], **{"tokenmill.step": e["step"],
              "tokenmill.tokens": e["tokens"], "tokenmill.start_position": e["start_position"],
              "tokenmill.batch_size": e["batch_size"]})
    if decode:
        last = decode[-1]
        child("decode", decode[0]["t"], last["t"] + last["duration"], **{"tokenmill.steps": len(decode),
              "tokenmill.emitted": sum(e["emitted"] for e in decode),
              "tokenmill.drafts": sum(e["drafts"] for e in decode)})
    for i, e in enumerate(events):
        if e["event"] == "preempted":
            back = next((x["t"] for x in events[i + 1:] if x["event"] == "step"), end)
            child("preempted", e["t"], back, **{"tokenmill.reason": e["reason"], "tokenmill.needed_by": e["needed_by"]})
        elif e["event"] == "kv_transfer":
            child("kv_transfer", e["t"], e["t"] + e["duration"], **{"tokenmill.direction": e["direction"],
                  "tokenmill.blocks": e["blocks"], "tokenmill.bytes": e["bytes"], "tokenmill.error": e["error"]})
    root.end(end_time=at(end))
