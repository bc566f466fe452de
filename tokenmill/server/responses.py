"""JSON and server-sent-event responses: OpenAI error bodies, and the SSE response that notices a client
going away."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse

from tokenmill.server.protocol import OpenAIError

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

logger = logging.getLogger("tokenmill.server")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _error_response(e: OpenAIError) -> Response:
    return json_response(e.body(), e.status, e.headers)


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events that also watch for the client going away.

    Streams ``events`` while listening for ``http.disconnect``; whichever ends first, the other
    is cancelled and ``on_close`` runs (it aborts the requests), also when the server cancels us.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
