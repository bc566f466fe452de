"""Pure ASGI middlewares (they run before the body is read): the API key and the body size limit."""

from __future__ import annotations

import asyncio
import hmac

from fastapi.exceptions import HTTPException

from tokenmill.server.protocol import OpenAIError
from tokenmill.server.responses import _dumps


async def _send_error(send, status: int, message: str, code: str | None, headers=()) -> None:  # noqa: ANN001
    body = _dumps(OpenAIError(status, message, None, code).body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


# Open with --api-key set: a load balancer's health check carries no key.
OPEN_PATHS = frozenset({"/health"})


class AuthMiddleware:
    """Every route but /health needs ``Authorization: Bearer <api_key>``, compared in constant time
    (HTTP paths the app does not have get the same 401: nothing about the routes leaks without it)."""

    def __init__(self, app, api_key: str) -> None:  # noqa: ANN001
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
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
    """Requests with bodies over ``limit`` bytes get 413, by Content-Length or while streaming in; a body
    whose next part takes longer than ``timeout`` seconds to come (slowloris) gets 408."""

    def __init__(self, app, limit: int, timeout: float = 30.0) -> None:  # noqa: ANN001
        self.app = app
        self.limit = limit
        self.timeout = timeout

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
        body_done = False

        async def limited_receive():  # noqa: ANN202
            nonlocal received, body_done
            if body_done:  # afterwards receive() waits for the client to leave: no deadline on that
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.timeout:g} s "
                                         "(--request-body-timeout)") from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, f"request body is larger than the limit of {self.limit} bytes "
                                             "(--max-request-bytes)")
            return message

        await self.app(scope, limited_receive, send)
