"""OpenTelemetry traces (engine/tracing.py): the span tree built from a timeline, checked in memory (with a
preemption and a KV transfer), then the real model behind the HTTP server exporting to a real OTLP/HTTP
receiver on loopback, whose protobuf payloads the test decodes."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tokenmill.core.sched_output import KVTransferStats
from tokenmill.engine.messages import StepStats
from tokenmill.engine.timelines import TimelineRecorder
from tokenmill.engine.tracing import build_spans, traces_endpoint
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.serving import ServerConfig


def _stats(start, duration, requests, preempted=None, kv=None) -> StepStats:
    return StepStats(start, duration, 0, 0, len(requests), 0, 0, 0, 0, requests=requests, preempted=preempted,
                     kv_transfers=kv)


def test_a_timeline_becomes_a_span_tree_with_preemption_and_kv_transfer():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    rec = TimelineRecorder()
    rec.on_request_added("r", 10.0)
    rec.on_step(_stats(10.1, 0.2, [("r", 0, 256, 0, 0), ("x", 5, 1, 0, 1)]))
    rec.on_step(_stats(10.3, 0.1, [("r", 256, 44, 0, 1)]))
    rec.on_request_output(RequestOutput("r", None, [1] * 300, [CompletionOutput(0, "", [7], None)], False), 10.41)
    rec.on_step(_stats(10.45, 0.05, [("r", 300, 1, 0, 1)]))
    rec.on_step(_stats(10.5, 0.05, [("x", 6, 1, 0, 1)], preempted={"r": "x"}))
    rec.on_step(_stats(10.6, 0.05, [("r", 0, 301, 0, 1)], kv=[KVTransferStats("send", "r", 3, 3072, 0.02)]))
    rec.on_request_output(RequestOutput("r", None, [1] * 300, [CompletionOutput(0, "", [7, 8, 9], "length")], True),
                          10.7)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    build_spans(provider.get_tracer("t"), rec.timeline("r"), 1_000_000_000, None, {"gen_ai.request.id": "r"})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["decode", "kv_transfer", "llm_request", "preempted", "prefill", "prefill", "prefill", "queue"]
    root = spans["llm_request"]
    assert all(s.parent.span_id == root.context.span_id for s in exporter.get_finished_spans() if s is not root)
    assert root.start_time == 1_000_000_000 and root.end_time == pytest.approx(1_700_000_000, abs=10)
    assert root.attributes["gen_ai.usage.prompt_tokens"] == 300 and root.attributes["gen_ai.usage.completion_tokens"] == 3
    assert root.attributes["gen_ai.latency.time_in_queue"] == pytest.approx(0.1)
    assert root.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(0.41)
    assert root.attributes["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.2 + 0.1 + 0.05)  # (a re-prefill)
    pre = spans["preempted"]
    assert pre.attributes["tokenmill.needed_by"] == "x"
    assert (pre.start_time, pre.end_time) == (pytest.approx(1.5e9, abs=10), pytest.approx(1.6e9, abs=10))
    kv = spans["kv_transfer"]
    assert kv.attributes["tokenmill.bytes"] == 3072 and kv.end_time - kv.start_time == pytest.approx(2e7, abs=10)


def test_bad_tracing_settings_are_refused_with_what_to_give():
    assert traces_endpoint("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_endpoint("http://c:4318/custom/path") == "http://c:4318/custom/path"
    with pytest.raises(ValueError, match="OTLP over HTTP"):
        ServerConfig(otlp_traces_endpoint="grpc://localhost:4317")
    with pytest.raises(ValueError, match="--request-timelines above 0"):
        ServerConfig(otlp_traces_endpoint="http://localhost:4318", request_timelines=0)


# ---- the real model, a real OTLP/HTTP receiver ----------------------------------------------------------------


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: POST /v1/traces with an ExportTraceServiceRequest (protobuf)."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the http.server name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest.FromString(body)
        self.server.paths.append(self.path)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                self.server.spans.extend(ss.spans)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


def _attrs(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def test_a_served_request_arrives_at_the_otlp_receiver_as_a_span_tree(llm_fp32):
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.app import build_app
    from tokenmill.server.run import BackgroundServer

    receiver = Receiver()
    ae = AsyncEngine(llm_fp32.engine, max_waiting_requests=8, log_interval=None, log_requests=False)
    app = build_app(ae, ServerConfig(dashboard=False, otlp_traces_endpoint=receiver.url))
    srv = BackgroundServer(app).start()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            prompt = llm_fp32.engine.tokenizer.encode(" ".join(f"The hill{i % 17} turns north." for i in range(200)))
            body = {"model": model, "prompt": prompt[:600], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            r = http.post("/v1/completions", json=body, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
            assert r.status_code == 200
            traced = r.json()["id"]
            untraced = http.post("/v1/completions", json={**body, "prompt": "Hello"}).json()["id"]
        app.state.tracer.flush()
        deadline = time.monotonic() + 30
        while len({_attrs(s).get("gen_ai.request.id") for s in receiver.spans} & {traced, untraced}) < 2:
            assert time.monotonic() < deadline, f"the receiver got {len(receiver.spans)} spans"
            time.sleep(0.05)
    finally:
        srv.stop(60)
        receiver.shutdown()
    assert set(receiver.paths) == {"/v1/traces"}
    roots = {_attrs(s)["gen_ai.request.id"]: s for s in receiver.spans if s.name == "llm_request"}
    root = roots[traced]
    # a child of the caller's span, in the caller's trace; the request without traceparent starts its own
    assert root.trace_id.hex() == trace_id and root.parent_span_id.hex() == parent_id
    assert roots[untraced].trace_id.hex() != trace_id and not roots[untraced].parent_span_id
    attrs = _attrs(root)
    assert attrs["gen_ai.usage.prompt_tokens"] == 600 and attrs["gen_ai.usage.completion_tokens"] == 4
    assert attrs["gen_ai.request.max_tokens"] == 4 and attrs["gen_ai.response.model"] == model
    assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    children = [s for s in receiver.spans if s.parent_span_id == root.span_id]
    names = [s.name for s in sorted(children, key=lambda s: s.start_time_unix_nano)]
    # the step budget is 256 tokens: 600 prompt tokens in three chunks, then the decode of the rest
    assert names == ["queue", "prefill", "prefill", "prefill", "decode"], names
    assert sum(_attrs(s)["tokenmill.tokens"] for s in children if s.name == "prefill") == 600
    assert all(root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano
               <= root.end_time_unix_nano for s in children)
    decode = next(s for s in children if s.name == "decode")
    assert _attrs(decode)["tokenmill.steps"] == 3  # the first token came with the last chunk
