"""One streamed request to an OpenAI-compatible server, timed on the client.

Timing follows vLLM's serving benchmark: the clock starts just before the request is sent; TTFT is
the arrival of the first streamed chunk carrying output; each later such chunk adds one inter-token
latency (ITL: the gap since the previous one). Two deliberate differences, so servers that stream
differently are measured alike: a chunk counts as output only if its text (completions) or
``delta.content`` (chat) is non-empty, because llama-server sends a role-only first chunk and an
empty finish chunk that vLLM's client would count as tokens; and E2EL ends when ``data: [DONE]``
arrives (the complete response) rather than at the last chunk with choices, which differs by the
usage chunk alone. Token counts are the server's ``usage`` (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from tokenmill.bench.args import ENDPOINTS
from tokenmill.bench.datasets import SampleRequest


@dataclass
class ApiConfig:
    """Where and how to send requests: one server under test."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL {self.base_url!r} must start with http:// or https://, e.g. "
                             "http://127.0.0.1:8000")
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")
        self.label = self.label or self.base_url.split("://", 1)[1]

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: SampleRequest, max_tokens: int | None = None) -> dict:
        body: dict = {"model": self.model, "temperature": self.temperature, "stream": True,
                      "stream_options": {"include_usage": True}}
        n = req.output_len if max_tokens is None else max_tokens
        if self.endpoint == "completions":
            body.update(prompt=req.prompt, max_tokens=n)
        else:
            body.update(messages=req.messages(), max_completion_tokens=n)
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


@dataclass
class RequestResult:
    """Everything measured about one request; times in seconds, relative to the run's start."""

    index: int
    prompt_len: int  # what the dataset asked for (the benchmark's tokenizer)
    output_len: int  # max_tokens asked for
    scheduled_s: float = 0.0  # when the arrival process released it
    start_s: float = 0.0  # when it was sent (later than scheduled when --max-concurrency holds it back)
    end_s: float = 0.0  # when the response was complete (or failed)
    success: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def chunk_times_s(self) -> list[float]:
        """When each output chunk arrived, seconds after the run's start (none for a failed request)."""
        if not self.success:
            return []
        t = self.start_s + self.ttft_s
        out = [t]
        for gap in self.itl_s:
            t += gap
            out.append(t)
        return out


def _error_text(body: str) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return body.strip()[:500] or "(empty body)"


async def send_request(client: httpx.AsyncClient, api: ApiConfig, req: SampleRequest, index: int, t0: float,
                       scheduled_s: float = 0.0, max_tokens: int | None = None) -> RequestResult:
    """Send ``req`` streaming and time it; never raises for a server or network failure (see ``error``)."""
    res = RequestResult(index, req.prompt_len, req.output_len if max_tokens is None else max_tokens,
                        scheduled_s=scheduled_s)
    chat = api.endpoint == "chat"
    pieces: list[str] = []
    first = last = None
    done = False
    st = time.perf_counter()
    res.start_s = st - t0
    try:
        async with client.stream("POST", api.url, json=api.payload(req, max_tokens), headers=api.headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {_error_text((await r.aread()).decode('utf-8', 'replace'))}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if obj.get("error"):
                        res.error = f"error in the stream: {_error_text(data)}"
                        break
                    usage = obj.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens")
                        res.completion_tokens = usage.get("completion_tokens")
                    for choice in obj.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                        if text:
                            if first is None:
                                first = now
                                res.ttft_s = now - st
                            else:
                                res.itl_s.append(now - last)
                            last = now
                            pieces.append(text)
    except (httpx.HTTPError, OSError, ValueError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    end = time.perf_counter()
    res.end_s = end - t0
    res.generated_text = "".join(pieces)
    if res.error is None and first is None:
        res.error = "the stream carried no output text (check --max-tokens/--output-len and the endpoint)"
    elif res.error is None and not done:
        res.error = "the stream ended before 'data: [DONE]' (the server closed the connection early)"
    res.success = res.error is None
    if res.success:
        res.e2el_s = end - st
    return res


def make_client(max_concurrency: int | None, timeout: float) -> httpx.AsyncClient:
    """One connection per in-flight request: the pool must never queue requests of its own."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)), limits=limits)


def list_models(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    """The model ids GET /v1/models reports ([] when it cannot be read)."""
    api = ApiConfig(base_url, "", api_key=api_key)
    try:
        r = httpx.get(api.base_url + "/v1/models", headers=api.headers, timeout=timeout)
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        return []


async def wait_until_ready(api: ApiConfig, sample: SampleRequest, timeout: float, warmups: int = 1) -> None:
    """Send ``sample`` (16 tokens at most) until one succeeds, then ``warmups - 1`` more. Connection
    errors are retried until ``timeout``; any other failure raises a ValueError saying what to check."""
    deadline = time.monotonic() + timeout
    async with make_client(None, max(timeout, 60.0)) as client:
        done = 0
        while done < max(1, warmups):
            res = await send_request(client, api, sample, -1, time.perf_counter(), max_tokens=min(16, sample.output_len))
            if res.success:
                done += 1
                continue
            if res.status is None and time.monotonic() < deadline:  # not up yet
                await asyncio.sleep(1.0)
                continue
            hint = "is the server running and the URL right (--base-url / --compare)?"
            if res.status is not None:
                models = list_models(api.base_url, api.api_key)
                hint = (f"check --model / --compare-model (the server lists {', '.join(models) or 'no models'}), "
                        "--api-key and --endpoint")
            raise ValueError(f"the test request to {api.url} failed: {res.error}; {hint}")
