"""Streaming a request's outputs: each event's delta, one event per chunk, the error event after the headers
went out, and the helpers that merge several requests' streams or collect them while watching for a client
that left. (The SSE response itself is in responses.py.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import Request

from tokenmill.engine.streams import EngineDeadError, RequestStream
from tokenmill.outputs import RequestOutput
from tokenmill.server.protocol import OpenAIError
from tokenmill.server.responses import _sse

logger = logging.getLogger("tokenmill.server")


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


def error_event(e: Exception, request_id: str) -> str:
    """The SSE event of an error after the headers went out (an OpenAI error object; ``[DONE]`` follows)."""
    if isinstance(e, EngineDeadError):
        return _sse(OpenAIError(500, str(e), None, "engine_dead").body())
    logger.error("stream %s failed: %r", request_id, e, exc_info=e)
    return _sse(OpenAIError(500, f"internal server error: {type(e).__name__}", None, "internal_error").body())
