"""``tokenmill router``: one OpenAI-compatible endpoint in front of prefill and decode instances.

Each completion or chat request is sent first to a producer (``--kv-role producer``) with max_tokens 1,
stream off and ``kv_transfer_params: {"do_remote_decode": true}``; the producer prefills it, keeps its KV
blocks and answers with where to pull them from. The request then goes, as the client sent it, to a
consumer (``--kv-role consumer``) with those ``kv_transfer_params``; the consumer pulls the KV, computes the
prompt's last token and streams the completion, which the router relays unchanged. So the client sees
one ordinary response, the same tokens colocated serving gives.

Balancing: each leg goes to the instance with the least load, counted as the requests the router has in
flight there plus the running and waiting requests its /metrics reported at the last poll (every
``poll_interval`` seconds); ties go round robin. An instance that does not answer (connection refused,
a 5xx) is marked down and the leg is retried on the next one; a marked instance is tried again after
the next poll finds it up. A client error (4xx) is passed through as it is.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.server.metrics import TTFT_BUCKETS

if TYPE_CHECKING:
    import argparse
    from collections.abc import AsyncIterator

logger = logging.getLogger("tokenmill.router")
ROUTES = ("/v1/completions", "/v1/chat/completions")
LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "tokenmill:num_requests_waiting_for_kv")


@dataclass(eq=False)
class Instance:
    url: str
    role: str  # "prefill" | "decode"
    inflight: int = 0  # this router's requests on it now
    load: float = 0.0  # running + waiting (+ waiting for KV) at its last /metrics poll
    kv_usage: float = 0.0
    up: bool = True
    kv_recv_seconds: float = 0.0  # a consumer's KV pulls so far, at its last poll: their time and number
    kv_recv_count: float = 0.0


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "param": None, "code": code}}, status)


class Router:
    def __init__(self, prefill: list[str], decode: list[str], api_key: str | None = None,
                 poll_interval: float = 1.0, timeout: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one --prefill and one --decode instance URL")
        self.prefill = [Instance(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Instance(u.rstrip("/"), "decode") for u in decode]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.poll_interval = poll_interval
        self.timeout = timeout
        self._turn = itertools.count()
        self.client: httpx.AsyncClient | None = None
        reg = self.registry = CollectorRegistry()
        self.requests = Counter("tokenmill:router_requests", "Legs sent to each instance, by outcome (ok, "
                                "client_error, failed: retried elsewhere).", ["role", "instance", "outcome"],
                                registry=reg)
        self.retries = Counter("tokenmill:router_retries", "Legs retried on another instance after one failed.",
                               ["role"], registry=reg)
        self.prefill_s = Histogram("tokenmill:router_prefill_seconds", "Prefill leg: from the client's request to "
                                   "the producer's answer (queueing and prefill on the producer).", buckets=TTFT_BUCKETS,
                                   registry=reg)
        self.decode_first_s = Histogram("tokenmill:router_decode_first_byte_seconds", "Decode leg: from sending it "
                                        "to the consumer's first streamed event (KV transfer, the prompt's last "
                                        "token and queueing on the consumer; unstreamed: the whole answer).",
                                        buckets=TTFT_BUCKETS, registry=reg)
        self.ttft_s = Histogram("tokenmill:router_time_to_first_token_seconds", "Streaming requests: from the "
                                "client's request to the first content event relayed.", buckets=TTFT_BUCKETS,
                                registry=reg)
        up = Gauge("tokenmill:router_instance_up", "1 if the instance answered its last poll or leg.",
                   ["role", "instance"], registry=reg)
        load = Gauge("tokenmill:router_instance_load", "The instance's load as the router balances on it: its "
                     "router requests in flight plus its running and waiting requests at the last poll.",
                     ["role", "instance"], registry=reg)
        # the consumers' KV pulls, summed at the last poll: with the two histograms above, TTFT's split into
        # prefill, transfer and first decode (`tokenmill bench serve` reports it)
        Gauge("tokenmill:router_kv_transfer_time_seconds", "The decode instances' KV pulls: seconds in all, as "
              "their /metrics said at the last poll.", registry=reg).set_function(
            lambda: sum(i.kv_recv_seconds for i in self.decode))
        Gauge("tokenmill:router_kv_transfers", "The decode instances' KV pulls: how many, at the last poll.",
              registry=reg).set_function(lambda: sum(i.kv_recv_count for i in self.decode))
        for inst in self.prefill + self.decode:
            up.labels(inst.role, inst.url).set_function(lambda i=inst: float(i.up))
            load.labels(inst.role, inst.url).set_function(lambda i=inst: i.inflight + i.load)

    # ---- balancing -----------------------------------------------------------------------

    def pick(self, pool: list[Instance], tried: set) -> Instance | None:
        """The least loaded instance not tried yet (up ones first; ties round robin)."""
        left = [i for i in pool if i not in tried]
        if not left:
            return None
        turn = next(self._turn)
        return min(left, key=lambda i: (not i.up, i.inflight + i.load, (pool.index(i) - turn) % len(pool)))

    async def poll(self) -> None:
        """Read every instance's /metrics: its load, and whether it is up."""
        async def one(inst: Instance) -> None:
            try:
                r = await self.client.get(f"{inst.url}/metrics", headers=self.headers, timeout=5.0)
                r.raise_for_status()
                load = usage = recv_s = recv_n = 0.0
                for fam in text_string_to_metric_families(r.text):
                    for s in fam.samples:
                        if s.name in LOAD_METRICS:
                            load += s.value
                        elif s.name == "vllm:kv_cache_usage_perc":
                            usage = s.value
                        elif s.name.startswith("tokenmill:kv_transfer_seconds_") and s.labels.get("direction") == "recv":
                            if s.name.endswith("_sum"):
                                recv_s += s.value
                            elif s.name.endswith("_count"):
                                recv_n += s.value
                inst.load, inst.kv_usage, inst.up = load, usage, True
                inst.kv_recv_seconds, inst.kv_recv_count = recv_s, recv_n
            except (httpx.HTTPError, ValueError):
                inst.up = False

        await asyncio.gather(*(one(i) for i in self.prefill + self.decode))

    async def poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.poll_interval)

    # ---- one request ---------------------------------------------------------------------

    async def handle(self, path: str, raw: Request) -> Response:
        arrival = time.perf_counter()
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "the request body must be JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        prefill.update(max_tokens=1, n=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        answer = await self._leg(self.prefill, path, prefill)
        if isinstance(answer, Response):
            return answer
        inst, resp = answer
        try:
            content = await resp.aread()
        finally:
            await resp.aclose()
            inst.inflight -= 1
        if resp.status_code != 200:
            return Response(content, resp.status_code, media_type="application/json")
        try:
            params = json.loads(content)["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            return _error(502, f"the prefill instance {inst.url} answered without kv_transfer_params: start it with "
                          "--kv-role producer", "bad_gateway")
        self.prefill_s.observe(time.perf_counter() - arrival)

        sent = time.perf_counter()
        answer = await self._leg(self.decode, path, {**body, "kv_transfer_params": params})
        if isinstance(answer, Response):
            return answer
        inst, resp = answer
        media = resp.headers.get("content-type", "application/json")
        if not body.get("stream") or resp.status_code != 200:
            try:
                content = await resp.aread()
                self.decode_first_s.observe(time.perf_counter() - sent)  # (the whole completion, unstreamed)
                return Response(content, resp.status_code, media_type=media)
            finally:
                await resp.aclose()
                inst.inflight -= 1
        return StreamingResponse(self._relay(inst, resp, arrival, sent), media_type=media)

    async def _leg(self, pool: list[Instance], path: str, body: dict) -> tuple[Instance, httpx.Response] | Response:
        """Send ``body`` to the least loaded instance of ``pool``, the next one if it fails: (instance, open
        response) with the instance's in-flight count taken, or an error Response."""
        tried: set[Instance] = set()
        errors = []
        while True:
            inst = self.pick(pool, tried)
            if inst is None:
                role = pool[0].role
                return _error(503, f"no {role} instance answered ({'; '.join(errors)}); retry later",
                              "service_unavailable")
            if tried:
                self.retries.labels(inst.role).inc()
            tried.add(inst)
            inst.inflight += 1
            try:
                req = self.client.build_request("POST", inst.url + path, json=body, headers=self.headers,
                                                timeout=self.timeout)
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                inst.inflight -= 1
                inst.up = False
                errors.append(f"{inst.url}: {type(e).__name__}")
                self.requests.labels(inst.role, inst.url, "failed").inc()
                logger.warning("%s instance %s failed (%r): trying another", inst.role, inst.url, e)
                continue
            if resp.status_code >= 500:
                await resp.aread()
                await resp.aclose()
                inst.inflight -= 1
                errors.append(f"{inst.url}: HTTP {resp.status_code}")
                self.requests.labels(inst.role, inst.url, "failed").inc()
                logger.warning("%s instance %s answered %d: trying another", inst.role, inst.url, resp.status_code)
                continue
            inst.up = True
            self.requests.labels(inst.role, inst.url, "ok" if resp.status_code < 400 else "client_error").inc()
            return inst, resp

    async def _relay(self, inst: Instance, resp: httpx.Response, arrival: float, sent: float
                     ) -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in resp.aiter_raw():
                if first:
                    now = time.perf_counter()
                    self.ttft_s.observe(now - arrival)
                    self.decode_first_s.observe(now - sent)
                    first = False
                yield chunk
        finally:
            await resp.aclose()
            inst.inflight -= 1


def build_router_app(router: Router) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        task = asyncio.create_task(router.poll_forever())
        try:
            yield
        finally:
            task.cancel()
            await router.client.aclose()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)
    app.state.router = router

    for path in ROUTES:
        async def route(raw: Request, path: str = path) -> Response:
            return await router.handle(path, raw)

        app.add_api_route(path, route, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        for inst in sorted(router.decode, key=lambda i: not i.up):
            try:
                r = await router.client.get(f"{inst.url}/v1/models", headers=router.headers, timeout=10.0)
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.HTTPError:
                inst.up = False
        return _error(503, "no decode instance answered", "service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        ok = any(i.up for i in router.prefill) and any(i.up for i in router.decode)
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def run_router(a: argparse.Namespace) -> int:
    """``tokenmill router``: serve until SIGTERM/SIGINT."""
    import os

    from tokenmill.server.middleware import AuthMiddleware
    from tokenmill.server.run import make_server

    logging.getLogger("tokenmill").setLevel(logging.INFO)
    api_key = a.api_key or os.environ.get("TOKENMILL_API_KEY") or None
    router = Router(a.prefill, a.decode, api_key, a.poll_interval, a.timeout)
    app = build_router_app(router)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    logger.info("router on %s:%d: prefill %s, decode %s", a.host, a.port, ", ".join(a.prefill), ", ".join(a.decode))
    make_server(app, a.host, a.port, log_level=a.uvicorn_log_level).run()
    return 0
