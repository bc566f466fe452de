"""Pure ASGI middlewares (they run before the body is read): the API key and the body size limit."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
from typing import TYPE_CHECKING

from fastapi.exceptions import HTTPException

from tokenmill.server.protocol import OpenAIError
from tokenmill.server.responses import _dumps

if TYPE_CHECKING:
    from collections.abc import Iterable

    from starlette.types import ASGIApp, Message, Receive, Scope, Send


async def _send_error(send: Send, status: int, message: str, code: str | None,
                      headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = _dumps(OpenAIError(status, message, None, code).body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


# Open with --api-key set: a load balancer's health check carries no key.
OPEN_PATHS = frozenset({"/health"})


class AuthMiddleware:
    """Every route but /health needs ``Authorization: Bearer <api_key>``, compared in constant time
    (HTTP paths the app does not have get the same 401: nothing about the routes leaks without it). A
    browser cannot send a bearer token when it opens a page, so the key is also taken as HTTP Basic
    auth's password (any user name), and /dashboard's 401 asks the browser for it."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    def _authorized(self, given: bytes) -> bool:
        scheme, _, token = given.partition(b" ")
        scheme, token = scheme.lower(), token.strip()
        if scheme == b"basic":
            try:
                token = base64.b64decode(token, validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                return False
        elif scheme != b"bearer":
            return False
        return hmac.compare_digest(token, self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = b""
            for k, v in scope["headers"]:
                if k == b"authorization":
                    given = v
                    break
            if not self._authorized(given):
                page = scope["path"].startswith("/dashboard")
                challenge = b'Basic realm="tokenmill", charset="UTF-8"' if page else b"Bearer"
                await _send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'"
                                  + (" or the key as the Basic auth password" if page else ""),
                                  "invalid_api_key", [(b"www-authenticate", challenge)])
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Requests with bodies over ``limit`` bytes get 413, by Content-Length or while streaming in; a body
    whose next part takes longer than ``timeout`` seconds to come (slowloris) gets 408."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float = 30.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

        async def limited_receive() -> Message:
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
