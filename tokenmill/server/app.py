"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, GET /version. Every error is an OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad input, 401 without
the API key, 503 when overloaded or draining, 500 when the engine loop died.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from pydantic import BaseModel
from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import (
    AsyncEngine, EngineDeadError, EngineDrainingError, QueueFullError, RequestStream,
)
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.structured import structured_outputs
from tokenmill.server.tools import (
    PARSERS, TOOL_CALL_PARSERS, StreamingToolParser, ToolCall, messages_with_tools, parse_required,
    template_knows_tools, tool_choice_constraint,
)
from tokenmill.server.protocol import (
    ChatCompletionRequest, CompletionRequest, OpenAIError, bad_request, error_body,
)

logger = logging.getLogger("tokenmill.server")

GREEDY_EPS = 1e-5  # temperatures below this are greedy (as vLLM), avoiding logits / ~0 overflow


@dataclass
class ServerConfig:
    """What the HTTP layer enforces; see ``tokenmill serve --help`` for each flag."""

    served_model_names: Sequence[str] = ()  # default: the engine's model name
    api_key: str | None = None
    max_n: int = 8
    max_logprobs: int = MAX_LOGPROBS
    max_stop: int = MAX_STOP_STRINGS
    max_prompts: int = 32  # prompts in one batched /v1/completions request
    max_request_bytes: int = 1 << 20
    drain_timeout: float = 30.0
    tool_call_parser: str = "hermes"  # how tool_choice auto reads calls in the output (server/tools.py)
    # the engine died: exit (status 1) this long after, once the failed requests got their errors
    exit_on_engine_death: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_n:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if not 0 <= self.max_stop <= MAX_STOP_STRINGS:
            raise ValueError(f"max_stop must be in [0, {MAX_STOP_STRINGS}], got {self.max_stop}")
        if self.max_prompts < 1 or self.max_request_bytes < 1:
            raise ValueError("max_prompts and max_request_bytes must be positive")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")


# ---- JSON and SSE ----------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _error_response(e: OpenAIError) -> Response:
    return json_response(e.body(), e.status, e.headers)


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


class _DeltaTracker:
    """What each streamed choice has already sent, so each event carries only the new part."""

    def __init__(self) -> None:
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()
        self.completion_tokens = 0

    def delta(self, idx: int, c) -> tuple[str, list[int], int, int] | None:
        """(new text, new token ids, text offset, token offset), or None when there is nothing to send."""
        if idx in self.done:
            return None
        start, tstart = self.sent_text.get(idx, 0), self.sent_tokens.get(idx, 0)
        delta, new_ids = c.text[start:], c.token_ids[tstart:]
        if not delta and not c.finished and not (c.logprobs is not None and new_ids):
            return None
        self.sent_text[idx], self.sent_tokens[idx] = len(c.text), len(c.token_ids)
        if c.finished:
            self.done.add(idx)
            self.completion_tokens += len(c.token_ids)
        return delta, new_ids, start, tstart


def _chunk_builder(request_id: str, obj: str, created: int, model: str, include_usage: bool):
    """One SSE event per call; with include_usage every chunk carries "usage": null, as OpenAI's do."""
    def chunk(choices: list[dict]) -> str:
        body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = None
        return _sse(body)
    return chunk


class SSEResponse(StreamingResponse):
    """Server-sent events that also watch for the client going away.

    Streams ``events`` while listening for ``http.disconnect``; whichever ends first, the other
    is cancelled and ``on_close`` runs (it aborts the requests), also when the server cancels us.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        async def listen() -> None:
            while True:
                if (await receive())["type"] == "http.disconnect":
                    return

        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        listener, streamer = asyncio.ensure_future(listen()), asyncio.ensure_future(stream())
        try:
            await asyncio.wait({listener, streamer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (listener, streamer):
                t.cancel()
            await asyncio.gather(listener, streamer, return_exceptions=True)
            try:
                await self.body_iterator.aclose()
            except Exception:  # noqa: BLE001
                pass
            self._on_close()
        if streamer.done() and not streamer.cancelled() and streamer.exception() is not None:
            exc = streamer.exception()
            if not isinstance(exc, OSError):  # OSError: the client went away while we wrote
                logger.error("stream failed: %r", exc, exc_info=exc)


# ---- middlewares (pure ASGI: they run before the body is read) ---------------------------------


async def _send_error(send, status: int, message: str, code: str | None, headers=()) -> None:  # noqa: ANN001
    body = _dumps(OpenAIError(status, message, None, code).body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """Every /v1 route needs ``Authorization: Bearer <api_key>``, compared in constant time."""

    def __init__(self, app, api_key: str) -> None:  # noqa: ANN001
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = b""
            for k, v in scope["headers"]:
                if k == b"authorization":
                    given = v
                    break
            scheme, _, token = given.partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
            if not ok:
                await _send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Requests with bodies over ``limit`` bytes get 413, by Content-Length or while streaming in."""

    def __init__(self, app, limit: int) -> None:  # noqa: ANN001
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    size = int(v)
                except ValueError:
                    size = -1
                if size > self.limit or size < 0:
                    return await _send_error(send, 413, f"request body is larger than the limit of {self.limit} "
                                             "bytes (--max-request-bytes)", "request_too_large")
        received = 0

        async def limited_receive():  # noqa: ANN202
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, f"request body is larger than the limit of {self.limit} bytes "
                                             "(--max-request-bytes)")
            return message

        await self.app(scope, limited_receive, send)


# ---- token text for logprobs ---------------------------------------------------------------------


class _TokenText:
    """Token id -> (text, utf-8 bytes), cached."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        try:
            from tokenmill.tokenizer import _BYTE_CHARS  # byte-level BPE alphabet, to recover exact bytes

            self._unbyte = {c: b for b, c in _BYTE_CHARS.items()}
        except ImportError:  # pragma: no cover
            self._unbyte = {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tid)
        if hit is None:
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
            raw = None
            if "\ufffd" in text:  # a piece of a multi-byte character: give its real bytes
                try:
                    piece = self.tokenizer.hf.id_to_token(tid)
                    if piece and all(ch in self._unbyte for ch in piece):
                        raw = [self._unbyte[ch] for ch in piece]
                except Exception:  # noqa: BLE001
                    raw = None
            hit = (text, raw if raw is not None else list(text.encode("utf-8")))
            if len(self._cache) < 200_000:
                self._cache[tid] = hit
        return hit


def _lp(x: float | None) -> float:
    return -9999.0 if x is None or not math.isfinite(x) else float(x)


# ---- the OpenAI serving logic --------------------------------------------------------------------


@dataclass
class _Prepared:
    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams
    max_tokens_param: str
    prompt_param: str
    streams: list[RequestStream] = field(default_factory=list)
    structured_param: str | None = None  # the field a structured-output constraint came from
    tool_choice: object = None  # chat: "auto" (parse calls), "required", a function name, or None
    tool_parser: str = "hermes"


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        llm = engine.engine
        self.model_names = list(config.served_model_names) or [llm.model_name]
        self.model_name = self.model_names[0]
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.model_config.vocab_size
        self.created = int(time.time())
        self.draining = False
        self.token_text = _TokenText(self.tokenizer)

    # ---- checks shared by both endpoints --------------------------------------------------

    def check_serving(self) -> None:
        if self.engine.error is not None:
            raise OpenAIError(500, f"the engine loop died ({self.engine.error!r}); the server cannot generate "
                              "any more and must be restarted", None, "engine_dead")
        if self.draining or not self.engine.accepting or not self.engine.is_running:
            raise OpenAIError(503, "the server is shutting down and admits no new requests", None, "draining")

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.model_names:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                              f"{', '.join(repr(m) for m in self.model_names)}", "model", "model_not_found")
        return model

    def sampling_params(self, req, *, max_tokens: int | None, max_tokens_param: str, logprobs: int | None,
                        logprobs_param: str, structured=None, prompt_logprobs: int | None = None,
                        ) -> SamplingParams:  # noqa: ANN001
        cfg = self.config
        n = 1 if req.n is None else req.n
        if n > cfg.max_n:
            raise bad_request(f"n={n} is above this server's limit of {cfg.max_n} (--max-n)", "n")
        if req.best_of is not None and req.best_of != n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if logprobs is not None and logprobs > cfg.max_logprobs:
            raise bad_request(f"{logprobs_param}={logprobs} is above this server's limit of {cfg.max_logprobs}",
                              logprobs_param)
        prompt_logprobs = req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs > cfg.max_logprobs:
            raise bad_request(f"prompt_logprobs={prompt_logprobs} is above this server's limit of "
                              f"{cfg.max_logprobs}", "prompt_logprobs")
        logit_bias = None
        if req.logit_bias is not None:
            try:
                logit_bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
            bad_ids = [t for t in logit_bias if not 0 <= t < self.vocab_size]
            if bad_ids:
                raise bad_request(f"logit_bias token id {bad_ids[0]} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", "logit_bias")
        bad_ids = [t for t in req.allowed_token_ids or () if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise bad_request(f"allowed_token_ids: token id {bad_ids[0]} is outside the vocabulary "
                              f"[0, {self.vocab_size})", "allowed_token_ids")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > cfg.max_stop:
            raise bad_request(f"{len(stop)} stop strings given; at most {cfg.max_stop} are allowed", "stop")
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        stop_ids = list(req.stop_token_ids or [])
        bad_ids = [t for t in stop_ids if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise bad_request(f"stop token id {bad_ids[0]} is outside the vocabulary [0, {self.vocab_size})",
                              "stop_token_ids")
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature < GREEDY_EPS:
            temperature = 0.0
        top_k = 0 if req.top_k is None else req.top_k
        if top_k >= self.vocab_size:
            top_k = 0  # keeps every token: the same as off
        kwargs = dict(
            n=n, temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
            min_p=req.min_p or 0.0, repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens or 0, stop=stop,
            stop_token_ids=stop_ids, ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logprobs=logprobs, skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
            prompt_logprobs=prompt_logprobs, logit_bias=logit_bias, allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words or (), structured_outputs=structured,
        )
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            m = re.match(r"invalid sampling parameter (\w+)[=:]", str(e))
            name = m.group(1) if m else None
            param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(name, name)
            raise bad_request(str(e), param) from None

    def check_context(self, ids: list[int], max_tokens: int | None, prompt_param: str, max_tokens_param: str) -> None:
        n, ctx = len(ids), self.max_model_len
        if n >= ctx:
            raise bad_request(f"the prompt has {n} tokens but this model's context is {ctx} tokens, with at least "
                              "one left for the completion; shorten the prompt", prompt_param,
                              "context_length_exceeded")
        if max_tokens is not None and n + max_tokens > ctx:
            raise bad_request(f"this model's maximum context length is {ctx} tokens, but {n + max_tokens} were "
                              f"requested ({n} in the prompt, {max_tokens} for the completion); lower "
                              f"{max_tokens_param} to at most {ctx - n}", max_tokens_param, "context_length_exceeded")

    async def start(self, prep: _Prepared, request_id: str, priority: int, arrival: float) -> None:
        """Queue every prompt (all in the same engine pause); on any failure abort what was queued and
        raise an OpenAIError."""
        one = len(prep.prompt_ids) == 1
        adds = [asyncio.ensure_future(self.engine.add_request(
            ids, prep.params, request_id if one else f"{request_id}-{i}", priority, add_special_tokens=False,
            arrival_time=arrival)) for i, ids in enumerate(prep.prompt_ids)]
        try:
            results = await asyncio.gather(*adds, return_exceptions=True)
        except BaseException:  # cancelled (client gone): the adds abort themselves when cancelled
            for t in adds:
                t.cancel()
                if t.done() and not t.cancelled() and t.exception() is None:
                    t.result().abort()
            raise
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if errors:
            for st in streams:
                st.abort()
            raise self._engine_error(errors[0], prep) from errors[0]
        prep.streams.extend(streams)

    def _engine_error(self, e: BaseException, prep: _Prepared) -> BaseException:
        if isinstance(e, QueueFullError):
            return OpenAIError(503, str(e), None, "overloaded", headers={"Retry-After": "1"})
        if isinstance(e, EngineDrainingError):
            return OpenAIError(503, str(e), None, "draining")
        if isinstance(e, EngineDeadError):
            return OpenAIError(500, str(e), None, "engine_dead")
        if isinstance(e, ValueError):
            msg = str(e)
            param = prep.max_tokens_param if re.search(r"max_tokens|KV|max_num_batched", msg) else prep.prompt_param
            if "structured output" in msg:
                param = prep.structured_param
            elif msg.startswith("invalid sampling parameter"):
                param = msg.split()[3].rstrip(":=").split("=")[0]
            return bad_request(msg, param)
        return e

    # ---- /v1/completions ----------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_serving()
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        prompts = _split_prompts(req.prompt)
        if len(prompts) > self.config.max_prompts:
            raise bad_request(f"{len(prompts)} prompts given; at most {self.config.max_prompts} per request",
                              "prompt")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        structured, structured_param = structured_outputs(req)
        # echo with logprobs: the prompt's own logprobs come first (computed in the prefill)
        echo_lps = bool(req.echo) and req.logprobs is not None
        params = self.sampling_params(req, max_tokens=max_tokens, max_tokens_param="max_tokens",
                                      logprobs=req.logprobs, logprobs_param="logprobs", structured=structured,
                                      prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0) if echo_lps
                                      else None)
        ids_list, texts = [], []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt must not be empty", "prompt")
                ids = await asyncio.to_thread(self.tokenizer.encode, p, True)
                if not ids:
                    raise bad_request("prompt has no tokens", "prompt")
                texts.append(p)
            else:
                if not p:
                    raise bad_request("prompt token list must not be empty", "prompt")
                bad = [t for t in p if not 0 <= t < self.vocab_size]
                if bad:
                    raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                      "prompt")
                ids = list(p)
                texts.append(self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
            self.check_context(ids, max_tokens, "prompt", "max_tokens")
            ids_list.append(ids)
        prep = _Prepared(ids_list, texts, params, "max_tokens", "prompt", structured_param=structured_param)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        await self.start(prep, request_id, req.priority or 0, arrival)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._completion_events(prep, request_id, created, model, bool(req.echo),
                                                       include_usage), lambda: _abort_all(prep.streams))
        finals = await _collect(prep.streams, raw)
        return json_response(self._completion_body(prep, finals, request_id, created, model, bool(req.echo)))

    def _completion_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps):
            text, _ = self.token_text(tid)
            tokens.append(text)
            token_lps.append(_lp(d.get(tid)))
            tops.append({self.token_text(t)[0]: _lp(v) for t, v in sorted(d.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _echo_logprobs(self, prompt_ids: list[int], prompt_lps: list, completion: dict) -> dict:
        """OpenAI's echo with logprobs: the prompt tokens first (the first with no logprob), then the
        completion's."""
        first = self.token_text(prompt_ids[0])[0]
        rest = self._completion_logprobs(prompt_ids[1:], prompt_lps[1:], len(first))
        prompt = {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                  "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}
        return {k: prompt[k] + completion[k] for k in prompt}

    def _vllm_prompt_logprobs(self, prompt_lps: list) -> list:
        """vLLM's prompt_logprobs field: None, then {token id: {logprob, rank, decoded_token}} per token."""
        out = []
        for d in prompt_lps:
            if d is None:
                out.append(None)
                continue
            ranked = sorted(d.items(), key=lambda kv: -kv[1])
            out.append({str(t): {"logprob": _lp(v), "rank": r + 1, "decoded_token": self.token_text(t)[0]}
                        for r, (t, v) in enumerate(ranked)})
        return out

    def _completion_body(self, prep: _Prepared, finals: list[RequestOutput], request_id: str, created: int,
                         model: str, echo: bool) -> dict:
        choices, completion_tokens = [], 0
        n = prep.params.n
        for pi, out in enumerate(finals):
            prefix = prep.prompt_texts[pi] if echo else ""
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if c.logprobs is not None:
                    lp = self._completion_logprobs(c.token_ids, c.logprobs, len(prefix))
                    if echo and out.prompt_logprobs is not None:
                        lp = self._echo_logprobs(prep.prompt_ids[pi], out.prompt_logprobs, lp)
                choice = {"index": pi * n + c.index, "text": prefix + c.text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if prep.params.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
        prompt_tokens = sum(len(ids) for ids in prep.prompt_ids)
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    async def _completion_events(self, prep: _Prepared, request_id: str, created: int, model: str, echo: bool,
                                 include_usage: bool) -> AsyncIterator[str]:
        n = prep.params.n
        track = _DeltaTracker()
        chunk = _chunk_builder(request_id, "text_completion", created, model, include_usage)

        merged = _merge(prep.streams)
        echo_lps = echo and prep.params.logprobs is not None
        echoed: set[int] = set()
        try:
            if echo and not echo_lps:
                for pi, text in enumerate(prep.prompt_texts):
                    yield chunk([{"index": pi * n + i, "text": text, "logprobs": None, "finish_reason": None}
                                 for i in range(n)])
            async for pi, out in merged:
                if echo_lps and pi not in echoed and out.prompt_logprobs is not None:
                    # the prompt's logprobs come with its first output: echo it then
                    echoed.add(pi)
                    empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                    lp = self._echo_logprobs(prep.prompt_ids[pi], out.prompt_logprobs, empty)
                    yield chunk([{"index": pi * n + i, "text": prep.prompt_texts[pi], "logprobs": lp,
                                  "finish_reason": None} for i in range(n)])
                for c in out.outputs:
                    idx = pi * n + c.index
                    d = track.delta(idx, c)
                    if d is None:
                        continue
                    delta, new_ids, start, tstart = d
                    lp = None
                    if c.logprobs is not None:
                        lp = self._completion_logprobs(new_ids, c.logprobs[tstart:], start)
                    choice = {"index": idx, "text": delta, "logprobs": lp, "finish_reason": None}
                    if c.finished:
                        choice["finish_reason"] = c.finish_reason
                        choice["stop_reason"] = c.stop_reason
                    yield chunk([choice])
            if include_usage:
                prompt_tokens = sum(len(ids) for ids in prep.prompt_ids)
                yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(prompt_tokens, track.completion_tokens)})
        except EngineDeadError as e:
            yield _sse(OpenAIError(500, str(e), None, "engine_dead").body())
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
            logger.error("stream %s failed: %r", request_id, e, exc_info=e)
            yield _sse(OpenAIError(500, f"internal server error: {type(e).__name__}", None, "internal_error").body())
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions ------------------------------------------------------------------

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_serving()
        model = self.check_model(req.model)
        if req.messages is None:
            raise bad_request("messages is required", "messages")
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        structured, structured_param = structured_outputs(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice
        if isinstance(choice, BaseModel):
            choice = choice.model_dump()
        if choice is not None and not tools and choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        choice = choice or ("auto" if tools else None)
        if choice == "none":
            tools = None
        forced_name = None
        if tools and choice != "auto":
            if structured is not None:
                raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'with a function'} "
                                  f"cannot be combined with {structured_param}", "tool_choice")
            try:
                structured, forced_name = tool_choice_constraint(tools, choice)
            except ValueError as e:
                raise bad_request(str(e), "tool_choice") from None
            structured_param = "tools"
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, max_tokens_param=max_tokens_param,
                                      logprobs=logprobs, logprobs_param="top_logprobs", structured=structured)
        messages = []
        for i, m in enumerate(req.messages):
            if not m.role:
                raise bad_request(f"messages[{i}].role must not be empty", f"messages[{i}].role")
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"messages[{i}].content[{j}]: only text content parts are supported",
                                          f"messages[{i}].content")
                    texts.append(part.text)
                content = "\n".join(texts)
            # null content (allowed by OpenAI, e.g. an assistant turn) renders as empty text
            msg = {**(m.model_extra or {}), "role": m.role, "content": "" if content is None else content}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt
        native_tools = template_knows_tools(self.tokenizer.chat_template)
        if not native_tools and (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)):
            messages = messages_with_tools(messages, tools)

        def render() -> list[int]:
            kw = {"tools": tools} if native_tools and tools else {}
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen, **kw)
            return self.tokenizer.encode(text, add_special_tokens=False)  # the template holds any BOS

        try:
            ids = await asyncio.to_thread(render)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 - a template can fail in any way on odd input (TypeError, ...)
            raise bad_request(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                              "messages") from None
        if not ids:
            raise bad_request("the chat template rendered an empty prompt", "messages")
        self.check_context(ids, max_tokens, "messages", max_tokens_param)
        prep = _Prepared([ids], [""], params, max_tokens_param, "messages", structured_param=structured_param,
                         tool_choice=forced_name or (choice if tools else None), tool_parser=self.config.tool_call_parser)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        await self.start(prep, request_id, req.priority or 0, arrival)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._chat_events(prep, request_id, created, model, include_usage),
                               lambda: _abort_all(prep.streams))
        finals = await _collect(prep.streams, raw)
        out = finals[0]
        choices = []
        for c in out.outputs:
            lp = {"content": self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs)} \
                if c.logprobs is not None else None
            content, calls = self._tool_calls(prep, c.text)
            message = {"role": "assistant", "content": content}
            finish = c.finish_reason
            if calls:
                message["tool_calls"] = [t.to_openai() for t in calls]
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c.index, "message": message,
                            "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return json_response({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                              "choices": choices, "usage": _usage(len(ids), completion_tokens)})

    def _tool_calls(self, prep: _Prepared, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output, by the request's tool_choice."""
        choice = prep.tool_choice
        if choice is None:
            return text, []
        if choice == "auto":
            return PARSERS[prep.tool_parser](text)
        if choice == "required":
            calls = parse_required(text)
            return (None, calls) if calls else (text, [])
        return None, [ToolCall(choice, text)]  # a named function: the output is its arguments

    def _chat_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], top_n: int | None) -> list[dict]:
        content = []
        for tid, d in zip(token_ids, lps):
            text, raw = self.token_text(tid)
            top = []
            for t, v in sorted(d.items(), key=lambda kv: -kv[1])[: top_n or 0]:
                ttext, traw = self.token_text(t)
                top.append({"token": ttext, "logprob": _lp(v), "bytes": traw})
            content.append({"token": text, "logprob": _lp(d.get(tid)), "bytes": raw, "top_logprobs": top})
        return content

    async def _chat_events(self, prep: _Prepared, request_id: str, created: int, model: str,
                           include_usage: bool) -> AsyncIterator[str]:
        params = prep.params
        track = _DeltaTracker()
        chunk = _chunk_builder(request_id, "chat.completion.chunk", created, model, include_usage)

        merged = _merge(prep.streams)
        tool_streams: dict[int, _ToolStream] = {}
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)])
            async for _, out in merged:
                for c in out.outputs:
                    d = track.delta(c.index, c)
                    if d is None:
                        continue
                    delta, new_ids, start, tstart = d
                    lp = None
                    if c.logprobs is not None:
                        lp = {"content": self._chat_logprobs(new_ids, c.logprobs[tstart:], params.logprobs)}
                    message = {"content": delta} if delta else {}
                    called = False
                    if prep.tool_choice is not None:
                        message, called = tool_streams.setdefault(c.index, _ToolStream(prep)).delta(delta, c.finished)
                    choice = {"index": c.index, "delta": message, "logprobs": lp, "finish_reason": None}
                    if c.finished:
                        choice["finish_reason"] = "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
                        choice["stop_reason"] = c.stop_reason
                    yield chunk([choice])
            if include_usage:
                yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(len(prep.prompt_ids[0]), track.completion_tokens)})
        except EngineDeadError as e:
            yield _sse(OpenAIError(500, str(e), None, "engine_dead").body())
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
            logger.error("stream %s failed: %r", request_id, e, exc_info=e)
            yield _sse(OpenAIError(500, f"internal server error: {type(e).__name__}", None, "internal_error").body())
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"


class _ToolStream:
    """One streamed choice's tool calls as OpenAI deltas, by the request's tool_choice: auto parses as
    the text comes (server/tools.py), a named function streams its arguments, required sends its
    calls when the array is complete."""

    def __init__(self, prep: _Prepared) -> None:
        self.choice = prep.tool_choice
        self.parser = StreamingToolParser(prep.tool_parser) if self.choice == "auto" else None
        self.text = ""
        self.count = 0  # tool calls sent
        self.named = None if self.choice in ("auto", "required") else ToolCall(self.choice, "")

    def delta(self, text: str, final: bool) -> tuple[dict, bool]:
        """(the delta message, whether this choice has called a tool so far)."""
        if self.parser is not None:
            content, calls = self.parser.feed(text, final)
            msg = {"content": content} if content else {}
            if calls:
                msg["tool_calls"] = [t.to_openai(self.count + i) for i, t in enumerate(calls)]
                self.count += len(calls)
            return msg, self.count > 0
        if self.named is not None:
            if self.count == 0:
                self.count = 1
                return {"tool_calls": [self.named.to_openai(0) | {"function": {"name": self.named.name,
                                                                             "arguments": text}}]}, True
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), True
        self.text += text
        if not final:
            return {}, False
        calls = parse_required(self.text)
        if not calls:
            return {"content": self.text}, False
        self.count = len(calls)
        return {"tool_calls": [t.to_openai(i) for i, t in enumerate(calls)]}, True


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _split_prompts(prompt) -> list[str | list[int]]:  # noqa: ANN001
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)  # list[str] or list[list[int]]


def _abort_all(streams: Sequence[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they come, newest output per stream (they are cumulative)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    latest: dict[int, RequestOutput] = {}
    finished: set[int] = set()
    errors: list[BaseException] = []
    wake = asyncio.Event()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                latest[i] = out
                wake.set()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            finished.add(i)
            wake.set()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            await wake.wait()
            wake.clear()
            if errors:
                raise errors[0]
            items = sorted(latest.items())
            latest.clear()
            for item in items:
                yield item
            if len(finished) == len(streams) and not latest:
                if errors:
                    raise errors[0]
                return
    finally:
        for t in tasks:
            t.cancel()


class _ClientGone(Exception):
    pass


async def _collect(streams: Sequence[RequestStream], raw: Request) -> list[RequestOutput]:
    """The finished output of every stream; aborts them all if the client disconnects first."""

    async def consume() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        merged = _merge(streams)
        try:
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
        finally:
            await merged.aclose()
        if len(finals) < len(streams):
            raise OpenAIError(503, "the request was aborted before it finished", None, "aborted")
        return [finals[i] for i in range(len(streams))]

    async def disconnected() -> None:
        while True:
            if (await raw.receive())["type"] == "http.disconnect":
                return

    work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and watch.done() and not watch.cancelled() and watch.exception() is not None:
            # the disconnect watch itself failed: just wait for the result
            await asyncio.wait({work})
        if work.done():
            try:
                return work.result()
            except EngineDeadError as e:
                raise OpenAIError(500, str(e), None, "engine_dead") from None
        raise _ClientGone()
    finally:
        for t in (work, watch):
            t.cancel()
        _abort_all(streams)  # no-op for finished ones


# ---- errors -> OpenAI error objects ----------------------------------------------------------------


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = first.get("type")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        pos = loc[0] if loc else "?"
        return bad_request(f"malformed JSON body (at character {pos}): {ctx.get('error', 'decode error')}", None,
                           "invalid_json")
    if not loc:
        return bad_request("a JSON request body is required" if kind == "missing" else
                           "the request body must be a JSON object", None)
    param = str(loc[0])
    if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        param = f"messages[{loc[1]}]"
        if len(loc) > 2 and loc[2] in ("role", "content", "name"):
            param += f".{loc[2]}"
    same = [e for e in errors if list(e.get("loc", ()))[1:2] == [loc[0]]]
    msgs = list(dict.fromkeys(e.get("msg", "") for e in same))[:4]
    return bad_request(f"invalid {param!r}: {'; '.join(msgs)}", param)


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app. Its lifespan starts ``engine`` (if needed) and shuts it down at exit."""
    config = config or ServerConfig()
    serving = OpenAIServing(engine, config)
    metrics = ServerMetrics(serving.model_name, lambda: engine.snapshot, serving.max_model_len)
    engine.observers.append(metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        engine.start()
        logger.info("serving %s (context %d tokens)", serving.model_name, serving.max_model_len)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown, 30.0)
            if metrics in engine.observers:
                engine.observers.remove(metrics)

    app = FastAPI(title="tokenmill", version=_version(), lifespan=lifespan)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.engine = engine

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
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

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": serving.created, "owned_by": "tokenmill",
             "root": engine.engine.model_name, "max_model_len": serving.max_model_len}
            for name in serving.model_names]})

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

    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key)  # outermost: auth before anything else
    return app


def _version() -> str:
    from tokenmill import __version__

    return __version__


# ---- running it ------------------------------------------------------------------------------------


ENGINE_DEATH_GRACE_S = 1.0  # --exit-on-engine-death: how long the error responses get to leave


class Server(uvicorn.Server):
    """uvicorn.Server that drains on SIGTERM/SIGINT.

    At the first signal admission stops (new requests and /health answer 503) and in-flight
    requests get ``drain_timeout`` seconds to finish; whatever is left is then aborted (its
    streams end with finish_reason "abort" and ``data: [DONE]``), and uvicorn shuts down. A
    second signal skips the wait.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._drainer: threading.Thread | None = None
        self._engine_dead_since: float | None = None

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's 0.1 s tick: also exit a while after the engine died, where the config asks for it
        (the in-flight requests have had their errors by then; a supervisor restarts the server)."""
        serving: OpenAIServing | None = getattr(self._app.state, "serving", None)  # None: another app
        if serving is not None and serving.config.exit_on_engine_death and serving.engine.error is not None:
            now = time.monotonic()
            if self._engine_dead_since is None:
                self._engine_dead_since = now
                logger.error("the engine died (%r): exiting in %.1f s", serving.engine.error, ENGINE_DEATH_GRACE_S)
            elif now - self._engine_dead_since >= ENGINE_DEATH_GRACE_S:
                return True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001
        serving: OpenAIServing = self._app.state.serving
        serving.draining = True
        serving.engine.stop_accepting()
        if self._drainer is None and not self.should_exit:
            logger.info("got signal %s: draining, up to %.1f s for %d in-flight requests", sig,
                        serving.config.drain_timeout, serving.engine.num_unfinished)
            self._drainer = threading.Thread(target=self._drain, args=(sig, frame), name="tokenmill-drain",
                                             daemon=True)
            self._drainer.start()
        else:
            super().handle_exit(sig, frame)

    def _drain(self, sig: int, frame) -> None:  # noqa: ANN001
        serving: OpenAIServing = self._app.state.serving
        engine = serving.engine
        deadline = time.monotonic() + serving.config.drain_timeout
        while engine.is_running and engine.num_unfinished and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if engine.is_running and engine.num_unfinished:
            logger.warning("drain timeout: aborting %d in-flight requests", engine.num_unfinished)
            engine.abort_all()
            end = time.monotonic() + 2.0  # let the streams send their last chunk
            while engine.is_running and engine.num_unfinished and time.monotonic() < end:
                time.sleep(0.05)
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                access_log: bool = True) -> Server:
    # Our drain already finished or aborted everything; uvicorn's own grace is a short backstop.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=5)
    return Server(config, app)


class BackgroundServer:
    """The server on a thread of this process (tests, notebooks). ``port=0`` picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.app = app
        self.server = make_server(app, host, port, log_level=log_level, access_log=False)
        self.thread = threading.Thread(target=self.server.run, name="tokenmill-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def signal_exit(self) -> None:
        """What SIGTERM does to a server on the main thread: start draining and exit."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def serve(engine: AsyncEngine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, *,
          log_level: str = "info", access_log: bool = True) -> int:
    """Run the server in the foreground until SIGTERM/SIGINT, then drain and return 0."""
    app = build_app(engine, config)
    server = make_server(app, host, port, log_level=log_level, access_log=access_log)
    # uvicorn re-raises the signal it caught once it has shut down; make that a clean exit.
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _exit_cleanly) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        server.run()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if engine.error is None else 1


def _exit_cleanly(signum: int, frame) -> None:  # noqa: ANN001
    raise SystemExit(0)


def configure_logging(a) -> None:  # noqa: ANN001
    if a.log_level.upper() == "WARNING":  # the CLI default: a server should say what it does
        logging.getLogger("tokenmill").setLevel(logging.INFO)
    if a.disable_log_requests:
        logging.getLogger("tokenmill.requests").setLevel(logging.WARNING)
    if a.disable_log_stats:
        logging.getLogger("tokenmill.stats").setLevel(logging.WARNING)


def config_from_args(a) -> ServerConfig:  # noqa: ANN001
    """ServerConfig from ``tokenmill serve`` flags; the API key falls back to $TOKENMILL_API_KEY."""
    api_key = a.api_key or os.environ.get("TOKENMILL_API_KEY") or None
    return ServerConfig(served_model_names=a.served_model_name or (), api_key=api_key, max_n=a.max_n,
                        max_logprobs=a.max_logprobs, max_prompts=a.max_prompts,
                        max_request_bytes=a.max_request_bytes, drain_timeout=a.drain_timeout,
                        tool_call_parser=a.tool_call_parser, exit_on_engine_death=a.exit_on_engine_death)


def serve_args(llm_engine, a) -> int:  # noqa: ANN001
    """Serve an already built LLMEngine (or one with its interface) with ``tokenmill serve`` flags."""
    configure_logging(a)
    config = config_from_args(a)
    engine = AsyncEngine(llm_engine, max_waiting_requests=a.max_waiting_requests,
                         log_interval=0 if a.disable_log_stats else a.log_stats_interval,
                         log_requests=not a.disable_log_requests)
    if a.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", a.host)
    return serve(engine, config, a.host, a.port, log_level=a.uvicorn_log_level,
                 access_log=not a.disable_access_log)


def run_from_args(a) -> int:  # noqa: ANN001
    """``tokenmill serve``: load the model (in the engine core's own process unless
    --no-engine-core-process), then serve it."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.engine.llm_engine import LLMEngine

    configure_logging(a)
    kwargs = engine_kwargs(a)
    if getattr(a, "model_arg", None):
        kwargs["model"] = a.model_arg
    config_from_args(a)  # flag errors before the slow model load
    llm_engine = LLMEngine(EngineConfig.from_kwargs(**kwargs), core_process=a.engine_core_process)
    try:
        return serve_args(llm_engine, a)
    finally:
        llm_engine.shutdown()
