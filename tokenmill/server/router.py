"""``tokenmill router``: one OpenAI-compatible endpoint in front of replicas, or of prefill and decode instances.

Replicas (``--replica URL``, plain ``tokenmill serve`` instances): each request goes to one replica, chosen
by ``--policy`` (server/routing_policy.py): ``prefix`` sends it where its prompt's prefix was sent before
(SGLang's cache-aware routing, bounded by load imbalance), ``least-loaded`` or ``round-robin``.

Prefill/decode pairs (``--prefill``/``--decode``): each completion or chat request is sent first to a producer
(``--kv-role producer``) with max_tokens 1, stream off and ``kv_transfer_params: {"do_remote_decode": true}``;
the producer prefills it, keeps its KV blocks and answers with where to pull them from. The request then
goes, as the client sent it, to a consumer (``--kv-role consumer``) with those ``kv_transfer_params``; the
consumer pulls the KV, computes the prompt's last token and streams the completion, which the router
relays unchanged. So the client sees one ordinary response, the same tokens colocated serving gives. Each
leg goes to the instance with the least load; ties go round robin.

Load is the requests the router has in flight on an instance plus the running and waiting requests its
/metrics reported at the last poll (every ``poll_interval`` seconds). Failures: an instance that does not
answer (connection refused or reset) or answers a 5xx is marked down and the request retried on another
while nothing has been relayed yet (a 503, an overloaded instance, is retried without marking it down); a
stream that breaks after its first event ends with an error event and ``[DONE]``, since it cannot be resumed
elsewhere. The poll (``/health``, then ``/metrics``) brings an instance back once it answers. A client
error (4xx) is passed through as it is.
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
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.server.router_metrics import Instance, RouterMetrics
from tokenmill.server.routing_policy import Balancer, Choice, RoutingConfig, routing_key

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from starlette.types import Receive, Scope, Send

__all__ = ["Instance", "Router", "build_router_app"]

logger = logging.getLogger("tokenmill.router")
ROUTES = ("/v1/completions", "/v1/chat/completions")
LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "tokenmill:num_requests_waiting_for_kv")


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "param": None, "code": code}}, status)


def _forgets(e: Exception) -> bool:
    """Whether a failure means the instance's process went away (its cache with it), not just slowness."""
    return not isinstance(e, httpx.TimeoutException)


@dataclass(eq=False)
class Leg:
    """One request sent to one instance: its response with the instance's in-flight count taken, and what was
    read of it. ``done``: the whole body is in ``head`` and the response closed (its count given back)."""
    inst: Instance
    resp: httpx.Response
    chunks: AsyncIterator[bytes] | None
    head: bytes
    done: bool

    async def release(self) -> None:
        """Close the response and give the in-flight count back, once."""
        if not self.done:
            self.done = True
            await self.resp.aclose()
            self.inst.inflight -= 1


class _RelayResponse(StreamingResponse):
    """A relayed stream whose upstream is released even where the stream never started (the client left
    before its first byte went out: the generator's own ``finally`` never runs then)."""

    def __init__(self, content: AsyncIterator[bytes], leg: Leg, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.leg = leg

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.leg.release()


class Router:
    def __init__(self, prefill: Sequence[str] = (), decode: Sequence[str] = (), api_key: str | None = None,
                 poll_interval: float = 1.0, timeout: float = 600.0, *, replicas: Sequence[str] = (),
                 routing: RoutingConfig | None = None) -> None:
        if replicas and (prefill or decode):
            raise ValueError("--replica cannot be combined with --prefill/--decode: route to plain replicas or to "
                             "prefill/decode pairs, one router for each")
        if not replicas and (not prefill or not decode):
            raise ValueError("the router needs --replica URLs, or at least one --prefill and one --decode instance "
                             "URL")
        urls = [u.rstrip("/") for u in replicas]
        if len(set(urls)) < len(urls):
            raise ValueError("--replica: a URL is given twice")
        self.prefill = [Instance(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Instance(u.rstrip("/"), "decode") for u in decode]
        self.replicas = [Instance(u, "replica") for u in urls]
        self.balancer = Balancer(urls, routing) if urls else None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.poll_interval = poll_interval
        self.timeout = timeout
        self._turn = itertools.count()
        self.client: httpx.AsyncClient | None = None
        self.metrics = RouterMetrics(self.instances, lambda u: self.balancer.tree.sizes.get(u, 0))
        self.registry = self.metrics.registry

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode + self.replicas

    # ---- balancing -----------------------------------------------------------------------

    def pick(self, pool: list[Instance], tried: set) -> Instance | None:
        """The least loaded instance not tried yet (up ones first; ties round robin)."""
        left = [i for i in pool if i not in tried]
        if not left:
            return None
        turn = next(self._turn)
        return min(left, key=lambda i: (not i.up, i.inflight + i.load, (pool.index(i) - turn) % len(pool)))

    def pick_replica(self, tried: set, key: str) -> tuple[Instance, Choice] | None:
        """The replica the policy chooses among those not tried yet (up ones; down ones when none is up)."""
        left = [i for i in self.replicas if i not in tried]
        live = {i.url: i for i in ([i for i in left if i.up] or left)}
        if not live:
            return None
        choice = self.balancer.choose(list(live), {u: i.inflight + i.load for u, i in live.items()}, key)
        return live[choice.target], choice

    def _mark_down(self, inst: Instance, e: Exception | None = None) -> None:
        inst.up = False
        if e is not None and _forgets(e) and inst.role == "replica":
            self.balancer.forget(inst.url)  # whatever comes back there starts with an empty cache

    async def poll(self) -> None:
        """Read every instance's /health and /metrics: whether it is up, and its load."""
        async def one(inst: Instance) -> None:
            try:
                r = await self.client.get(f"{inst.url}/health", headers=self.headers, timeout=5.0)
                if r.status_code != 200:  # draining, or its engine died: it takes nothing new
                    inst.up = False
                    return
                r = await self.client.get(f"{inst.url}/metrics", headers=self.headers, timeout=5.0)
                r.raise_for_status()
                load = usage = recv_s = recv_n = hits = queries = 0.0
                for fam in text_string_to_metric_families(r.text):
                    for s in fam.samples:
                        if s.name in LOAD_METRICS:
                            load += s.value
                        elif s.name == "vllm:kv_cache_usage_perc":
                            usage = s.value
                        elif s.name == "vllm:prefix_cache_hits_total":
                            hits += s.value
                        elif s.name == "vllm:prefix_cache_queries_total":
                            queries += s.value
                        elif s.name.startswith("tokenmill:kv_transfer_seconds_") and s.labels.get("direction") == "recv":
                            if s.name.endswith("_sum"):
                                recv_s += s.value
                            elif s.name.endswith("_count"):
                                recv_n += s.value
                inst.load, inst.kv_usage, inst.up = load, usage, True
                inst.kv_recv_seconds, inst.kv_recv_count = recv_s, recv_n
                inst.prefix_cache_hits, inst.prefix_cache_queries = hits, queries
            except httpx.HTTPError as e:
                self._mark_down(inst, e)
            except ValueError:
                inst.up = False

        await asyncio.gather(*(one(i) for i in self.instances))

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
        if self.replicas:
            stream = bool(body.get("stream"))
            leg = await self._leg("replica", path, body, routing_key(body), "first" if stream else "all")
            if isinstance(leg, Response):
                return leg
            return self._answer(leg, arrival, arrival)
        return await self._disaggregated(path, body, arrival)

    async def _disaggregated(self, path: str, body: dict, arrival: float) -> Response:
        prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        prefill.update(max_tokens=1, n=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        leg = await self._leg("prefill", path, prefill, "", "all")
        if isinstance(leg, Response):
            return leg
        if leg.resp.status_code != 200:
            return Response(leg.head, leg.resp.status_code, media_type="application/json")
        try:
            params = json.loads(leg.head)["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            return _error(502, f"the prefill instance {leg.inst.url} answered without kv_transfer_params: start it "
                          "with --kv-role producer", "bad_gateway")
        self.metrics.prefill_s.observe(time.perf_counter() - arrival)
        sent = time.perf_counter()
        leg = await self._leg("decode", path, {**body, "kv_transfer_params": params}, "",
                              "first" if body.get("stream") else "all")
        if isinstance(leg, Response):
            return leg
        return self._answer(leg, arrival, sent)

    def _answer(self, leg: Leg, arrival: float, sent: float) -> Response:
        media = leg.resp.headers.get("content-type", "application/json")
        now = time.perf_counter()
        if leg.inst.role == "decode":
            self.metrics.decode_first_s.observe(now - sent)
        if leg.done:  # (unstreamed: the whole answer)
            return Response(leg.head, leg.resp.status_code, media_type=media)
        self.metrics.ttft_s.observe(now - arrival)
        return _RelayResponse(self._relay(leg), leg, media_type=media)

    async def _leg(self, role: str, path: str, body: dict, key: str, prefetch: str) -> Leg | Response:
        """Send ``body`` to an instance of ``role`` (the policy's choice for replicas, else the least loaded),
        the next one if it fails before anything was read: the open Leg, or an error Response. ``prefetch``:
        read the first event (``first``, streams) or the whole body (``all``) before calling it a success, so
        a failure there is retried too."""
        tried: set[Instance] = set()
        errors: list[str] = []
        refusal: Response | None = None  # the last 5xx answer, passed on where no instance takes the request
        pool = {"prefill": self.prefill, "decode": self.decode}.get(role)
        while True:
            choice = None
            if pool is None:
                picked = self.pick_replica(tried, key)
                inst, choice = picked if picked else (None, None)
            else:
                inst = self.pick(pool, tried)
            if inst is None:
                return refusal or _error(503, f"no {role} instance answered ({'; '.join(errors)}); retry later",
                                         "service_unavailable")
            if tried:
                self.metrics.retries.labels(role).inc()
            if choice is not None:  # the tree learns at once: requests right behind this one follow it
                self.balancer.routed(key, inst.url)
            tried.add(inst)
            inst.inflight += 1
            resp = None
            try:
                req = self.client.build_request("POST", inst.url + path, json=body, headers=self.headers,
                                                timeout=self.timeout)
                resp = await self.client.send(req, stream=True)
                if resp.status_code == 200 and prefetch == "first":
                    chunks = resp.aiter_raw()
                    head = b""
                    async for chunk in chunks:
                        head += chunk
                        if b"\n\n" in head:
                            break
                    leg = Leg(inst, resp, chunks, head, False)
                else:
                    leg = Leg(inst, resp, None, await resp.aread(), False)
            except httpx.HTTPError as e:
                if resp is not None:
                    await resp.aclose()
                inst.inflight -= 1
                self._mark_down(inst, e)
                errors.append(f"{inst.url}: {type(e).__name__}")
                self.metrics.requests.labels(role, inst.url, "failed").inc()
                logger.warning("%s instance %s failed (%r): trying another", role, inst.url, e)
                continue
            if leg.chunks is None:  # read whole
                await leg.release()
            if resp.status_code >= 500:
                if resp.status_code != 503:  # 503: overloaded or draining, not broken
                    self._mark_down(inst)
                retry_after = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
                refusal = Response(leg.head, resp.status_code, headers=retry_after,
                                   media_type=resp.headers.get("content-type", "application/json"))
                errors.append(f"{inst.url}: HTTP {resp.status_code}")
                self.metrics.requests.labels(role, inst.url, "failed").inc()
                logger.warning("%s instance %s answered %d: trying another", role, inst.url, resp.status_code)
                continue
            inst.up = True
            ok = resp.status_code < 400
            self.metrics.requests.labels(role, inst.url, "ok" if ok else "client_error").inc()
            if choice is not None and ok:
                self.metrics.decisions.labels(choice.reason).inc()
                self.metrics.prompt_chars.labels(inst.url).inc(len(key))
                self.metrics.matched_chars.labels(inst.url).inc(choice.matched)
            return leg

    async def _relay(self, leg: Leg) -> AsyncIterator[bytes]:
        """The stream, whole events at a time: if the instance fails mid-way, a partial event is dropped and
        the client gets an error event and ``[DONE]`` instead."""
        inst, buf = leg.inst, leg.head
        try:
            async for chunk in leg.chunks:
                buf += chunk
                cut = buf.rfind(b"\n\n") + 2
                if cut > 1:
                    yield buf[:cut]
                    buf = buf[cut:]
            yield buf
        except httpx.HTTPError as e:
            self._mark_down(inst, e)
            self.metrics.stream_failures.labels(inst.role, inst.url).inc()
            logger.warning("%s instance %s failed mid-stream (%r)", inst.role, inst.url, e)
            err = {"error": {"message": f"the {inst.role} instance serving this stream failed ({type(e).__name__}); "
                             "a stream cannot be resumed elsewhere: send the request again", "type": "server_error",
                             "param": None, "code": "upstream_failed"}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await leg.release()

    async def forward(self, method: str, path: str, content: bytes | None = None) -> Response:
        """A request any instance answers alike (models, tokenize): to the first up one that answers."""
        pool = self.replicas or self.decode
        for inst in sorted(pool, key=lambda i: (not i.up, i.inflight + i.load)):
            try:
                r = await self.client.request(method, inst.url + path, content=content, timeout=30.0,
                                              headers={**self.headers, "Content-Type": "application/json"})
            except httpx.HTTPError as e:
                self._mark_down(inst, e)
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type", "application/json"))
        return _error(503, f"no {pool[0].role} instance answered", "service_unavailable")


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

    if router.replicas:
        for path in ("/tokenize", "/detokenize"):
            async def proxy(raw: Request, path: str = path) -> Response:
                return await router.forward("POST", path, await raw.body())

            app.add_api_route(path, proxy, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.forward("GET", "/v1/models")

    @app.get("/health")
    async def health() -> Response:
        if router.replicas:
            ok = any(i.up for i in router.replicas)
        else:
            ok = any(i.up for i in router.prefill) and any(i.up for i in router.decode)
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
